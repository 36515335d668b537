"""Seed 001's first table and exercise 1, as vectors."""

import pytest

from elastic_ep.cli import main
from elastic_ep.sim.blast_radius import blast_radius
from elastic_ep.sim.failure_rates import load_llama3

# (group size, groups, MTBF days, GPU-hours lost a month restart / elastic), seed 001 table 1
SEED_TABLE = [
    (16, 128, "132.0", "155", "8"),
    (64, 32, "33.0", "621", "31"),
    (128, 16, "16.5", "1241", "62"),
    (256, 8, "8.2", "2483", "124"),
]


def test_rate_from_llama3_counts_is_the_seeds():
    assert f"{load_llama3().rate_per_gpu_hour:.2e}" == "1.97e-05"
    assert load_llama3().interruptions == 419


def test_default_table_reproduces_seed_001_digit_for_digit():
    report = blast_radius(2048, [16, 64, 128, 256], load_llama3().rate_per_gpu_hour)
    assert f"{report.failures_per_month:.0f}" == "29"
    got = [
        (
            r.group_size,
            r.groups,
            f"{r.mtbf_days:.1f}",
            f"{r.gpu_hours_lost_restart:.0f}",
            f"{r.gpu_hours_lost_elastic:.0f}",
        )
        for r in report.rows
    ]
    assert got == SEED_TABLE


def test_cli_prints_the_seed_table(capsys):
    assert main(["sim", "blast-radius"]) == 0
    out = capsys.readouterr().out
    assert "1.97e-05" in out and "about 29 times a month" in out
    for size, groups, mtbf, restart, elastic in SEED_TABLE:
        assert any(
            line.split()[:3] == [str(size), str(groups), mtbf] and line.endswith(f"{restart} / {elastic}")
            for line in out.splitlines()
        ), (size, out)


def test_exercise_1_bigger_group_costs_4x_and_shorter_restart_cancels_it():
    rate = load_llama3().rate_per_gpu_hour
    at_20 = {r.group_size: r.gpu_hours_lost_restart for r in blast_radius(2048, [64, 256], rate, 20).rows}
    assert at_20[256] / at_20[64] == pytest.approx(4.0)
    at_5 = {r.group_size: r.gpu_hours_lost_restart for r in blast_radius(2048, [256], rate, 5).rows}
    assert at_5[256] == pytest.approx(at_20[64])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--group-sizes", "4096"], "between 1 and --gpus 2048"),
        (["--rate", "fast"], "not a number"),
        (["--rate", "-1"], "must be > 0"),
        (["--restart-min", "-5"], ">= 0 minutes"),
    ],
)
def test_impossible_inputs_exit_2_with_a_message(capsys, argv, message):
    assert main(["sim", "blast-radius", *argv]) == 2
    assert message in capsys.readouterr().err
