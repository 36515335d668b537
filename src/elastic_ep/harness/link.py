"""A test host's link: shaped (delay, loss, rate), cut and healed, from inside its namespace.

The controls all act on the host's `eth0`, so traffic between a host's own processes is never
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
"""

from __future__ import annotations

import select
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

IFNAME = "eth0"
INSTALL_HINT = "run scripts/install-netbed-deps.sh (or: apt-get install -y iproute2 nftables iptables)"


class NetbedError(RuntimeError):
    """The test bed could not be built, changed or removed; the message says what and why."""


def run_tool(cmd: list[str], *, input: str | None = None, check: bool = True,
             timeout_s: float = 30.0) -> subprocess.CompletedProcess[str]:
    """Run a plumbing command; raises NetbedError naming the command and its stderr."""
    try:
        done = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=timeout_s)
    except FileNotFoundError:
        raise NetbedError(f"`{cmd[0]}` not found: {INSTALL_HINT}") from None
    if check and done.returncode != 0:
        raise NetbedError(f"`{' '.join(cmd)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done


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


class Link:
    """The link of the host in namespace `name`: `exec(cmd)` wraps a command to run inside it,
    `emulator()` says "netem" or "userspace" (decided once per bed)."""

    def __init__(self, name: str, exec: Callable[[list[str]], list[str]], emulator: Callable[[], str]):
        self.name, self.exec, self.emulator = name, exec, emulator
        self.shape = LinkShape()
        self.is_cut = False
        self._delayer: subprocess.Popen | None = None

    def set(self, shape: LinkShape) -> None:
        """Shape the link: a fixed delay, a random loss share, a rate cap (which direction each
        acts on: module docstring). Replaces the previous shape; LinkShape() is a clean link.
        Raises NetbedError when a tool is missing, the kernel refuses or the packet delayer died."""
        if self.emulator() == "netem":
            self._set_netem(shape)
            self.shape = shape
        else:
            self._set_delay(shape.delay_ms)
            self._set_tbf(shape.rate_mbit)
            self.shape = shape
            self._write_filters()

    def cut(self) -> None:
        """Make the host unreachable while it keeps running: every IP packet into or out of its
        link is dropped. Idempotent."""
        self.is_cut = True
        self._write_filters()

    def heal(self) -> None:
        """Undo cut(); connections that were not timed out by their owners carry on."""
        self.is_cut = False
        self._write_filters()

    def _set_netem(self, shape: LinkShape) -> None:
        if shape == LinkShape():
            if self.shape != LinkShape():
                self._tool(["tc", "qdisc", "del", "dev", IFNAME, "root"])
            return
        args = ["delay", f"{shape.delay_ms}ms", "loss", f"{shape.loss_pct}%", "limit", "100000"]
        if shape.rate_mbit is not None:
            args += ["rate", f"{shape.rate_mbit}mbit"]
        self._tool(["tc", "qdisc", "replace", "dev", IFNAME, "root", "netem", *args])

    def _set_tbf(self, rate_mbit: float | None) -> None:
        if rate_mbit is None:
            if self.shape.rate_mbit is not None:
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
        proc = subprocess.Popen(self.exec([sys.executable, script, "--delay-ms", str(delay_ms)]),
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
            proc.wait(timeout=self.shape.delay_ms / 1000 + 5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def _write_filters(self) -> None:
        """Render this host's nftables table (loss and cut) from scratch, in one transaction."""
        egress, ingress = [], []
        if self.is_cut:
            egress.append("meta protocol { ip, ip6 } drop")
            ingress.append("meta protocol { ip, ip6 } drop")
        if self.shape.loss_pct and self.emulator() == "userspace":
            ingress.append(f"meta protocol {{ ip, ip6 }} numgen random mod 100000 "
                           f"< {round(self.shape.loss_pct * 1000)} drop")
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
        run_tool(self.exec(cmd), input=input)

    def kill_delayer(self) -> None:
        """Stop the packet delayer at once (the host is being torn down)."""
        if self._delayer is not None:
            self._delayer.kill()
            self._delayer.wait()
            self._delayer = None
