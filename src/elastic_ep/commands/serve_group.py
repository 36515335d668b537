"""`elastic-ep serve --etcd URL --ha-group NAME`: this controller in a group (group/election.py).

The controller is built first (sockets bound, not started), then the election and the HTTP server
start, behind a `GroupGate` (serve/group_gate.py): a standby answers /health, /ready, /cluster and
503 for the rest. Once elected, the controller starts in the term it won (every frame it sends
carries it), its agent address is published in its seat for `elastic-ep agent --etcd`, and the gate
hands every request to the real app. A new leader adopts the ranks the last one ran, as the cluster
record names them (control/membership/adoption.py), and runs the last one's unfinished requests on
from its copy of the journal (read from etcd, or streamed to it by the last leader with
--ha-journal-via direct: group/journal_stream.py) before it lets clients in, who re-attach to them
(group/adopted.py). Deposed (its
lease lapsed, or another holds the leader key), the process exits at once with EXIT_DEPOSED,
sending nothing more: its agents and workers outlive it, and a supervisor starts it again as a
standby. A controller whose --ha-journal-via is not its group's exits with code 2 before it takes a
seat, or as soon as it sees such a leader while standing by (`journal_via_conflict`)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import threading
import time
from typing import Any

import msgspec
from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from tokenizers import Tokenizer

from elastic_ep.commands.http_server import run_http
from elastic_ep.control.config import ServeConfig
from elastic_ep.control.controller import Controller
from elastic_ep.control.gc_policy import tune_for_serving
from elastic_ep.errors import ElasticEPError
from elastic_ep.group.adopted import AdoptedRequests
from elastic_ep.group.election import Election, Role
from elastic_ep.group.journal import (
    JournalCopy,
    Journaled,
    JournaledEngine,
    JournalReader,
    JournalWriter,
    LeaderJournal,
    unexpired,
)
from elastic_ep.group.journal_stream import DirectJournalWriter, JournalFollower, bind_journal_socket
from elastic_ep.group.record import RecordReader, RecordWriter
from elastic_ep.group.status import group_view, standby_reason
from elastic_ep.group.store import EtcdUnavailable, GroupStore, Seat
from elastic_ep.serve.app import create_app
from elastic_ep.serve.errors import APIError
from elastic_ep.serve.group_gate import GroupGate
from elastic_ep.serve.guard import HttpGuard
from elastic_ep.serve.openapi import error_responses
from elastic_ep.wire import ClusterKey

logger = logging.getLogger("elastic_ep.serve")
EXIT_DEPOSED = 3
EXIT_MISCONFIGURED = 2  # as any ElasticEPError (cli.py)
RECORD_INTERVAL_S = 0.5  # the cluster record's periodic write (what changes by itself: epochs, ranks, phases)


def _deposed(reason: str) -> None:
    """No longer the leader: stop here, before this process sends another frame (os._exit runs no
    cleanup, in particular not the controller's shutdown of the agents)."""
    logger.error("exiting: this controller no longer leads its group (%s); start it again to stand by", reason)
    logging.shutdown()
    os._exit(EXIT_DEPOSED)


def journal_via_conflict(ours: str, group: str, node: str, seats: list[Seat]) -> str | None:
    """What is wrong when this controller (`node`, started with --ha-journal-via `ours`) would join
    `group` whose controllers `seats` (the leader's first) take the journal the other way; None when
    they agree. A standby whose way differs from the leader's copies nothing, and leads without the
    last leader's requests."""
    for seat in seats:
        if seat.name != node and seat.journal_via != ours:  # its own seat may outlive a restart by a lease
            return (f"--ha-journal-via {ours}, but controller {seat.name} of group {group} ({seat.role}) runs with "
                    f"--ha-journal-via {seat.journal_via}: start this controller with --ha-journal-via "
                    f"{seat.journal_via}, the same on every controller of the group")
    return None


def add_journal_route(app: FastAPI, engine: JournaledEngine) -> None:
    """GET /journal/{request_id}: what the journal holds of an unfinished request (of this leader, or of
    the last one, which this leader runs on), or of one of the last leader's that finished here with
    nobody attached (kept for the orphan window): prompt and output token ids, seed, parameters,
    `finished`, and `resumed_by_leader` for those this leader runs on. `request_id` is the response's
    `id` (the chunks' id) for its first choice, or `<id>-<index>` for choice `index`. Re-attach by
    sending the prompt again with that `seed`, `resume_request_id` = `request_id` and
    `resume_output_token_ids` = the tokens already received."""

    @app.get("/journal/{request_id}", response_model=dict[str, Any], responses=error_responses(404))
    async def journaled(request_id: str) -> dict[str, Any]:
        for candidate in (request_id, f"{request_id}-0"):
            adopted = engine.adopted.get(candidate) if engine.adopted is not None else None
            if adopted is not None:
                r, last = adopted.request, adopted.last
                return {**msgspec.to_builtins(Journaled(candidate, r.prompt_token_ids, r.params, r.seed,
                                                        adopted.output, last is not None)),
                        "finish_reason": last.finish_reason if last else None, "resumed_by_leader": True}
            held = engine.writer.requests.get(candidate) if engine.writer is not None else None
            if held is not None:
                return {**msgspec.to_builtins(held), "finish_reason": None, "resumed_by_leader": False}
        raise APIError(404, f"no request {request_id!r} in the journal: it finished (and, if the last leader's, "
                       "the orphan window passed), or its id is not a request's `id` (the chunks' id field)",
                       code="not_journaled")


def serve_in_group(args: argparse.Namespace, cfg: ServeConfig, key: ClusterKey, registry: CollectorRegistry,
                   tokenizer: Tokenizer, guard: HttpGuard, http_socket: socket.socket) -> int:
    try:
        store = GroupStore(args.etcd, args.ha_group)
    except ValueError as e:
        raise ElasticEPError(str(e)) from None
    if args.ha_lease_s < 2:
        raise ElasticEPError(f"--ha-lease-s {args.ha_lease_s}: etcd leases are whole seconds, at least 2")
    try:
        leader = store.leader()
        conflict = journal_via_conflict(args.ha_journal_via, args.ha_group, args.node,
                                        ([leader[0]] if leader else []) + list(store.seats().values()))
    except EtcdUnavailable:
        conflict = None  # checked again against the leader while standing by
    if conflict:
        raise ElasticEPError(conflict)
    host = cfg.advertise_host or cfg.host
    http_url = f"http://{'[' + host + ']' if ':' in host else host}:{http_socket.getsockname()[1]}"
    elected = threading.Event()
    records = RecordReader(GroupStore(args.etcd, args.ha_group))
    direct = args.ha_journal_via == "direct"
    # direct: every controller binds its journal socket now; the leader's is the one standbys follow
    journal_sock, journal_addr = bind_journal_socket(cfg.control_host) if direct else (None, "")
    election = Election(store, Seat(args.node, http_url, journal=journal_addr), ttl_s=args.ha_lease_s,
                        on_elected=lambda term: elected.set(), on_deposed=_deposed)

    def leader_journal() -> tuple[str, int] | None:
        state = election.state
        if state.role != Role.STANDBY or state.leader is None or not state.leader.journal:
            return None
        return state.leader.journal, state.term

    copy: JournalCopy = (JournalFollower(key, args.node, leader_journal) if direct
                         else JournalReader(GroupStore(args.etcd, args.ha_group)))

    def view() -> dict:
        return group_view(args.ha_group, args.etcd, args.node, election.state, records.record)

    gate = GroupGate(view, lambda: standby_reason(args.ha_group, election.state), registry)
    stop, standing_by, started = threading.Event(), threading.Event(), threading.Event()
    copying = threading.Thread(target=copy.run, args=(standing_by, lambda seq: election.set_seat(journal_seq=seq)),
                               name="journal-copy", daemon=True)

    # the controller and the app are built before the election (sockets bound, nobody told of them
    # yet): a takeover only starts them, and spends no CPU on them while it must keep its lease
    controller = Controller(cfg, key, registry)
    controller.on_fatal = lambda: signal.raise_signal(signal.SIGTERM)
    engine = JournaledEngine(controller.engine, adopted=AdoptedRequests(registry))
    app = create_app(engine, tokenizer, registry=registry, enable_chaos=cfg.enable_chaos, guard=guard, group=view)
    add_journal_route(app, engine)

    def lead() -> None:
        while not elected.wait(0.2):
            if stop.is_set():
                return
            leader = election.state.leader  # one started with ours at the same time may lead
            conflict = journal_via_conflict(args.ha_journal_via, args.ha_group, args.node, [leader] if leader else [])
            if conflict:
                logger.error("exiting: %s", conflict)
                logging.shutdown()
                os._exit(EXIT_MISCONFIGURED)
        standing_by.set()  # the copy stops; the etcd path catches up once more below
        copying.join()
        term = election.state.term
        controller.set_term(term)
        try:
            records.catch_up()
            if isinstance(copy, JournalReader):
                copy.catch_up()
        except EtcdUnavailable as e:
            logger.warning("group %s: the journal or the cluster record could not be read at takeover (%s): "
                           "requests of the last leader resume only through the router", args.ha_group, e)
        # the running ranks of the last leader, as its record names them, and the KV they hold for its requests
        controller.adopt(records.record, copy.requests)
        kept = unexpired(copy.kept, time.time())
        writer: LeaderJournal = (
            DirectJournalWriter(journal_sock, key, term, copy.applied, copy.requests, kept) if direct
            else JournalWriter(GroupStore(args.etcd, args.ha_group), term, copy.applied, copy.requests, kept=kept))
        engine.writer = writer
        controller.start()
        started.set()
        threading.Thread(target=writer.run, args=(stop, args.ha_journal_flush_s,
                                                  lambda seq: election.set_seat(journal_seq=seq), _deposed),
                         name="journal", daemon=True).start()
        recorder = RecordWriter(GroupStore(args.etcd, args.ha_group), term, lambda: controller.engine.cluster(None, 1),
                                _deposed)
        engine.record = recorder.write  # an accepted scale, drain, uncordon or rollout is recorded before its answer
        threading.Thread(target=recorder.run, args=(stop, RECORD_INTERVAL_S), name="cluster-record",
                         daemon=True).start()
        election.set_seat(controller=controller.health_addr, journal_seq=writer.seq)
        # the last leader's requests go on at once, whether or not their clients come back to attach
        # (before any client is let in: one that re-attaches finds its request running, or finished)
        now_s = time.time()
        for r in kept.values():
            engine.adopted.hold_finished(r.resumed(), r.finish_reason or "stop", max(0.0, now_s - r.finished_at_s))
        engine.adopted.start_threadsafe([r.resumed() for r in copy.requests.values()], engine.generate,
                                        engine.forget, gate.loop())
        gate.lead(app)
        logger.info("group %s: %s leads in term %d; controller at %s; %d journaled requests of the last leader "
                    "run on, %d finished ones kept (journal via %s)", args.ha_group, args.node, term,
                    controller.health_addr, len(copy.requests), len(kept), args.ha_journal_via)

    threads = [threading.Thread(target=election.run, args=(stop,), name="election", daemon=True),
               threading.Thread(target=lead, name="takeover", daemon=True), copying,
               threading.Thread(target=records.run, args=(standing_by, 0.2), name="cluster-record-reader",
                                daemon=True)]
    tune_for_serving()  # the controller and the app are built, no thread runs yet (control/gc_policy.py)
    for t in threads:
        t.start()
    logger.info("group %s through etcd %s: %s on %s stands by until elected", args.ha_group, args.etcd, args.node,
                http_url)
    try:
        run_http(gate, http_socket, args.request_timeout_s)
    finally:
        if started.is_set():  # then the lease is revoked: a standby leads at once
            controller.stop()
        stop.set()
        for t in threads:
            t.join(5)
    if controller.fatal:
        raise ElasticEPError(f"the cluster stopped: {controller.fatal}")
    return 0 if election.state.role != Role.DEPOSED else EXIT_DEPOSED
