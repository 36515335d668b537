"""`elastic-ep agent`: a node agent on another host, joining a running controller (--controller, or
with --etcd the leader of a controller group, followed to each new leader); with
`--join-mode recover` a repaired or replacement node that takes over ranks that are down. It
holds the deployment's cluster key (`--cluster-key-file`, the file `serve` wrote), without which
the controller drops everything it sends.

Its worker zygote (node/zygote.py) starts once the arguments are checked (and, with --etcd, the
group's leader found), before this process imports torch with the agent: the two imports run side
by side."""

from __future__ import annotations

import argparse
import signal
import socket
import threading
import time

from elastic_ep.commands.log_options import add_log_arguments, configure_logging
from elastic_ep.errors import ElasticEPError
from elastic_ep.group.leader_watch import LeaderWatch
from elastic_ep.group.store import GroupStore
from elastic_ep.node.zygote import Zygote, early_zygote


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--controller", default=None, metavar="ADDR",
                        help="the controller's agent address, tcp://HOST:PORT, as `elastic-ep serve` prints it "
                             "(or --etcd and --ha-group)")
    parser.add_argument("--etcd", default=None, metavar="URL",
                        help="instead of --controller: find the leader of the controller group --ha-group through "
                             "the etcd at URL, and follow it when another controller takes over")
    parser.add_argument("--ha-group", default=None, metavar="NAME", help="with --etcd: the controller group's name")
    parser.add_argument("--node", required=True, help="this node's name (failure domain), unique per agent")
    parser.add_argument("--cluster-key-file", required=True, metavar="PATH",
                        help="the deployment's cluster key, a copy of the file `elastic-ep serve` wrote (mode 0600)")
    parser.add_argument("--ranks", type=int, default=1, help="EP ranks this node offers (default 1)")
    parser.add_argument("--stop-grace-s", type=float, default=3.0,
                        help="on shutdown, SIGKILL workers still alive this long after SIGTERM (default 3)")
    parser.add_argument("--join-mode", choices=["initial", "recover"], default="initial",
                        help="initial: offer new ranks; recover: take over ranks that are down (a repaired or "
                             "replacement node); default initial")
    parser.add_argument("--auto-recover", action="store_true",
                        help="restart this node's ranks that die here, with backoff, instead of waiting for "
                             "the controller's --restart-delay-s")
    parser.add_argument("--restart-backoff-s", type=float, default=1.0,
                        help="with --auto-recover: wait before the first restart, doubled per death in a row "
                             "(default 1)")
    parser.add_argument("--restart-backoff-max-s", type=float, default=30.0,
                        help="with --auto-recover: longest wait between restarts (default 30)")
    parser.add_argument("--exit-poll-interval-s", type=float, default=0.005,
                        help="how often the workers' /proc stat is read, so a worker's death is reported when "
                             "it begins, not once its memory is freed (default 0.005)")
    parser.add_argument("--advertise-host", default=None,
                        help="this host's address: other nodes reach its agent (backup, dense weights) and its ranks' "
                             "data plane there (default: the address of the interface that reaches the controller)")
    parser.add_argument("--lease-s", type=float, default=5.0,
                        help="with no word from the controller this long, kill this node's ranks and register "
                             "again in recover mode (the node fences itself when it is cut off)")
    parser.add_argument("--hardware-interval-s", type=float, default=1.0,
                        help="read this node's hardware signals (CPU steal and frequency; NVML ECC, clocks, "
                             "throttle reasons, Xid where present) this often (default 1.0)")
    parser.add_argument("--step-results-via", choices=["direct", "agent"], default="direct",
                        help="where the workers' step results go: direct (each to the controller) or agent (to "
                             "their node's agent on loopback, which sends the controller one frame per step for its "
                             "ranks: fewer frames for the control thread; default direct)")
    parser.add_argument("--step-plans-via", choices=["direct", "agent"], default="direct",
                        help="where this node's step plans come from: direct (each rank's from the controller) or "
                             "agent (one frame per step for the node from the controller's plan socket, relayed "
                             "as it came to the ranks on loopback; for a controller run with --step-plans-via "
                             "agent; default direct)")
    parser.add_argument("--worker-start", choices=["fork", "exec"], default="fork",
                        help="how this node's ranks start: fork (from a zygote process of the agent that imported "
                             "torch and the worker once: a rank starts or restarts without importing anything) or "
                             "exec (a new Python each time; also what fork falls back to while the zygote is not "
                             "ready; default fork)")
    parser.add_argument("--connect-timeout-s", type=float, default=30.0,
                        help="at start, wait this long for the controller to accept a connection, then give up "
                             "naming the address (default 30)")
    add_log_arguments(parser)


