"""Micro-batches of one step (`--enable-dbo`, vLLM's dual batch overlap, SGLang's two-batch
overlap): a rank's chunks are cut into micro-batches of nearly equal token counts, their
forwards run interleaved (`ExpertParallelMoE.run`), and each chunk's logits are taken from the
piece that holds its last token.

A chunk may be cut in two: its later piece starts where the earlier one ends, in the next
micro-batch, and attends to the earlier piece's keys, which the earlier micro-batch writes
first in every layer (the tasks take turns in order, so micro-batch 0 is never behind).
"""

from __future__ import annotations

import torch

from elastic_ep.model.kv_cache import KVCache
from elastic_ep.model.model import MoEForCausalLM, SeqChunk

from .ep_moe import ExpertParallelMoE


def split_chunks(chunks: list[SeqChunk], parts: int) -> tuple[list[list[SeqChunk]], list[tuple[int, int]]]:
    """Cut `chunks` (in order) into `parts` micro-batches of at most ceil(T / parts) of their T
    tokens each (some may be empty). Returns the micro-batches and, for each chunk, (micro-batch,
    row) of the piece holding its last token."""
    total = sum(len(c.token_ids) for c in chunks)
    share = -(-total // parts) if total else 0
    batches: list[list[SeqChunk]] = [[] for _ in range(parts)]
    ends: list[tuple[int, int]] = []
    part, room = 0, share
    for chunk in chunks:
        taken = 0
        while taken < len(chunk.token_ids):
            if room == 0:
                part, room = part + 1, share
            n = min(room, len(chunk.token_ids) - taken)
            batches[part].append(SeqChunk(chunk.seq_id, chunk.token_ids[taken:taken + n], chunk.start_pos + taken))
            taken, room = taken + n, room - n
        ends.append((part, len(batches[part]) - 1))
    return batches, ends


@torch.inference_mode()
def forward_micro_batches(model: MoEForCausalLM, kv: KVCache, chunks: list[SeqChunk], moe: ExpertParallelMoE,
                          parts: int, padding: SeqChunk | None = None) -> torch.Tensor:
    """One step's forward over `parts` interleaved micro-batches; logits [len(chunks), V] as
    `model.forward` returns them. `padding`: the step's padding tokens, run as the last
    chunk, cut into the micro-batches with the others so that none runs more than its share of
    the step's tokens (the padded dispatch is sized by that share); no logits of theirs are
    returned. Raises as `ExpertParallelMoE.run`."""
    batches, ends = split_chunks(chunks + ([padding] if padding is not None else []), parts)
    pad_rows = [0] * len(batches)
    if padding is not None:
        ends.pop()
        pad_rows = [sum(len(c.token_ids) for c in batch if c.seq_id == padding.seq_id) for batch in batches]
    logits = moe.run([model.forward_stages(batch, kv) for batch in batches], pad_rows)
    if not ends:
        return torch.empty(0, model.config.vocab_size, device=model.device)
    return torch.stack([logits[part][row] for part, row in ends])
