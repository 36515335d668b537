"""The throughput `/cluster` shows (`load`): rates over the last seconds from cumulative counts."""

from elastic_ep.control.facade.stats_log import Throughput


def test_rates_over_the_window_only():
    t = Throughput(window_s=5.0)
    assert t.rates() == {"steps_per_s": None, "tokens_per_s": None, "generated_tokens_per_s": None}
    t.add(0.0, (0, 0, 0))
    t.add(1.0, (1000, 1000, 1000))  # a burst that leaves the window
    for now in range(2, 13):
        t.add(float(now), (1000 + 10 * (now - 1), 1000 + 40 * (now - 1), 1000 + 20 * (now - 1)))
    assert t.rates() == {"steps_per_s": 10.0, "tokens_per_s": 40.0, "generated_tokens_per_s": 20.0}
