"""The network test bed (elastic_ep.harness.netns): every link control lands, measured with real
sockets between namespace hosts, and nothing outlives a bed, even one whose creator was killed.

Timing is asserted from below only (a delay makes things at least that slow); "faster" is only
ever relative to a measurement in the same test.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from elastic_ep.harness.netns import Host

PROBE = Path(__file__).with_name("netprobe.py")
ECHO_PORT, CLOSED_PORT = 7001, 9


def start_probe(host: Host) -> subprocess.Popen:
    proc = host.popen([sys.executable, str(PROBE), "serve"], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready", f"probe server on {host} did not start"
    return proc


def probe(host: Host, command: str, target: Host, arg: int):
    """Run a netprobe client command on `host` against `target`; its JSON result."""
    done = host.run([sys.executable, str(PROBE), command, target.addr, str(arg)], timeout_s=120)
    return json.loads(done.stdout)


@pytest.fixture(params=["userspace", "netem"])
def shaped_bed(request, netbed):
    """Makes beds whose set_link uses one emulator; the netem case skips where the kernel has none."""
    def make(n_hosts: int):
        bed = netbed(n_hosts, link_emulator="userspace" if request.param == "userspace" else "auto")
        if request.param == "netem" and bed.link_emulator != "netem":
            pytest.skip("this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM): the userspace path stands in")
        return bed
    return make


def test_delay_adds_to_each_direction_it_is_set_on(shaped_bed):
    a, b = shaped_bed(2).hosts
    start_probe(b)
    clean = probe(a, "rtt", b, 20)
    a.set_link(delay_ms=20)
    one_way = probe(a, "rtt", b, 10)
    b.set_link(delay_ms=20)
    both_ways = probe(a, "rtt", b, 10)
    a.set_link()
    b.set_link()
    cleared = probe(a, "rtt", b, 20)
    print(f"min RTT ms: clean {min(clean):.3f}, 20 ms on a {min(one_way):.3f}, on both {min(both_ways):.3f}, "
          f"cleared {min(cleared):.3f}")
    assert min(one_way) >= 20
    assert min(both_ways) >= 40
    assert min(cleared) < min(one_way) / 2


def test_loss_drops_about_the_share_asked(shaped_bed):
    a, b = shaped_bed(2).hosts
    start_probe(b)
    assert probe(a, "udp", b, 2000) == 2000, "a clean link lost datagrams: the count itself is wrong"
    for host in (a, b):  # a datagram a -> b is dropped once: leaving a (netem) or arriving at b
        host.set_link(loss_pct=1)
    sent = 10_000
    lost = sent - probe(a, "udp", b, sent)
    print(f"1% loss: {lost} of {sent} datagrams lost")
    assert 20 <= lost <= 250  # binomial(10000, 1%): mean 100, sd 10


def test_rate_limit_bounds_throughput(shaped_bed):
    a, b = shaped_bed(2).hosts
    start_probe(b)
    nbytes, rate_mbit = 1_000_000, 16
    free_s = probe(a, "send", b, nbytes)
    a.set_link(rate_mbit=rate_mbit)
    limited_s = probe(a, "send", b, nbytes)
    print(f"{nbytes} B: {free_s * 1000:.1f} ms free, {limited_s * 1000:.1f} ms at {rate_mbit} Mbit/s")
    assert limited_s >= 0.8 * nbytes * 8 / (rate_mbit * 1e6)
    assert limited_s > free_s


def test_cut_host_is_silent_while_the_others_talk_and_heal_resumes_it(netbed):
    a, b, c = netbed(3).hosts
    server_a = start_probe(a)
    start_probe(c)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((a.addr, CLOSED_PORT), timeout=5)
    established = socket.create_connection((a.addr, ECHO_PORT), timeout=5)
    established.sendall(b"1")
    assert established.recv(1) == b"1"

    a.cut()
    established.settimeout(1)
    established.sendall(b"2")
    with ThreadPoolExecutor() as pool:  # the checks run side by side: each waits out a timeout
        b_to_a, a_to_c = pool.submit(probe, b, "reach", a, 1), pool.submit(probe, a, "reach", c, 1)
        b_to_c, b_c_rtt = pool.submit(probe, b, "reach", c, 1), pool.submit(probe, b, "rtt", c, 5)
        closed_port = pool.submit(socket.create_connection, (a.addr, CLOSED_PORT), timeout=1)
        with pytest.raises(TimeoutError):
            established.recv(1)
        with pytest.raises(TimeoutError):  # silent: not refused, even where nothing listens
            closed_port.result()
        assert (b_to_a.result(), a_to_c.result(), b_to_c.result()) == ("timeout", "timeout", "ok")
        assert len(b_c_rtt.result()) == 5
    assert server_a.poll() is None, "the cut host's process should keep running"

    a.heal()
    established.settimeout(30)
    assert established.recv(1) == b"2"  # TCP's retransmission got through after heal
    established.close()
    assert probe(b, "reach", a, 5) == "ok"


def _root_rules() -> str:
    return (subprocess.run(["nft", "list", "ruleset"], capture_output=True, text=True, check=True).stdout
            + subprocess.run(["iptables-legacy-save"], capture_output=True, text=True, check=True).stdout)


def _bed_leftovers(tag: str) -> list[str]:
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    return [line for line in (netns + links).splitlines() if f"eep{tag}" in line]


def _netns_pids(netns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True, check=True).stdout
    return [int(p) for p in out.split()]


def _alive(pid: int) -> bool:
    """Running, not a zombie (one killed whose parent died is reaped by init in its own time)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_close_leaves_no_namespace_link_rule_or_process(netbed):
    rules_before = _root_rules()
    bed = netbed(2)
    a, b = bed.hosts
    start_probe(b)
    a.set_link(delay_ms=5, loss_pct=1, rate_mbit=100)
    a.cut()
    pids = [p for h in bed.hosts for p in _netns_pids(h.name)]
    assert len(pids) >= 2, "the probe server and the packet delayer should be running"
    assert _bed_leftovers(bed.tag)
    bed.close()
    assert _bed_leftovers(bed.tag) == []
    assert [p for p in pids if _alive(p)] == []
    assert _root_rules() == rules_before


