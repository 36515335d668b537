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

Link controls (`set_link`, `cut`, `heal`, and what they cost): harness/link.py.

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
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Literal

from .link import IFNAME, INSTALL_HINT, Link, LinkShape, NetbedError, run_tool

SUBNET_POOL = ipaddress.ip_network("10.213.0.0/16")
BRIDGE_HOST = 254
NAME = re.compile(r"^eep([0-9a-f]+)x([0-9a-f]+)(br|h\d+)$")
LOCK_PATH = Path("/run/elastic-ep-netbed.lock")
CAP_NET_ADMIN = 12
_bed_seq = itertools.count()

LinkEmulator = Literal["auto", "netem", "userspace"]


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


def _creator_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: alive
    return True


def _netns_names() -> list[str]:
    return [line.split()[0] for line in run_tool(["ip", "netns", "list"]).stdout.splitlines() if line.strip()]


def _link_names() -> list[str]:
    return [link["ifname"] for link in json.loads(run_tool(["ip", "-j", "link", "show"]).stdout or "[]")]


def _kill_netns_processes(netns: str, timeout_s: float = 10.0) -> None:
    """SIGKILL every process in `netns` and wait until none is left (or raise NetbedError)."""
    deadline = time.monotonic() + timeout_s
    while pids := run_tool(["ip", "netns", "pids", netns], check=False).stdout.split():
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
            run_tool(["ip", "link", "del", netns], check=False)
            run_tool(["ip", "netns", "del", netns])
    for link in _link_names():
        m = NAME.match(link)
        if m and not _creator_alive(int(m.group(1), 16)):
            run_tool(["ip", "link", "del", link], check=False)


def _free_subnet() -> ipaddress.IPv4Network:
    """The first /24 of SUBNET_POOL that no address or route of the root namespace overlaps."""
    taken = []
    for entry in json.loads(run_tool(["ip", "-j", "-4", "addr", "show"]).stdout or "[]"):
        for a in entry.get("addr_info", []):
            taken.append(ipaddress.ip_network(f"{a['local']}/{a['prefixlen']}", strict=False))
    for route in json.loads(run_tool(["ip", "-j", "-4", "route", "show", "table", "all"]).stdout or "[]"):
        if route.get("dst", "default") != "default":
            taken.append(ipaddress.ip_network(route["dst"], strict=False))
    for subnet in SUBNET_POOL.subnets(new_prefix=24):
        if not any(subnet.overlaps(t) for t in taken):
            return subnet
    raise NetbedError(f"no free /24 left in {SUBNET_POOL}: addresses or routes of this machine cover it "
                      "(`ip -4 route`); remove them or close other test beds")


class Host:
    """One namespace host of a TestBed: its address, processes and link."""

    def __init__(self, bed: TestBed, index: int, name: str, addr: str):
        self.bed, self.index, self.name, self.addr = bed, index, name, addr
        self.ifname = IFNAME
        self.processes: list[subprocess.Popen] = []
        self._link = Link(name, self._exec, lambda: bed.link_emulator)

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
        return [int(p) for p in run_tool(["ip", "netns", "pids", self.name], check=False).stdout.split()]

    def lose(self) -> None:
        """Whole-host loss: SIGKILL every process inside this host at once. The link stays up,
        its shape cleared (the packet delayer was one of those processes)."""
        self.set_link()
        _kill_netns_processes(self.name)
        for proc in self.processes:
            proc.wait(10)

    @property
    def link(self) -> LinkShape:
        return self._link.shape

    @property
    def is_cut(self) -> bool:
        return self._link.is_cut

    def set_link(self, delay_ms: float = 0.0, loss_pct: float = 0.0, rate_mbit: float | None = None) -> None:
        """Shape this host's link (harness/link.py `Link.set`); no arguments: a clean link."""
        self._link.set(LinkShape(delay_ms, loss_pct, rate_mbit))

    def cut(self) -> None:
        """Make this host unreachable while it keeps running (harness/link.py `Link.cut`)."""
        self._link.cut()

    def heal(self) -> None:
        """Undo cut()."""
        self._link.heal()

    def _stop(self, term_grace_s: float) -> None:
        """Stop the delayer and this host's processes, then everything left in the namespace."""
        self._link.kill_delayer()
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
            run_tool(["ip", "link", "add", self.bridge, "type", "bridge"])
            run_tool(["ip", "addr", "add", f"{self.subnet[BRIDGE_HOST]}/24", "dev", self.bridge])
            run_tool(["ip", "link", "set", self.bridge, "up"])
        self.bridge_addr = str(self.subnet[BRIDGE_HOST])
        for i in range(n_hosts):
            host = Host(self, i, f"eep{self.tag}h{i}", str(self.subnet[i + 1]))
            self.hosts.append(host)
            run_tool(["ip", "netns", "add", host.name])
            run_tool(["ip", "link", "add", host.name, "type", "veth", "peer", "name", IFNAME, "netns", host.name])
            run_tool(["ip", "link", "set", host.name, "master", self.bridge, "up"])
            run_tool(["ip", "-n", host.name, "addr", "add", f"{host.addr}/24", "dev", IFNAME])
            run_tool(["ip", "-n", host.name, "link", "set", IFNAME, "up"])
            run_tool(["ip", "-n", host.name, "link", "set", "lo", "up"])

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
        if run_tool(probe, check=False).returncode != 0:
            return False
        run_tool(self.hosts[0]._exec(["tc", "qdisc", "del", "dev", IFNAME, "root"]))
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
            if (done := run_tool(["ip", "link", "del", name], check=False)).returncode:
                errors.append(done.stderr.strip())
        namespaces = set(_netns_names())
        for host in self.hosts:
            if (host.name in namespaces
                    and (done := run_tool(["ip", "netns", "del", host.name], check=False)).returncode):
                errors.append(done.stderr.strip())
        if errors:
            raise NetbedError(f"test bed {self.tag} not fully removed: " + "; ".join(errors))

    def __enter__(self) -> TestBed:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
