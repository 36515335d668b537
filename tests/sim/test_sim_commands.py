"""`elastic-ep sim` and `elastic-ep plan` as a user runs them: tables, JSON, plots, errors."""

import json
import os
import shlex
import subprocess
import sys

import numpy as np
import pytest

from elastic_ep.cli import command_parser, main
from elastic_ep.commands.plan import draw_plan
from elastic_ep.sim.planner import AUTO, PlanInputs, make_plan

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_redundancy_defaults_show_the_seed_configurations_both_ways(capsys):
    assert main(["sim", "redundancy", "--trials", "1000"]) == 0
    out = capsys.readouterr().out
    assert "P(loss) monte-carlo" in out and "P(loss) exact" in out
    rows = [line for line in out.splitlines() if line.startswith("EP")]
    assert len(rows) == 9
    # exact columns: EP32 loses 7.00 experts at k=1; EP320 loses one with 60.0%
    assert rows[0].split()[-2:] == ["100.0%", "7.00"]
    assert rows[3].split()[-2:] == ["60.0%", "0.60"]
    assert rows[6].split()[-2:] == ["0.0%", "0.00"]


def test_redundancy_json_for_a_configuration_and_whole_nodes(capsys):
    argv = ["sim", "redundancy", "--ranks", "64", "--slots", "8", "--k", "1,2", "--method", "exact", "--json"]
    assert main([*argv, "--ranks-per-node", "8", "--spread", "node"]) == 0
    (result,) = json.loads(capsys.readouterr().out)
    assert result["dead_unit"] == "nodes"
    k1, k2 = result["estimates"]["exact"]
    assert k1["p_loss"] == 0 and k1["lost_mean"] == 0  # every expert twice, on two nodes
    assert k2["p_loss"] == 1 and k2["lost_mean"] == pytest.approx(256 / 28)  # one node pair of 28


def test_redundancy_reads_a_placement_file(tmp_path, capsys):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"phy2log": [[0, 1, 2, 3, 0, 1, 2, 3]]}))
    assert (
        main(
            ["sim", "redundancy", "--placement", str(path), "--slots", "2", "--k", "1,2", "--method", "exact"]
        )
        == 0
    )
    out = capsys.readouterr().out
    row_k2 = next(line for line in out.splitlines() if line.startswith("p.json") and line.split()[1] == "2")
    # experts 0 and 1 live on ranks 0 and 2, experts 2 and 3 on ranks 1 and 3: of the 6 pairs
    # of dead ranks, 2 lose two experts each
    assert row_k2.split()[-2:] == ["33.3%", "0.67"]


