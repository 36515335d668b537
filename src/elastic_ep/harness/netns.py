"""A multi-host test bed on one machine: each host is a Linux network namespace with one veth
link to a shared bridge, and its link can be slowed, made lossy, rate-limited or cut.

    with TestBed(3) as bed:
        a, b, c = bed.hosts
        server = b.popen([sys.executable, "-m", "http.server", "--bind", b.addr, "8000"])
        a.set_link(delay_ms=20, loss_pct=1)
        c.cut()       # alive, but nothing reaches it and nothing leaves it
        c.heal()

Layout. A bed takes a free /24 in 10.213.0.0/16 (one no address or route of this machine
touches; parallel beds take different ones). Host i is `10.213.K.(i+1)` on `eth0` inside
namespace `eep<pid>x<seq>h<i>`; the bridge `eep<pid>x<seq>br` in the root namespace holds
`10.213.K.254`, so the test process itself reaches every host (and its traffic crosses the
host's link like any other). Nothing is routed beyond the bridge.

Link controls (all act on the host's `eth0`, so traffic between a host's own processes is never
touched, and every rule lives inside the host's namespace and dies with it):
- `set_link(delay_ms, loss_pct, rate_mbit)` shapes the host's link; a call replaces the previous
  shape, `set_link()` restores a clean link. A packet between two hosts crosses two links, and
  each control acts once on one of them:
  - with the kernel's `netem` qdisc (used when the kernel has it): delay, loss and rate all act on
    packets leaving the host (one netem qdisc);
  - without it (`link_emulator="userspace"`): delay and loss act on packets arriving at the host,
    rate on packets leaving it. Delay: an xtables NFQUEUE rule (iptables-legacy, raw PREROUTING)
    feeds `nfqueue_delay`, a process in the namespace that holds each packet for the delay. Loss:
    an nftables rule on the netdev ingress hook drops that share of IP packets at random. Rate:
    a `tbf` qdisc.
  So round trips, and anything set on every host, come out the same with either: 20 ms on host
  a alone makes every a <-> b round trip at least 20 ms; 20 ms on every host makes every one-way
  trip between hosts at least 20 ms. Which direction of a one-way trip a single host's delay or
  loss hits depends on the emulator (`bed.link_emulator`).
- `cut()` drops every IPv4/IPv6 packet in and out of `eth0` (nftables, netdev ingress and
  egress hooks); `heal()` removes that. Processes on a cut host keep running; peers see
  timeouts, never "connection refused", and established connections resume after `heal()`.

Limitations, measured on this project's 2-core machine under other load:
- The userspace delay stamps a packet when the delayer reads it, so load adds to the delay (never
  subtracts): 2/10/20 ms give round-trip medians of 2.2/10.25/20.3 ms, with tails of several ms
  (p99) when the machine is busy. Its own cost is about 10 us per packet (round trip 0.017 ms
  clean, 0.029 ms through the delayer at 0 ms); one TCP stream passes 6-8 Gbit/s through it at
  0 ms (5-13 clean). The delay is constant: no jitter, no reordering.
- It delays on the receiving side because holding packets on the sending side would stall TCP:
  the sender's small-queue limit counts packets it still holds, so one connection would carry a
  couple of packets per delay period (64 kB took 270 ms at 20 ms). netem releases that hold.
- Userspace loss and cut act on IP packets only (ARP passes), which is why peers of a cut host
  time out instead of getting "no route to host".
- A delayer that dies leaves the packets arriving at its host unanswered: the link looks cut.

Clean-up. `close()` (and leaving the `with` block) stops every process in the bed's namespaces:
those from `popen` get SIGTERM and `term_grace_s` to exit, then everything still inside a
namespace gets SIGKILL; then the links, namespaces and bridge are deleted. A bed whose creator
died without closing it (SIGKILL) is swept, processes and all, by the next `TestBed` on the
machine: the creator's pid is in every name. Beds made at the same time take turns on the lock
file /run/elastic-ep-netbed.lock while they sweep and claim a subnet.

Needs root (CAP_NET_ADMIN) and `ip`/`tc` (iproute2); the controls also need `nft` (nftables) and
`iptables-legacy` (iptables): `scripts/install-netbed-deps.sh` installs them.
"""

