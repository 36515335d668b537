import pytest
import torch

from elastic_ep.model.tiny import make_tiny

# name -> (arch, make_tiny keyword arguments); every parity test runs on each.
TINY_VARIANTS = {
    "deepseek_v3": ("deepseek_v3", {}),
    "deepseek_v3_no_q_lora": ("deepseek_v3", {"config_overrides": {"q_lora_rank": None}, "num_shards": 1}),
    "deepseek_v3_yarn": (
        "deepseek_v3",
        {
            "config_overrides": {
                "rope_scaling": {
                    "type": "yarn",
                    "factor": 4.0,
                    "original_max_position_embeddings": 512,
                    "beta_fast": 32,
                    "beta_slow": 1,
                    "mscale": 1.0,
                    "mscale_all_dim": 1.0,
                }
            }
        },
    ),
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen3_moe_sparse_step": (
        "qwen3_moe",
        {"config_overrides": {"decoder_sparse_step": 2, "mlp_only_layers": [3]}},
    ),
}


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """name -> checkpoint dir of each TINY_VARIANTS entry, built once per session."""
    root = tmp_path_factory.mktemp("tiny")
    return {name: make_tiny(arch, root / name, **kwargs) for name, (arch, kwargs) in TINY_VARIANTS.items()}


@pytest.fixture(params=list(TINY_VARIANTS))
def any_tiny_dir(request, tiny_dirs):
    """Each tiny checkpoint variant in turn."""
    return tiny_dirs[request.param]


def interleaved_cache(model, seq_ids, max_len=64, block_size=4):
    """A KV pool where each of seq_ids holds blocks for max_len positions, the sequences' blocks
    interleaved (sequence i holds blocks i, i + n, i + 2n, ...), so every table is scattered."""
    n = len(seq_ids)
    per_seq = -(-max_len // block_size)
    cache = model.new_kv_cache(n * per_seq, block_size)
    for i, seq in enumerate(seq_ids):
        cache.set_blocks(seq, list(range(i, n * per_seq, n)))
    return cache


@pytest.fixture
def paged_cache():
    """interleaved_cache(model, seq_ids, max_len=64, block_size=4)."""
    return interleaved_cache
