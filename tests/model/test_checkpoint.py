import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from elastic_ep.errors import CheckpointError
from elastic_ep.model.checkpoint import INDEX_FILE, CheckpointReader, expert_key
from elastic_ep.model.config import MoEConfig
from elastic_ep.model.tiny import make_tiny


def stored(model_dir, name):
    for path in model_dir.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            if name in f.keys():
                return f.get_tensor(name)
    raise KeyError(name)


@pytest.mark.parametrize("layout", ["index", "several_files_no_index", "one_file"])
def test_read_experts_returns_the_stored_tensors_in_every_layout(tmp_path, layout):
    model_dir = make_tiny("qwen3_moe", tmp_path / "m", num_shards=1 if layout == "one_file" else 3)
    if layout == "several_files_no_index":
        (model_dir / INDEX_FILE).unlink()
    reader = CheckpointReader(model_dir)
    w13, w2 = reader.read_experts(2, [5, 0, 11])
    inter, hidden = reader.config.moe_intermediate_size, reader.config.hidden_size
    assert w13.shape == (3, 2 * inter, hidden) and w2.shape == (3, hidden, inter)
    for i, e in enumerate([5, 0, 11]):
        assert torch.equal(w13[i, :inter], stored(model_dir, expert_key(2, e, "gate_proj")))
        assert torch.equal(w13[i, inter:], stored(model_dir, expert_key(2, e, "up_proj")))
        assert torch.equal(w2[i], stored(model_dir, expert_key(2, e, "down_proj")))
    assert reader.expert_nbytes == 3 * inter * hidden * 4


def test_dense_state_is_everything_but_routed_experts(tiny_dirs):
    reader = CheckpointReader(tiny_dirs["deepseek_v3"])
    dense = reader.dense_state()
    index = json.loads((tiny_dirs["deepseek_v3"] / INDEX_FILE).read_text())["weight_map"]
    experts = {n for n in index if ".mlp.experts." in n}
    assert set(dense) == set(index) - experts
    assert "model.layers.1.mlp.shared_experts.gate_proj.weight" in dense
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in dense
    assert len(experts) == 3 * 16 * 3


def test_read_experts_touches_only_the_files_holding_them(tmp_path):
    model_dir = make_tiny("deepseek_v3", tmp_path / "m", num_shards=4)
    reader = CheckpointReader(model_dir)
    expected_down = stored(model_dir, expert_key(3, 15, "down_proj"))
    index = json.loads((model_dir / INDEX_FILE).read_text())["weight_map"]
    needed = {index[expert_key(3, 15, p)] for p in ("gate_proj", "up_proj", "down_proj")}
    for file in set(index.values()) - needed:
        (model_dir / file).unlink()
    assert len(needed) < 4
    _, w2 = reader.read_experts(3, [15])
    assert torch.equal(w2[0], expected_down)


def test_a_missing_index_shard_is_named(tmp_path):
    model_dir = make_tiny("qwen3_moe", tmp_path / "m", num_shards=2)
    (model_dir / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors, which is missing"):
        CheckpointReader(model_dir)


def test_reading_experts_of_a_dense_layer_is_refused(tiny_dirs):
    reader = CheckpointReader(tiny_dirs["deepseek_v3"])
    with pytest.raises(CheckpointError, match="layer 0 has no routed experts"):
        reader.read_experts(0, [0])


def test_config_normalizes_both_architectures(tiny_dirs):
    ds = MoEConfig.from_pretrained(tiny_dirs["deepseek_v3"])
    qw = MoEConfig.from_pretrained(tiny_dirs["qwen3_moe_sparse_step"])
    assert (ds.arch, ds.num_experts, ds.top_k, ds.moe_layers, ds.eos_token_ids) == (
        "deepseek_v3",
        16,
        4,
        [1, 2, 3],
        (1,),
    )
    assert (qw.arch, qw.num_experts, qw.top_k, qw.moe_layers) == ("qwen3_moe", 16, 4, [1])
    assert ds.max_position_embeddings == qw.max_position_embeddings == 2048
    assert ds.hf["n_group"] == 4


def test_quantized_checkpoint_is_refused_with_the_fix(tiny_dirs):
    hf = dict(
        MoEConfig.from_pretrained(tiny_dirs["deepseek_v3"]).hf, quantization_config={"quant_method": "fp8"}
    )
    with pytest.raises(
        CheckpointError, match=r"quantized checkpoints \(fp8\) are not supported; use a bfloat16"
    ):
        MoEConfig.from_dict(hf)


def test_bfloat16_checkpoints_are_read_as_float32(tmp_path):
    model_dir = make_tiny("qwen3_moe", tmp_path / "m", num_shards=1)
    path = model_dir / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        tensors = {name: f.get_tensor(name).to(torch.bfloat16) for name in f.keys()}
    save_file(tensors, str(path))
    reader = CheckpointReader(model_dir)
    w13, _ = reader.read_experts(1, [3])
    assert w13.dtype == torch.float32
    assert torch.equal(
        w13[0, : reader.config.moe_intermediate_size], tensors[expert_key(1, 3, "gate_proj")].float()
    )
    assert all(t.dtype == torch.float32 for t in reader.dense_state().values())


def test_a_config_without_a_required_field_names_it(tiny_dirs):
    hf = dict(MoEConfig.from_pretrained(tiny_dirs["qwen3_moe"]).hf)
    del hf["num_experts"]
    with pytest.raises(
        CheckpointError,
        match="lacks the field 'num_experts' \\(or 'num_local_experts'\\) that qwen3_moe needs; add it",
    ):
        MoEConfig.from_dict(hf)
