import json

import numpy as np
import pytest
import torch

from elastic_ep.cli import main
from elastic_ep.placement import ExpertLocation


@pytest.fixture
def load():
    return np.random.default_rng(0).lognormal(0, 1, (3, 16)) * 100


def run_json(capsys, *argv):
    assert main(["eplb", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("suffix", [".json", ".npy", ".pt"])
def test_every_load_format_gives_the_same_placement(tmp_path, capsys, load, suffix):
    path = tmp_path / f"load{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps({"load": load.tolist()}))
    elif suffix == ".npy":
        np.save(path, load)
    else:
        torch.save(torch.from_numpy(load), path)
    out = run_json(capsys, "--load", str(path), "--ranks", "8", "--slots", "3", "--nodes", "2")
    loc = ExpertLocation.from_json(json.dumps(out["placement"]))
    loc.validate()
    assert out["experts_without_live_replica"] == 0 and out["balancedness_min"] > 0.9
    reference = tmp_path / "ref.npy"
    np.save(reference, load)
    assert out == run_json(capsys, "--load", str(reference), "--ranks", "8", "--slots", "3", "--nodes", "2")


def test_dead_ranks_keep_their_slots_empty_and_from_reports_moves(tmp_path, capsys, load):
    path = tmp_path / "load.npy"
    np.save(path, load)
    before = tmp_path / "before.json"
    assert main(["eplb", "--load", str(path), "--ranks", "8", "--slots", "3", "--nodes", "2",
                 "--out", str(before)]) == 0
    assert "placement written to" in capsys.readouterr().out
    out = run_json(capsys, "--load", str(path), "--ranks", "8", "--slots", "3", "--nodes", "2",
                   "--dead", "3,6", "--from", str(before))
    phy2log = np.array(out["placement"]["phy2log"])
    assert phy2log.shape == (3, 24)
    assert (phy2log[:, 9:12] == -1).all() and (phy2log[:, 18:21] == -1).all()
    assert out["live_ranks"] == 6 and out["experts_without_live_replica"] == 0
    assert 0 < out["slots_moved"] <= 3 * 18


@pytest.mark.parametrize("policy", ["hierarchical", "global"])
def test_deepseek_policies_over_live_ranks(tmp_path, capsys, load, policy):
    path = tmp_path / "load.npy"
    np.save(path, load)
    out = run_json(capsys, "--load", str(path), "--ranks", "8", "--slots", "3", "--nodes", "2",
                   "--policy", policy, "--groups", "4")
    # DeepSeek's policies may put two copies of an expert on one rank: reported, not refused
    loc = ExpertLocation.from_json(json.dumps(out["placement"]))
    assert out["copies_on_same_rank"] == int(sum(len(r) - len(set(r) - {-1}) for r in loc.by_rank().reshape(-1, 3)))
    assert out["experts_without_live_replica"] == 0
    out = run_json(capsys, "--load", str(path), "--ranks", "8", "--slots", "3", "--nodes", "2",
                   "--policy", "global", "--dead", "0")
    phy2log = np.array(out["placement"]["phy2log"])
    assert (phy2log[:, :3] == -1).all() and (phy2log[:, 3:] >= 0).all()
    assert out["experts_without_live_replica"] == 0


@pytest.mark.parametrize(
    "content, argv, message",
    [
        ("not json", [], "cannot read load file"),
        ('{"x": 1}', [], "without any of the keys"),
        ("[1, 2, 3]", [], "must hold [layers, experts]"),
        ("[[1, -2]]", [], "non-negative"),
        ("[[1, 2, 3, 4]]", ["--ranks", "2", "--slots", "1"], "2 slots missing"),
        ("[[1, 2, 3, 4]]", ["--dead", "9"], "outside 0..3"),
        ("[[1, 2, 3, 4]]", ["--nodes", "3"], "does not split evenly"),
        ("[[1, 2, 3, 4]]", ["--policy", "hierarchical", "--nodes", "2", "--dead", "0"], "same number of live ranks"),
        ("[[1, 2, 3, 4]]", ["--from", "missing.json"], "cannot read placement file"),
        ("[[1, 2, 3, 4]]", ["--from", "small.json"], "the load is 1 x 4"),
        ("[[1, 2, 3, 4]]", ["--from", "small.json", "--policy", "global"], "cannot compare"),
        ("[[0, 0, 0, 0], [0, 0, 0, 0]]", [], "holds no tokens (every count is 0)"),
        ('{"logical_count": [[[0, 0, 0, 0]], [[0, 0, 0, 0]]]}', [], "holds no tokens"),
        ("[[0, 0, 0, 0], [1, 2, 3, 4]]", [], "layers [0] hold no tokens while others do"),
        ("[[1, 2, 3, 4]]", ["--policy", "hierarchical", "--groups", "0"], "--groups 0 must be at least 1"),
        ("[[1, 2, 3, 4]]", ["--tolerance", "-0.5"], "--tolerance -0.5 must be >= 0"),
        ("[[1, 2, 3, 4]]", ["--out", "no/such/dir/p.json"], "folder no/such/dir does not exist"),
    ],
)
def test_bad_input_is_a_clear_error_with_exit_2(tmp_path, monkeypatch, capsys, content, argv, message):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "load.json"
    path.write_text(content)
    ExpertLocation.from_phy2log([[0, 1, 1, 0]], slots_per_rank=2, num_experts=2).save(tmp_path / "small.json")
    base = {"--ranks": "4", "--slots": "2"}
    for flag, value in zip(argv[::2], argv[1::2], strict=True):
        base[flag] = value
    args = [a for kv in base.items() for a in kv]
    assert main(["eplb", "--load", str(path), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
