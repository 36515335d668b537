"""Where a prefix lives (router/placement.py): the home the backends report, and a new prefix
on the backend with the fewest, so few prefixes split evenly where rendezvous hashing alone
does not."""

from __future__ import annotations

from collections import Counter

from elastic_ep.router.placement import KeySeen, Placements, homes, parse_report, place_new
from elastic_ep.router.scoring import prefix_key, rendezvous_order

URLS = [f"http://10.0.0.{i}:8000" for i in range(4)]
KEYS = [prefix_key(f"system prompt {k} ".encode() * 40) for k in range(8)]


def test_a_key_lives_where_it_was_sent_most_and_counts_while_it_is_recent():
    a, b, c = KEYS[:3]
    tie_first = rendezvous_order(c, URLS[:2])[0]
    home_of, live = homes({URLS[0]: {a: KeySeen(9, 1.0), b: KeySeen(1, 0.5), c: KeySeen(2, 999.0)},
                           URLS[1]: {b: KeySeen(5, 0.1), c: KeySeen(2, 999.0)}}, live_s=300)
    assert home_of == {a: URLS[0], b: URLS[1], c: tie_first}
    assert live == Counter({URLS[0]: 1, URLS[1]: 1})  # c is not live: no backend saw it for 999 s


def test_a_new_key_goes_to_the_backend_with_the_fewest_first_in_its_order():
    order = rendezvous_order(KEYS[0], URLS)
    assert place_new(order, {}) == order[0]
    assert place_new(order, {order[0]: 2, order[1]: 1, order[2]: 1, order[3]: 1}) == order[1]


def test_eight_prefixes_over_four_backends_split_two_each_where_the_hash_alone_does_not():
    by_hash = Counter(rendezvous_order(k, URLS)[0] for k in KEYS)
    placements = Placements()
    for k in KEYS:
        placements.put(k, place_new(rendezvous_order(k, URLS), placements.live))
    assert sorted(placements.live.values()) == [2, 2, 2, 2]
    assert sorted(by_hash.values()) != [2, 2, 2, 2]  # what the split was before: uneven for these keys


def test_placements_are_forgotten_once_reported_or_old():
    now = [0.0]
    placements = Placements(live_s=10, clock=lambda: now[0])
    placements.put(KEYS[0], URLS[0])
    now[0] = 5
    placements.put(KEYS[1], URLS[1])
    placements.put(KEYS[1], URLS[2])  # placed again elsewhere: counted once, where it is now
    assert placements.live == Counter({URLS[0]: 1, URLS[2]: 1})
    placements.forget_reported({KEYS[0]: URLS[0]})
    assert placements.get(KEYS[0]) is None and placements.get(KEYS[1]) == URLS[2]
    now[0] = 16
    placements.forget_reported({})
    assert placements.get(KEYS[1]) is None and placements.live == Counter()


def test_a_report_keeps_its_well_formed_entries():
    key = "ab" * 16
    assert parse_report({"keys": [[key, 3, 1.5], ["zz", 1, 0], [key], "x"], "capacity": 9}) == {
        bytes.fromhex(key): KeySeen(3, 1.5)}
    assert parse_report(["not", "a", "report"]) == {} and parse_report({"keys": 7}) == {}
