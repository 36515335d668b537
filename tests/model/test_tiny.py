import hashlib
import os
import subprocess
import sys

from elastic_ep.model.tiny import make_tiny, resolve_model
from elastic_ep.model.tokenizer import decode, encode, load_tokenizer


def digest(model_dir):
    h = hashlib.sha256()
    for path in sorted(model_dir.iterdir()):
        h.update(path.name.encode() + path.read_bytes())
    return h.hexdigest()


def test_make_tiny_is_deterministic_for_a_seed(tmp_path):
    a = make_tiny("deepseek_v3", tmp_path / "a", seed=3)
    b = make_tiny("deepseek_v3", tmp_path / "b", seed=3)
    c = make_tiny("deepseek_v3", tmp_path / "c", seed=4)
    assert digest(a) == digest(b) != digest(c)


def test_tokenizer_round_trips_text(tiny_dirs):
    tokenizer = load_tokenizer(tiny_dirs["qwen3_moe"])
    text = "Hello world! The experts are placed again: 42."
    ids = encode(tokenizer, text)
    assert decode(tokenizer, ids) == text
    assert len(ids) < len(text)


def test_concurrent_first_use_builds_one_complete_copy(tmp_path, monkeypatch):
    code = "from elastic_ep.model.tiny import resolve_model; print(resolve_model('tiny-qwen3-moe'))"
    env = {**os.environ, "ELASTIC_EP_CACHE": str(tmp_path), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    try:
        outputs = [p.communicate(timeout=120)[0].strip() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs)
    assert len(set(outputs)) == 1
    assert [p.name for p in tmp_path.iterdir()] == [os.path.basename(outputs[0])]
    monkeypatch.setenv("ELASTIC_EP_CACHE", str(tmp_path))
    assert str(resolve_model("tiny-qwen3-moe")) == outputs[0]
    assert digest(resolve_model("tiny-qwen3-moe")) == digest(make_tiny("qwen3_moe", tmp_path / "fresh"))