def test_beds_made_side_by_side_are_apart(netbed):
    (a,), (b,) = netbed(1).hosts, netbed(1).hosts
    assert a.addr.rsplit(".", 1)[0] != b.addr.rsplit(".", 1)[0]
    start_probe(b)
    assert "Network is unreachable" in a.run([sys.executable, str(PROBE), "reach", b.addr, "1"], check=False).stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping CAP_NET_ADMIN needs root")
def test_without_cap_net_admin_the_bed_says_why():
    done = subprocess.run(["setpriv", "--bounding-set", "-net_admin", sys.executable, "-c",
                           "from elastic_ep.harness.netns import TestBed; TestBed(1)"],
                          capture_output=True, text=True)
    assert done.returncode != 0
    assert "NetbedError: no CAP_NET_ADMIN (not root?)" in done.stderr


def test_a_bed_whose_creator_was_killed_is_swept_by_the_next(netbed):
    creator = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time; from elastic_ep.harness.netns import TestBed\n"
         "bed = TestBed(2)\n"
         "bed.hosts[0].popen(['sleep', '600'])\n"
         "bed.hosts[1].set_link(delay_ms=5)\n"
         "print(bed.tag, bed.hosts[0].name, flush=True)\n"
         "time.sleep(600)\n"],
        stdout=subprocess.PIPE, text=True)
    tag, netns = creator.stdout.readline().split()
    creator.kill()
    creator.wait()
    orphans = _netns_pids(netns)
    assert orphans and _bed_leftovers(tag), "the killed creator's bed should still be there before the sweep"

    netbed(1)
    assert _bed_leftovers(tag) == []
    assert [p for p in orphans if _alive(p)] == []
