"""`elastic-ep make-tiny` and `generate` as a user runs them, including bad input."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from elastic_ep.cli import main
from elastic_ep.model.engine import OfflineEngine, greedy
from elastic_ep.model.tiny import make_tiny
from elastic_ep.model.tokenizer import encode, load_tokenizer


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_clean_error(code, err, *fragments):
    assert code == 2
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in err


@pytest.fixture
def one_file_dir(tmp_path):
    return make_tiny("qwen3_moe", tmp_path / "m", num_shards=1)


def test_generate_json_lines_per_prompt(capsys, tiny_dirs):
    code, out, _ = run_cli(
        capsys,
        "generate",
        "--model",
        str(tiny_dirs["deepseek_v3"]),
        "--prompt",
        "Hello",
        "--prompt",
        "Once upon a time",
        "--max-tokens",
        "6",
        "--json",
    )
    assert code == 0
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["prompt"] for r in records] == ["Hello", "Once upon a time"]
    for r in records:
        assert r["prompt_token_ids"] and len(r["token_ids"]) == 6 and isinstance(r["text"], str)


def test_seeded_sampling_repeats_and_depends_on_the_seed(capsys, tiny_dirs):
    def sample(seed):
        code, out, _ = run_cli(
            capsys,
            "generate",
            "--model",
            str(tiny_dirs["qwen3_moe"]),
            "--prompt",
            "Hi",
            "--max-tokens",
            "12",
            "--temperature",
            "1.0",
            "--top-p",
            "0.9",
            "--top-k",
            "50",
            "--seed",
            str(seed),
            "--json",
        )
        assert code == 0
        return json.loads(out)["token_ids"]

    assert sample(1) == sample(1)
    assert sample(1) != sample(2)


def test_make_tiny_cli_writes_a_checkpoint_that_generates(capsys, tmp_path):
    out_dir = tmp_path / "small"
    code, out, _ = run_cli(
        capsys,
        "make-tiny",
        "--arch",
        "deepseek_v3",
        "--out",
        str(out_dir),
        "--layers",
        "2",
        "--hidden",
        "32",
        "--experts",
        "8",
        "--top-k",
        "2",
        "--seed",
        "5",
    )
    assert code == 0 and str(out_dir) in out
    config = json.loads((out_dir / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["n_routed_experts"]) == (2, 32, 8)
    code, out, _ = run_cli(
        capsys, "generate", "--model", str(out_dir), "--prompt", "x", "--max-tokens", "3", "--json"
    )
    assert code == 0 and len(json.loads(out)["token_ids"]) == 3


def test_missing_model_dir(capsys, tmp_path):
    code, _, err = run_cli(capsys, "generate", "--model", str(tmp_path / "nope"), "--prompt", "x")
    assert_clean_error(code, err, "nope", "neither a directory nor an embedded model", "tiny-deepseek-v3")


def test_missing_config_json(capsys, one_file_dir):
    (one_file_dir / "config.json").unlink()
    code, _, err = run_cli(capsys, "generate", "--model", str(one_file_dir), "--prompt", "x")
    assert_clean_error(code, err, "has no config.json")


def test_unsupported_architecture(capsys, one_file_dir):
    config = json.loads((one_file_dir / "config.json").read_text())
    config.update(architectures=["LlamaForCausalLM"], model_type="llama")
    (one_file_dir / "config.json").write_text(json.dumps(config))
    code, _, err = run_cli(capsys, "generate", "--model", str(one_file_dir), "--prompt", "x")
    assert_clean_error(
        code,
        err,
        "unsupported architecture",
        "LlamaForCausalLM",
        "DeepseekV3ForCausalLM",
        "Qwen3MoeForCausalLM",
    )


@pytest.mark.parametrize(
    "name", ["model.layers.1.self_attn.k_norm.weight", "model.layers.2.mlp.experts.7.down_proj.weight"]
)
def test_missing_tensor_is_named(capsys, one_file_dir, name):
    path = one_file_dir / "model.safetensors"
    tensors = load_file(str(path))
    del tensors[name]
    save_file(tensors, str(path))
    code, _, err = run_cli(capsys, "generate", "--model", str(one_file_dir), "--prompt", "x")
    assert_clean_error(code, err, f"tensor {name} is missing")


@pytest.mark.parametrize(
    "name", ["model.layers.0.self_attn.q_proj.weight", "model.layers.3.mlp.experts.0.up_proj.weight"]
)
def test_tensor_of_the_wrong_shape_is_named(capsys, one_file_dir, name):
    path = one_file_dir / "model.safetensors"
    tensors = load_file(str(path))
    tensors[name] = torch.zeros(tensors[name].shape[0] + 1, tensors[name].shape[1])
    save_file(tensors, str(path))
    code, _, err = run_cli(capsys, "generate", "--model", str(one_file_dir), "--prompt", "x")
    assert_clean_error(code, err, f"tensor {name} has shape", "config.json implies")


def test_prompt_longer_than_the_context(capsys, tmp_path):
    model_dir = make_tiny("deepseek_v3", tmp_path / "short", max_position_embeddings=16)
    code, _, err = run_cli(capsys, "generate", "--model", str(model_dir), "--prompt", "word " * 40)
    assert_clean_error(code, err, "the context holds 16", "shorten the prompt")


def test_missing_tokenizer(capsys, tmp_path, tiny_dirs):
    model_dir = shutil.copytree(tiny_dirs["qwen3_moe"], tmp_path / "copy")
    (model_dir / "tokenizer.json").unlink()
    code, _, err = run_cli(capsys, "generate", "--model", str(model_dir), "--prompt", "x")
    assert_clean_error(code, err, "has no tokenizer.json")



def test_generate_takes_every_sampling_parameter_and_prints_logprobs(capsys, tiny_dirs):
    flags = (
        "--max-tokens 6 --temperature 0.8 --min-p 0.05 --presence-penalty 0.5 --frequency-penalty 0.5 "
        "--repetition-penalty 1.2 --min-tokens 6 --stop-token-id 3 --logprobs 2 --json"
    )
    code, out, _ = run_cli(
        capsys, "generate", "--model", str(tiny_dirs["qwen3_moe"]), "--prompt", "Hi", *flags.split()
    )
    assert code == 0
    record = json.loads(out)
    assert len(record["token_ids"]) == 6 and 3 not in record["token_ids"]
    assert [len(lp["top"]) for lp in record["logprobs"]] == [2] * 6


@pytest.mark.parametrize(
    ("flag", "value"), [("--temperature", "nan"), ("--top-p", "0"), ("--repetition-penalty", "inf")]
)
def test_generate_refuses_sampling_values_out_of_range(capsys, flag, value):
    code, _, err = run_cli(capsys, "generate", "--prompt", "x", flag, value)
    assert_clean_error(code, err, flag.removeprefix("--").replace("-", "_"))


def test_a_bfloat16_checkpoint_generates_in_bfloat16_unless_told_otherwise(capsys, tmp_path):
    out_dir = tmp_path / "bf16"
    code, _, _ = run_cli(
        capsys, "make-tiny", "--arch", "qwen3_moe", "--out", str(out_dir), "--dtype", "bfloat16"
    )
    assert code == 0 and json.loads((out_dir / "config.json").read_text())["torch_dtype"] == "bfloat16"
    stored = load_file(str(out_dir / "model-00001-of-00002.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in stored.values())

    def tokens(*dtype_args):
        code, out, _ = run_cli(
            capsys,
            "generate",
            "--model",
            str(out_dir),
            "--prompt",
            "Once upon a time",
            "--max-tokens",
            "16",
            "--ignore-eos",
            "--json",
            "--logprobs",
            "0",
            *dtype_args,
        )
        assert code == 0
        record = json.loads(out)
        return record["token_ids"], [lp["logprob"] for lp in record["logprobs"]]

    prompt = encode(load_tokenizer(out_dir), "Once upon a time")
    engine = OfflineEngine.from_pretrained(out_dir, dtype=torch.bfloat16)
    in_bf16 = engine.generate([prompt], greedy(16, ignore_eos=True))
    assert tokens()[0] == tokens("--dtype", "bfloat16")[0] == in_bf16[0].token_ids
    # Rounding to bfloat16 moves the model's log-probabilities: float32 must really run in float32.
    assert tokens("--dtype", "float32")[1] != tokens()[1]


@pytest.mark.parametrize(
    "device, fragment",
    [
        pytest.param(
            "cuda",
            "--device cuda: this process sees 0 CUDA device(s); use --device cpu",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a GPU"),
        ),
        ("meta", "--device meta: elastic-ep runs on cpu or cuda"),
        ("gpu0", "--device 'gpu0' is not a torch device"),
    ],
)
def test_a_device_this_process_cannot_run_on_is_named(capsys, tiny_dirs, device, fragment):
    code, _, err = run_cli(
        capsys, "generate", "--model", str(tiny_dirs["qwen3_moe"]), "--prompt", "x", "--device", device
    )
    assert_clean_error(code, err, fragment)
