"""A decoding sequence moves to another rank with its KV cache (DP alignment,
control/serving/alignment.py): the source sends the cached positions of every layer, the
destination writes them into the blocks the plan gives it there, and the sequence decodes there
from this step on without recomputing anything.

Both sides know every size from the plan (the tokens of each move), so one buffer per pair of
ranks goes in one all-to-all of the epoch's group (`EpochGroup.exchange`): every member gets the
step's whole list of moves and takes part, most with nothing to send. The source keeps its copy until the
controller frees it after the step commits: if the step fails, the sequence is still whole on
its old rank. A peer that dies raises CollectiveError, as any collective does.
"""

from __future__ import annotations

import time

import torch

from elastic_ep.model.kv_cache import KVCache
from elastic_ep.wire import KVMove

from .group import EpochGroup


@torch.inference_mode()  # the cache's tensors are written in forwards: inference tensors
def move_kv(kv: KVCache, group: EpochGroup, moves: list[KVMove], tokens: dict[int, list[int]]) -> float:
    """This rank's side of `moves` (the step's every move, the same list on every member):
    send the sequences it holds, load those it receives and set their held `tokens`. Returns
    seconds spent. Raises CollectiveError when the exchange fails, ValueError when a sequence
    to send is not cached here as the plan says (after the exchange, so the peer is not left
    waiting: it gets zeros and the step fails locally here)."""
    if not moves:
        return 0.0
    t0 = time.perf_counter()
    me = group.rank_id
    sends: dict[int, list[torch.Tensor]] = {}
    expected: dict[int, list[KVMove]] = {}
    problem = None
    for move in moves:
        if move.src_rank == me:
            try:
                rows = kv.read(move.seq_id, len(move.token_ids))
            except (KeyError, ValueError) as e:
                problem = problem or e
                rows = torch.zeros(_rows_shape(kv, len(move.token_ids)), dtype=kv.dtype, device=kv.device)
            sends.setdefault(group.members.index(move.dst_rank), []).append(rows.reshape(-1))
        elif move.dst_rank == me:
            expected.setdefault(group.members.index(move.src_rank), []).append(move)
    recvs = {peer: torch.empty(sum(_rows_shape(kv, len(m.token_ids)).numel() for m in ms), dtype=kv.dtype,
                               device=kv.device) for peer, ms in expected.items()}
    group.exchange({peer: torch.cat(parts) for peer, parts in sends.items()}, recvs, kv.dtype, kv.device)
    if problem is not None:
        raise ValueError(f"KV move: {problem}")
    for peer, ms in expected.items():
        at = 0
        for move in ms:
            shape = _rows_shape(kv, len(move.token_ids))
            n = shape.numel()
            kv.load(move.seq_id, recvs[peer][at:at + n].view(shape), move.dst_block_ids)
            tokens[move.seq_id] = list(move.token_ids)
            at += n
    return time.perf_counter() - t0


def _rows_shape(kv: KVCache, num_tokens: int) -> torch.Size:
    """The shape `kv.read` returns for num_tokens positions: [layers, kv_heads, n, k_dim (+ v_dim)]."""
    shape = kv.shape
    width = shape.k_dim + (0 if shape.values_in_keys else shape.v_dim)
    return torch.Size([kv.num_layers, shape.kv_heads, num_tokens, width])