def test_fleet_table_and_json(capsys):
    assert main(["sim", "fleet", "--gpus", "512", "--days", "30", "--replications", "3"]) == 0
    out = capsys.readouterr().out
    assert "restart" in out and "elastic-backup" in out and "availability %" in out
    assert main(["sim", "fleet", "--gpus", "512", "--days", "30", "--replications", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [p["policy"] for p in report["policies"]] == ["restart", "elastic-disk", "elastic-backup"]


def test_fleet_jobs_default_to_the_usable_cores_and_change_no_number(capsys):
    assert command_parser("sim").parse_args(["fleet"]).jobs == len(os.sched_getaffinity(0))
    argv = ["sim", "fleet", "--gpus", "2048", "--days", "60", "--replications", "3"]
    tables = []
    for jobs in ("1", "3"):
        assert main([*argv, "--jobs", jobs]) == 0
        tables.append(capsys.readouterr().out)
    assert tables[0] == tables[1] and "straggler evictions" in tables[0]


def test_fleet_with_one_replication_says_it_has_no_interval(capsys):
    argv = ["sim", "fleet", "--gpus", "512", "--days", "10", "--replications", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "inf" not in out and "±n/a" in out and "give --replications 2 or more" in out
    assert main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(f"{c} in JSON"))
    assert report["failures"]["half_width"] is None


def test_issue_17_plan_lists_what_serve_accepts_and_prints_its_command(capsys):
    assert main(["plan", "--gpus", "2048", "--ep-sizes", "48,96"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith(("EP48", "EP96"))]
    assert rows and all((256 + int(row[1])) % int(row[0][2:]) == 0 for row in rows)
    assert not any(row[:2] == ["EP48", "0"] for row in rows)
    assert "note: EP48: 256 experts + 0 redundant do not split evenly over 48 ranks" in out
    commands = [line.strip() for line in out.splitlines() if line.startswith("  elastic-ep ")]
    serve, *agents = commands
    args = command_parser("serve").parse_args(shlex.split(serve)[2:])
    assert (256 + args.redundant_experts) % args.ep_size == 0 and args.expert_backup
    assert f"recommended: EP{args.ep_size} with {args.redundant_experts} redundant experts" in out
    assert sum(command_parser("agent").parse_args(shlex.split(a)[2:]).ranks for a in agents) + args.local_ranks == (
        args.ep_size
    )


def test_plan_plot_has_a_title_the_choice_and_a_visible_line_per_option():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    requests, backups = ["0", AUTO, "256"], [False, True]
    plan = make_plan(PlanInputs(), [32, 64, 128], [0, AUTO, 256], backups, np.random.default_rng(0))
    fig, ax = plt.subplots()
    try:
        draw_plan(ax, plan, requests, backups)
        assert "GPU-hours lost" in ax.get_title() and "2048 GPUs" in ax.get_title()
        lines = {line.get_label(): line for line in ax.get_lines()}
        best = plan.recommended
        star = next(line for label, line in lines.items() if label.startswith("recommended:"))
        assert list(star.get_xdata()) == [best.ep_size] and list(star.get_ydata()) == [best.gpu_hours_lost_elastic]
        options = [line for label, line in lines.items() if label.startswith("elastic,")]
        assert len(options) == len(requests) * len(backups)
        drawn = {(x, y) for line in options for x, y in zip(line.get_xdata(), line.get_ydata(), strict=True)}
        assert all((o.ep_size, o.gpu_hours_lost_elastic) in drawn for o in plan.options)
        # A line drawn over an earlier one with the same points is thinner, so both show.
        for i, under in enumerate(options):
            for over in options[i + 1 :]:
                if list(under.get_ydata()) == list(over.get_ydata()):
                    assert under.get_linewidth() > over.get_linewidth()
    finally:
        plt.close(fig)


def test_plan_prints_options_and_a_recommendation(capsys):
    assert main(["plan", "--gpus", "2048", "--ep-sizes", "64", "--redundant", "0,256"]) == 0
    out = capsys.readouterr().out
    assert "recommended: EP64" in out
    twice = next(line for line in out.splitlines() if line.split()[:3] == ["EP64", "256", "on"])
    assert "653" in twice.split()  # seed 001 exercise 2: ~650 GB more per group


@pytest.mark.parametrize(
    "argv",
    [
        ["sim", "blast-radius"],
        ["sim", "redundancy", "--method", "exact"],
        ["sim", "fleet", "--gpus", "512", "--days", "10", "--replications", "1"],
        ["plan", "--ep-sizes", "64,128", "--redundant", "0"],
    ],
)
def test_every_command_draws_a_png(tmp_path, capsys, argv):
    path = tmp_path / "figure.png"
    assert main([*argv, "--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize(
    "argv, message",
    [
        (["sim", "redundancy", "--ranks", "4", "--slots", "1"], "do not fit in 4 ranks x 1 slots"),
        (["sim", "redundancy", "--ranks", "32", "--slots", "9", "--k", "40"], "k=40 dead failure domains"),
        (["sim", "redundancy", "--ranks", "8", "--slots", "64", "--experts", "4"], "only 8 failure domains"),
        (["sim", "redundancy", "--ranks", "32"], "--ranks needs --slots"),
        (["sim", "redundancy", "--placement", "/nonexistent.json"], "does not exist"),
        (["sim", "fleet", "--ep-size", "64", "--slots-per-rank", "2"], "cannot hold 256 experts"),
        (["sim", "blast-radius", "--plot", "/nonexistent/dir/x.png"], "does not exist"),
        (["plan", "--ep-sizes", "4096"], "between 1 and --gpus"),
        (["plan", "--gpus", "-5"], "--gpus -5 must be > 0"),
        (["plan", "--redundant", "-32"], "--redundant -32 must be a count >= 0"),
        (["sim", "fleet", "--spare-fraction", "2"], "--spare-fraction 2.0 must be between 0 and 1"),
        (["sim", "fleet", "--gpus", "-5"], "--gpus (-5) and --days (365.0) must be > 0"),
        (["sim", "fleet", "--days", "nan"], "--days (nan) must be > 0"),
        (["plan", "--expert-mb", "nan"], "--expert-mb nan must be a number > 0"),
        (["sim", "blast-radius", "--pause-min", "nan"], "--pause-min must be >= 0"),
        (["sim", "fleet", "--node-repair-h", "-1"], "--node-repair-h -1.0 must be a number >= 0"),
        (["sim", "fleet", "--slots-per-rank", "0"], "--slots-per-rank (0) must be > 0"),
        (["sim", "fleet", "--jobs", "0"], "--jobs 0 must be > 0"),
        (["sim", "blast-radius", "--gpus", "-5"], "--gpus -5 must be > 0"),
        (["sim", "redundancy", "--ranks", "4", "--slots", "4", "--experts", "8", "--k", "-1"], "must be >= 0"),
        (["sim", "redundancy", "--ranks", "4", "--slots", "4", "--experts", "8", "--trials", "1"], "at least 2 draws"),
        (["sim", "redundancy", "--method", "exact", "--max-terms", "-1"], "--max-terms -1 must be >= 0"),
    ],
)
def test_impossible_inputs_exit_2_with_a_message_and_no_traceback(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_sim_does_not_import_torch():
    code = (
        "import sys; from elastic_ep.cli import main; main(['sim', 'blast-radius']); "
        "main(['plan', '--ep-sizes', '64', '--redundant', '0']); assert 'torch' not in sys.modules, 'torch'"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    "argv",
    [["sim", "fleet", "--gpus", "512", "--days", "10", "--replications", "1"],
     ["plan", "--ep-sizes", "64,128", "--redundant", "0,auto"]],
)
def test_plot_says_where_it_went_and_keeps_coinciding_lines_visible(tmp_path, capsys, monkeypatch, argv):
    import elastic_ep.sim.report as report

    marked, real = [], report.mark_coinciding
    monkeypatch.setattr(report, "mark_coinciding", lambda ax: marked.append(real(ax)) or marked[-1])
    path = tmp_path / "figure.png"
    assert main([*argv, "--json", "--plot", str(path)]) == 0
    out, err = capsys.readouterr()
    json.loads(out)  # stdout stays JSON
    assert f"wrote the plot to {path}" in err
    assert marked and marked[0], "these figures have coinciding lines, and each is marked"
    for later, earlier in marked[0].items():
        pair = later + " " + earlier
        assert ("elastic-disk" in pair and "elastic-backup" in pair) or "0 redundant" in later, marked[0]


def test_mark_coinciding_keeps_both_lines_and_names_the_pair():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from elastic_ep.sim.report import mark_coinciding

    fig, ax = plt.subplots()
    try:
        first, = ax.plot([1, 2, 3], [4, 5, 6], label="a")
        ax.plot([1, 2, 3], [7, 8, 9], label="b")
        same, = ax.plot([1, 2, 3], [4, 5, 6], label="c")
        assert mark_coinciding(ax) == {"c": "a"}
        assert same.get_label() == "c (same as a)" and same.get_marker() == "o"
        assert same.get_zorder() > first.get_zorder() and first.get_linewidth() > same.get_linewidth()
    finally:
        plt.close(fig)


def test_plan_explains_surviving_losses_beside_a_certain_expert_loss(capsys):
    assert main(["plan", "--gpus", "2048"]) == 0
    out = capsys.readouterr().out
    assert "8 / 1" in out and "100% / 100%" in out
    assert "survives ranks/nodes: the dead ranks (largest nodes) after which" in out
    assert "P(loss): the chance that one dead rank (node) held the last copy" in out
