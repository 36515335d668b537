import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

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


@pytest.mark.parametrize(
    "declared, stored, expected",
    [
        ({"torch_dtype": "bfloat16"}, torch.bfloat16, torch.bfloat16),  # 4.x config
        ({"dtype": "float16"}, torch.float16, torch.float16),  # 5.x config
        ({"torch_dtype": "float32"}, torch.bfloat16, torch.float32),  # the config's word wins
        ({}, torch.bfloat16, torch.bfloat16),  # no declaration: the stored weights'
    ],
)
def test_dtype_auto_is_the_checkpoints_own(tmp_path, declared, stored, expected):
    model_dir = make_tiny("qwen3_moe", tmp_path / "m", num_shards=1)
    config = json.loads((model_dir / "config.json").read_text())
    del config["torch_dtype"]
    (model_dir / "config.json").write_text(json.dumps({**config, **declared}))
    path = model_dir / "model.safetensors"
    save_file({n: t.to(stored) for n, t in load_file(str(path)).items()}, str(path))
    reader = CheckpointReader(model_dir, dtype="auto")
    assert reader.dtype == expected
    w13, w2 = reader.read_experts(1, [3, 0])
    assert w13.dtype == w2.dtype == expected
    assert all(t.dtype == expected for t in reader.dense_state().values())
    assert reader.expert_nbytes == 3 * reader.config.hidden_size * reader.config.moe_intermediate_size * (
        expected.itemsize
    )


def test_a_bfloat16_checkpoint_is_read_as_stored_and_deepseeks_router_in_float32(tmp_path):
    model_dir = make_tiny("deepseek_v3", tmp_path / "m", num_shards=1, dtype="bfloat16")
    reader = CheckpointReader(model_dir, dtype=torch.bfloat16)
    w13, _ = reader.read_experts(1, [3])
    assert torch.equal(
        w13[0, : reader.config.moe_intermediate_size], stored(model_dir, expert_key(1, 3, "gate_proj"))
    )
    dense = reader.dense_state()
    assert dense["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert dense["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert dense["model.layers.1.self_attn.kv_b_proj.weight"].dtype == torch.bfloat16


def test_weights_come_to_the_device_asked_for(tiny_dirs):
    reader = CheckpointReader(tiny_dirs["deepseek_v3"])
    w13, w2 = reader.read_experts(2, [1, 2], device="meta")
    assert w13.is_meta and w2.is_meta
    assert all(t.is_meta for t in reader.dense_state("meta").values())


def test_an_unsupported_stored_dtype_is_refused_with_the_fix(tmp_path):
    model_dir = make_tiny("qwen3_moe", tmp_path / "m", num_shards=1)
    config = json.loads((model_dir / "config.json").read_text())
    del config["torch_dtype"]
    (model_dir / "config.json").write_text(json.dumps(config))
    path = model_dir / "model.safetensors"
    save_file({n: t.double() for n, t in load_file(str(path)).items()}, str(path))
    with pytest.raises(CheckpointError, match="stores F64 weights .*pass one of them with --dtype"):
        CheckpointReader(model_dir, dtype="auto")
    assert CheckpointReader(model_dir, dtype="bfloat16").dtype == torch.bfloat16


def test_both_spellings_of_a_renamed_field_must_agree(tiny_dirs):
    hf = dict(MoEConfig.from_pretrained(tiny_dirs["qwen3_moe"]).hf)
    assert MoEConfig.from_dict({**hf, "num_local_experts": 16}).num_experts == 16
    with pytest.raises(
        CheckpointError, match="sets both 'num_experts' \\(16\\) and 'num_local_experts' \\(8\\)"
    ):
        MoEConfig.from_dict({**hf, "num_local_experts": 8})


@pytest.mark.parametrize(
    "arch, field, value",
    [
        ("deepseek_v3", "scoring_func", "softmax"),
        ("deepseek_v3", "moe_layer_freq", 2),
        ("qwen3_moe", "hidden_act", "gelu"),
        ("qwen3_moe", "use_sliding_window", True),
    ],
)
def test_a_field_value_only_another_implementation_serves_is_named(tiny_dirs, arch, field, value):
    hf = dict(MoEConfig.from_pretrained(tiny_dirs[arch]).hf, **{field: value})
    with pytest.raises(CheckpointError, match=f"{field}={value!r} is not supported for {arch}"):
        MoEConfig.from_dict(hf)


def test_difference_names_what_makes_another_directory_another_model(tmp_path):
    served = CheckpointReader(make_tiny("qwen3_moe", tmp_path / "a", num_shards=1))
    assert served.difference(CheckpointReader(make_tiny("qwen3_moe", tmp_path / "b", num_shards=3))) == ""
    assert "another config" in served.difference(CheckpointReader(make_tiny("deepseek_v3", tmp_path / "c")))
    reshaped = make_tiny("qwen3_moe", tmp_path / "d", num_shards=1)
    path = next(reshaped.glob("*.safetensors"))
    tensors = load_file(path)
    name = "model.embed_tokens.weight"
    tensors[name] = tensors[name].to(torch.float16)
    save_file(tensors, path)
    assert f"tensors ['{name}']" in served.difference(CheckpointReader(reshaped))