def controller_address(text: str) -> str:
    """--controller as tcp://HOST:PORT. Refuses an HTTP URL: that is the API, not the controller."""
    if "://" in text and not text.startswith("tcp://"):
        raise ElasticEPError(
            f"--controller {text} is not the controller's agent address: pass the tcp://HOST:PORT that "
            "`elastic-ep serve` logs as \"controller at tcp://...\" (also `controller` in GET /cluster), not the "
            "HTTP URL")
    return text if text.startswith("tcp://") else f"tcp://{text}"


def wait_for_controller(controller: str, timeout_s: float) -> None:
    """Until a TCP connection to `controller` (tcp://HOST:PORT) succeeds, retrying every 0.2 s
    (the controller may still be starting). Raises ElasticEPError naming the address and the
    flag after timeout_s."""
    host, _, port = controller.removeprefix("tcp://").rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=max(0.1, min(1.0, timeout_s))):
                return
        except ValueError:
            raise ElasticEPError(f"--controller {controller} is not tcp://HOST:PORT") from None
        except OSError as e:
            if time.monotonic() >= deadline:
                raise ElasticEPError(
                    f"cannot reach the controller at {controller} within --connect-timeout-s {timeout_s:g} "
                    f"({e.strerror or e}): is `elastic-ep serve` running there, and is this its \"controller at "
                    "tcp://...\" address? Check --controller, and that this host can reach it") from None
        time.sleep(0.2)


def address_towards(controller: str) -> str:
    """The address of this host's interface that routes to `controller` (tcp://HOST:PORT). A
    UDP connect only looks up the route: nothing is sent."""
    host, _, port = controller.removeprefix("tcp://").rpartition(":")
    try:
        family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host.strip("[]"), int(port)))
            return s.getsockname()[0]
    except (OSError, ValueError) as e:
        raise ElasticEPError(f"no route to the controller {controller} ({e}); check --controller, or pass this "
                             "host's address with --advertise-host") from None


def find_leader(args: argparse.Namespace) -> LeaderWatch:
    """The group's LeaderWatch, once it knows a leader whose controller is up (within
    --connect-timeout-s, else ElasticEPError naming the group and etcd)."""
    if args.ha_group is None:
        raise ElasticEPError("--etcd needs --ha-group NAME, the controller group's name (as given to serve)")
    try:
        watch = LeaderWatch(GroupStore(args.etcd, args.ha_group))
    except ValueError as e:
        raise ElasticEPError(str(e)) from None
    if watch.wait_for_leader(args.connect_timeout_s) is None:
        raise ElasticEPError(f"no leader of group {args.ha_group} in etcd {args.etcd} within --connect-timeout-s "
                             f"{args.connect_timeout_s:g} ({watch.error or 'no controller has been elected'}): is "
                             "`elastic-ep serve --etcd ... --ha-group ...` running?")
    return watch


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_level, args.log_format)
    if (args.controller is None) == (args.etcd is None):
        raise ElasticEPError("give the controller: either --controller tcp://HOST:PORT, or --etcd URL --ha-group NAME")
    if not args.connect_timeout_s > 0:
        raise ElasticEPError(f"--connect-timeout-s must be > 0 seconds, got {args.connect_timeout_s}")
    watch = find_leader(args) if args.etcd else None
    controller = watch.leader.controller if watch else controller_address(args.controller)
    if args.lease_s <= 0:
        raise ElasticEPError(f"--lease-s must be > 0 seconds, got {args.lease_s}")
    if args.hardware_interval_s <= 0:
        raise ElasticEPError(f"--hardware-interval-s must be > 0 seconds, got {args.hardware_interval_s}")
    zygote = early_zygote(args.ranks, args.worker_start)
    try:
        return _run_agent(args, controller, watch, zygote)
    finally:
        if zygote is not None:  # the agent's from its start, closed by it; this one if the agent failed before
            zygote.close()


def _run_agent(args: argparse.Namespace, controller: str, watch: LeaderWatch | None, zygote: Zygote | None) -> int:
    # torch, with the agent and the wire: after the zygote started (module docstring)
    from elastic_ep.node.agent import NodeAgent
    from elastic_ep.wire import ClusterKey, ClusterKeyError

    try:
        key = ClusterKey.read(args.cluster_key_file)
    except ClusterKeyError as e:
        raise ElasticEPError(f"--cluster-key-file: {e}") from None
    host = args.advertise_host or address_towards(controller)
    wait_for_controller(controller, args.connect_timeout_s)
    agent = NodeAgent(controller, args.node, key, host, args.ranks, args.stop_grace_s, args.join_mode,
                      args.auto_recover, args.restart_backoff_s, args.restart_backoff_max_s, lease_s=args.lease_s,
                      exit_poll_s=args.exit_poll_interval_s, standalone=True,
                      hardware_interval_s=args.hardware_interval_s, leader_watch=watch,
                      step_results_via=args.step_results_via, step_plans_via=args.step_plans_via,
                      worker_start=args.worker_start, zygote=zygote)
    print(f"elastic-ep agent {args.node}: {args.ranks} ranks on {host}, controller {controller}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    agent.run(stop)
    return 0
