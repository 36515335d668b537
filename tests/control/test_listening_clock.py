"""The clock peers' silence is measured on: it runs while the controller listens and stops
while it cannot (its whole process stalled, e.g. a thread holding the GIL while the OS runs other
processes), so a stall of the controller's own process is never read as its peers' silence."""

from pytest import approx

from elastic_ep.control.control_plane import ListeningClock


def test_it_runs_with_time_while_the_controller_listens():
    clock = ListeningClock(slack_s=0.1, drained_at=100.0)
    for t in (100.05, 100.1, 100.2, 100.25):  # receives that asked for 50 ms and came back about then
        clock.drained(0.05, t)
    assert clock.read(100.25) == 100.25
    assert clock.read(100.3) == 100.3  # between drains, up to the slack


def test_a_stall_inside_a_receive_is_not_counted():
    clock = ListeningClock(slack_s=0.1, drained_at=100.0)
    clock.drained(0.05, 101.0)  # asked for 50 ms, back after a 1 s stall
    assert clock.read(101.0) == approx(100.15)  # the wait it asked for and the slack count, the stall does not


def test_it_keeps_the_longest_stretch_it_could_not_listen():
    clock = ListeningClock(slack_s=0.1, drained_at=100.0)
    for asked_s, t in ((0.05, 100.4), (0.05, 100.5), (0.0, 102.0), (0.05, 102.1)):
        clock.drained(asked_s, t)
    assert clock.longest_s == approx(1.4) and clock.deaf_s == approx(0.25 + 1.4)


def test_it_stops_while_no_receive_drains_and_never_goes_back():
    clock = ListeningClock(slack_s=0.1, drained_at=100.0)
    readings = [clock.read(t) for t in (100.05, 100.1, 100.5, 101.5)]
    assert readings == [100.05, 100.1, 100.1, 100.1]  # stopped after the slack: no one drained the sockets
    clock.drained(0.05, 101.6)
    assert clock.read(101.6) == approx(100.15)
    assert clock.read(101.6) >= readings[-1]