from __future__ import annotations

import fcntl
import ipaddress
import itertools
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

SUBNET_POOL = ipaddress.ip_network("10.213.0.0/16")
BRIDGE_HOST = 254
IFNAME = "eth0"
NAME = re.compile(r"^eep([0-9a-f]+)x([0-9a-f]+)(br|h\d+)$")
LOCK_PATH = Path("/run/elastic-ep-netbed.lock")
CAP_NET_ADMIN = 12
INSTALL_HINT = "run scripts/install-netbed-deps.sh (or: apt-get install -y iproute2 nftables iptables)"
_bed_seq = itertools.count()

LinkEmulator = Literal["auto", "netem", "userspace"]


class NetbedError(RuntimeError):
    """The test bed could not be built, changed or removed; the message says what and why."""


def netbed_unavailable() -> str | None:
    """Why no test bed can be made on this machine (a pytest skip reason), or None."""
    cap_eff = next((line.split()[1] for line in Path("/proc/self/status").read_text().splitlines()
                    if line.startswith("CapEff:")), "0")
    if not int(cap_eff, 16) >> CAP_NET_ADMIN & 1:
        return ("no CAP_NET_ADMIN (not root?): the network test bed needs it to create namespaces and "
                "links; run the tests as root")
    if shutil.which("ip") is None:
        return f"no `ip` command: the network test bed needs iproute2; {INSTALL_HINT}"
    return None


def _run(cmd: list[str], *, input: str | None = None, check: bool = True,
         timeout_s: float = 30.0) -> subprocess.CompletedProcess[str]:
    """Run a plumbing command; raises NetbedError naming the command and its stderr."""
    try:
        done = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=timeout_s)
    except FileNotFoundError:
        raise NetbedError(f"`{cmd[0]}` not found: {INSTALL_HINT}") from None
    if check and done.returncode != 0:
        raise NetbedError(f"`{' '.join(cmd)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done


def _creator_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: alive
    return True


def _netns_names() -> list[str]:
    return [line.split()[0] for line in _run(["ip", "netns", "list"]).stdout.splitlines() if line.strip()]


def _link_names() -> list[str]:
    return [link["ifname"] for link in json.loads(_run(["ip", "-j", "link", "show"]).stdout or "[]")]


def _kill_netns_processes(netns: str, timeout_s: float = 10.0) -> None:
    """SIGKILL every process in `netns` and wait until none is left (or raise NetbedError)."""
    deadline = time.monotonic() + timeout_s
    while pids := _run(["ip", "netns", "pids", netns], check=False).stdout.split():
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            raise NetbedError(f"processes {pids} in namespace {netns} survived SIGKILL for {timeout_s}s")
        time.sleep(0.02)


def sweep_stale_beds() -> None:
    """Remove the namespaces, links and processes of beds whose creating process is gone."""
    for netns in _netns_names():
        m = NAME.match(netns)
        if m and not _creator_alive(int(m.group(1), 16)):
            _kill_netns_processes(netns)
            _run(["ip", "link", "del", netns], check=False)
            _run(["ip", "netns", "del", netns])
    for link in _link_names():
        m = NAME.match(link)
        if m and not _creator_alive(int(m.group(1), 16)):
            _run(["ip", "link", "del", link], check=False)


def _free_subnet() -> ipaddress.IPv4Network:
    """The first /24 of SUBNET_POOL that no address or route of the root namespace overlaps."""
    taken = []
    for entry in json.loads(_run(["ip", "-j", "-4", "addr", "show"]).stdout or "[]"):
        for a in entry.get("addr_info", []):
            taken.append(ipaddress.ip_network(f"{a['local']}/{a['prefixlen']}", strict=False))
    for route in json.loads(_run(["ip", "-j", "-4", "route", "show", "table", "all"]).stdout or "[]"):
        if route.get("dst", "default") != "default":
            taken.append(ipaddress.ip_network(route["dst"], strict=False))
    for subnet in SUBNET_POOL.subnets(new_prefix=24):
        if not any(subnet.overlaps(t) for t in taken):
            return subnet
    raise NetbedError(f"no free /24 left in {SUBNET_POOL}: addresses or routes of this machine cover it "
                      "(`ip -4 route`); remove them or close other test beds")


@dataclass(frozen=True)
class LinkShape:
    """How a host's link is shaped (which direction each control acts on: module docstring);
    the default is a clean link."""

    delay_ms: float = 0.0
    loss_pct: float = 0.0
    rate_mbit: float | None = None

    def __post_init__(self) -> None:
        if self.delay_ms < 0:
            raise ValueError(f"delay_ms {self.delay_ms} is negative")
        if not 0 <= self.loss_pct <= 100:
            raise ValueError(f"loss_pct {self.loss_pct} is outside 0..100")
        if self.rate_mbit is not None and self.rate_mbit <= 0:
            raise ValueError(f"rate_mbit {self.rate_mbit} must be positive (None: no limit)")


class Host:
    """One namespace host of a TestBed: its address, processes and link."""

    def __init__(self, bed: TestBed, index: int, name: str, addr: str):
        self.bed, self.index, self.name, self.addr = bed, index, name, addr
        self.ifname = IFNAME
        self.link = LinkShape()
        self.is_cut = False
        self.processes: list[subprocess.Popen] = []
        self._delayer: subprocess.Popen | None = None

    def __repr__(self) -> str:
        return f"Host({self.name}, {self.addr})"

    def _exec(self, cmd: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.name, *cmd]

    def run(self, cmd: list[str], *, timeout_s: float = 60.0, check: bool = True,
            input: str | None = None) -> subprocess.CompletedProcess[str]:
        """Run `cmd` inside this host and wait for it; output is captured as text. Raises
        subprocess.CalledProcessError on a non-zero exit when `check`, and
        subprocess.TimeoutExpired (after killing it) when it runs past timeout_s."""
        return subprocess.run(self._exec(cmd), input=input, capture_output=True, text=True,
                              timeout=timeout_s, check=check)

    def popen(self, cmd: list[str], **popen_kwargs) -> subprocess.Popen:
        """Start `cmd` inside this host (subprocess.Popen arguments pass through). The bed
        stops it at close(); the process keeps its pid (`ip netns exec` execs it)."""
        proc = subprocess.Popen(self._exec(cmd), **popen_kwargs)
        self.processes.append(proc)
        return proc

    def pids(self) -> list[int]:
        """Every process running inside this host."""
        return [int(p) for p in _run(["ip", "netns", "pids", self.name], check=False).stdout.split()]

    def lose(self) -> None:
        """Whole-host loss: SIGKILL every process inside this host at once. The link stays up,
        its shape cleared (the packet delayer was one of those processes)."""
        self.set_link()
        _kill_netns_processes(self.name)
        for proc in self.processes:
            proc.wait(10)

    def set_link(self, delay_ms: float = 0.0, loss_pct: float = 0.0, rate_mbit: float | None = None) -> None:
        """Shape this host's link: a fixed delay, a random loss share, a rate cap (which
        direction each acts on: module docstring). Replaces the previous shape; no arguments
        restore a clean link. Raises ValueError for impossible values, NetbedError when a tool
        is missing, the kernel refuses or the packet delayer died."""
        shape = LinkShape(delay_ms, loss_pct, rate_mbit)
        if self.bed.link_emulator == "netem":
            self._set_netem(shape)
            self.link = shape
        else:
            self._set_delay(shape.delay_ms)
            self._set_tbf(shape.rate_mbit)
            self.link = shape
            self._write_filters()

    def cut(self) -> None:
        """Make this host unreachable while it keeps running: every IP packet into or out of
        its link is dropped. Idempotent."""
        self.is_cut = True
        self._write_filters()

    def heal(self) -> None:
        """Undo cut(); connections that were not timed out by their owners carry on."""
        self.is_cut = False
        self._write_filters()

    def _set_netem(self, shape: LinkShape) -> None:
        if shape == LinkShape():
            if self.link != LinkShape():
                self._tool(["tc", "qdisc", "del", "dev", IFNAME, "root"])
            return
        args = ["delay", f"{shape.delay_ms}ms", "loss", f"{shape.loss_pct}%", "limit", "100000"]
        if shape.rate_mbit is not None:
            args += ["rate", f"{shape.rate_mbit}mbit"]
        self._tool(["tc", "qdisc", "replace", "dev", IFNAME, "root", "netem", *args])

    def _set_tbf(self, rate_mbit: float | None) -> None:
        if rate_mbit is None:
            if self.link.rate_mbit is not None:
                self._tool(["tc", "qdisc", "del", "dev", IFNAME, "root"])
            return
        # A burst of 4 ms of traffic (at least a few full frames) and at most 100 ms of queue.
        burst_bytes = max(int(rate_mbit * 1e6 / 8 * 0.004), 16 * 1024)
        self._tool(["tc", "qdisc", "replace", "dev", IFNAME, "root", "tbf", "rate", f"{rate_mbit}mbit",
                    "burst", str(burst_bytes), "latency", "100ms"])

    def _set_delay(self, delay_ms: float) -> None:
        rule = ["PREROUTING", "-i", IFNAME, "-j", "NFQUEUE", "--queue-num", "0"]
        if delay_ms and self._delayer is None:
            self._delayer = self._start_delayer(delay_ms)
            self._tool(["iptables-legacy", "-t", "raw", "-A", *rule])
        elif delay_ms:
            if self._delayer.poll() is not None:
                raise NetbedError(f"{self.name}: the packet delayer exited ({self._delayer.returncode}): "
                                  f"{self._delayer.stderr.read().strip()}")
            self._delayer.stdin.write(f"{delay_ms}\n")
            self._delayer.stdin.flush()
        elif self._delayer is not None:
            self._tool(["iptables-legacy", "-t", "raw", "-D", *rule])
            self._stop_delayer()

    def _start_delayer(self, delay_ms: float, ready_timeout_s: float = 30.0) -> subprocess.Popen:
        """Start nfqueue_delay in this host and wait for it to bind the queue."""
        script = str(Path(__file__).with_name("nfqueue_delay.py"))
        proc = subprocess.Popen(self._exec([sys.executable, script, "--delay-ms", str(delay_ms)]),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        ready, _, _ = select.select([proc.stdout], [], [], ready_timeout_s)
        if not ready or proc.stdout.readline().strip() != "ready":
            proc.kill()
            _, err = proc.communicate()
            raise NetbedError(f"{self.name}: the packet delayer did not start within {ready_timeout_s}s: "
                              f"{err.strip() or 'no error output'}")
        return proc

    def _stop_delayer(self) -> None:
        """Close the delayer's stdin: it releases what it holds, then exits (killed if it does not)."""
        proc, self._delayer = self._delayer, None
        proc.stdin.close()
        try:
            proc.wait(timeout=self.link.delay_ms / 1000 + 5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def _write_filters(self) -> None:
        """Render this host's nftables table (loss and cut) from scratch, in one transaction."""
        egress, ingress = [], []
        if self.is_cut:
            egress.append("meta protocol { ip, ip6 } drop")
            ingress.append("meta protocol { ip, ip6 } drop")
        if self.link.loss_pct and self.bed.link_emulator == "userspace":
            ingress.append(f"meta protocol {{ ip, ip6 }} numgen random mod 100000 < {round(self.link.loss_pct * 1000)} drop")
        script = "table netdev netbed {}\ndelete table netdev netbed\n"
        if egress or ingress:
            chains = [f"chain {hook} {{\ntype filter hook {hook} device \"{IFNAME}\" priority 0\n"
                      + "".join(rule + "\n" for rule in rules) + "}\n"
                      for hook, rules in (("egress", egress), ("ingress", ingress)) if rules]
            script += "table netdev netbed {\n" + "".join(chains) + "}\n"
        self._tool(["nft", "-f", "-"], input=script)

    def _tool(self, cmd: list[str], input: str | None = None) -> None:
        if shutil.which(cmd[0]) is None:
            raise NetbedError(f"`{cmd[0]}` not found: the link controls need it; {INSTALL_HINT}")
        _run(self._exec(cmd), input=input)

    def _stop(self, term_grace_s: float) -> None:
        """Stop the delayer and this host's processes, then everything left in the namespace."""
        if self._delayer is not None:
            self._delayer.kill()
            self._delayer.wait()
            self._delayer = None
        for proc in self.processes:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + term_grace_s
        for proc in self.processes:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        _kill_netns_processes(self.name)


class TestBed:
    """N namespace hosts on one bridge; built by the constructor, removed by close().

    Raises NetbedError when this machine cannot host it (netbed_unavailable() says why) or a
    step fails; whatever was built by then is removed first.
    """

    __test__ = False  # not a pytest test class

    def __init__(self, n_hosts: int, link_emulator: LinkEmulator = "auto", term_grace_s: float = 5.0):
        if not 1 <= n_hosts <= 100:
            raise ValueError(f"n_hosts {n_hosts} is outside 1..100")
        if reason := netbed_unavailable():
            raise NetbedError(reason)
        self.term_grace_s = term_grace_s
        self._link_emulator_asked = link_emulator
        self._link_emulator: Literal["netem", "userspace"] | None = None
        self.tag = f"{os.getpid():x}x{next(_bed_seq) % 256:x}"
        self.bridge = f"eep{self.tag}br"
        self.hosts: list[Host] = []
        self.closed = False
        try:
            self._build(n_hosts)
        except BaseException:
            self.close()
            raise

    def _build(self, n_hosts: int) -> None:
        LOCK_PATH.parent.mkdir(parents=True, exist_ok=True)
        with LOCK_PATH.open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one bed at a time sweeps, picks its subnet and claims it
            sweep_stale_beds()
            self.subnet = _free_subnet()
            _run(["ip", "link", "add", self.bridge, "type", "bridge"])
            _run(["ip", "addr", "add", f"{self.subnet[BRIDGE_HOST]}/24", "dev", self.bridge])
            _run(["ip", "link", "set", self.bridge, "up"])
        self.bridge_addr = str(self.subnet[BRIDGE_HOST])
        for i in range(n_hosts):
            host = Host(self, i, f"eep{self.tag}h{i}", str(self.subnet[i + 1]))
            self.hosts.append(host)
            _run(["ip", "netns", "add", host.name])
            _run(["ip", "link", "add", host.name, "type", "veth", "peer", "name", IFNAME, "netns", host.name])
            _run(["ip", "link", "set", host.name, "master", self.bridge, "up"])
            _run(["ip", "-n", host.name, "addr", "add", f"{host.addr}/24", "dev", IFNAME])
            _run(["ip", "-n", host.name, "link", "set", IFNAME, "up"])
            _run(["ip", "-n", host.name, "link", "set", "lo", "up"])

    @property
    def link_emulator(self) -> Literal["netem", "userspace"]:
        """The mechanism behind set_link, settled on first use: "netem" where the kernel has it
        (unless "userspace" was asked for). Raises NetbedError when "netem" was asked for and
        the kernel has none."""
        if self._link_emulator is None:
            has_netem = self._link_emulator_asked != "userspace" and self._kernel_has_netem()
            if self._link_emulator_asked == "netem" and not has_netem:
                raise NetbedError("this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM): "
                                  "use link_emulator='userspace' or 'auto'")
            self._link_emulator = "netem" if has_netem else "userspace"
        return self._link_emulator

    def _kernel_has_netem(self) -> bool:
        probe = self.hosts[0]._exec(["tc", "qdisc", "add", "dev", IFNAME, "root", "netem"])
        if _run(probe, check=False).returncode != 0:
            return False
        _run(self.hosts[0]._exec(["tc", "qdisc", "del", "dev", IFNAME, "root"]))
        return True

    def close(self) -> None:
        """Stop every process in the bed and delete its links, namespaces and bridge.
        Idempotent. Goes on past a failing step and raises NetbedError listing them at the end."""
        if self.closed:
            return
        self.closed = True
        errors = []
        for host in self.hosts:
            try:
                host._stop(self.term_grace_s)
            except NetbedError as e:
                errors.append(str(e))
        existing = set(_link_names())
        for name in [h.name for h in self.hosts if h.name in existing] + [self.bridge] * (self.bridge in existing):
            if (done := _run(["ip", "link", "del", name], check=False)).returncode:
                errors.append(done.stderr.strip())
        namespaces = set(_netns_names())
        for host in self.hosts:
            if host.name in namespaces and (done := _run(["ip", "netns", "del", host.name], check=False)).returncode:
                errors.append(done.stderr.strip())
        if errors:
            raise NetbedError(f"test bed {self.tag} not fully removed: " + "; ".join(errors))

    def __enter__(self) -> TestBed:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
