"""The offline single-process engine: continuous batching over one paged KV pool, all experts local.

Each step runs, in one forward, the whole prompt of every newly admitted request and one
decode token of every running one. A request is admitted when the pool's free blocks hold it
(its cached prefix blocks are shared, not recomputed); when a running sequence needs a block
and none is free, the newest running request is preempted: its blocks are freed and it waits
at the front of the queue, to be recomputed (prompt plus tokens so far) when blocks free up.
A finished request (EOS, max_tokens or full context) frees its blocks. Sampling goes through
`model.sampling.sample_tokens`,
a pure function of (seed, position, logits, token history), so the same request gives the same
tokens in any batch; this engine is the reference the distributed one is compared with.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from elastic_ep.errors import ElasticEPError

from .block_manager import BlockManager, blocks_for
from .checkpoint import CheckpointReader
from .config import MoEConfig
from .kv_cache import DEFAULT_BLOCK_SIZE, KVCache
from .model import MoEForCausalLM, SeqChunk
from .moe import MoEFn, local_moe_fn
from .sampling import SamplingParams, TokenHistory, TokenLogprobs, sample_tokens


@dataclass
class GenerationResult:
    """One request's output. finish_reason: "stop" (EOS or a stop token id) or "length".
    logprobs: one per token of `token_ids` when the params asked for logprobs, else empty."""

    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)


@dataclass
class _Running:
    index: int
    params: SamplingParams
    seed: int
    result: GenerationResult

    @property
    def length(self) -> int:
        return len(self.result.prompt_token_ids) + len(self.result.token_ids)

    @property
    def tokens(self) -> list[int]:
        return self.result.prompt_token_ids + self.result.token_ids

    @property
    def history(self) -> TokenHistory:
        return TokenHistory(self.result.prompt_token_ids, self.result.token_ids)


class OfflineEngine:
    """Generates for a list of prompts with at most `max_batch` sequences in flight.

    num_blocks: the KV pool's blocks of block_size positions, fixed for the engine's life (and
    prefix blocks stay cached across `generate` calls); None: each call's pool holds min(max_batch,
    prompts) of its longest requests. enable_prefix_caching: see model/block_manager.py.
    """

    def __init__(
        self,
        model: MoEForCausalLM,
        moe_fn: MoEFn,
        max_batch: int = 16,
        max_model_len: int | None = None,
        *,
        num_blocks: int | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        enable_prefix_caching: bool = True,
    ):
        self.model = model
        self.moe_fn = moe_fn
        self.max_batch = max_batch
        self.max_model_len = max_model_len or model.config.max_position_embeddings
        self.eos_ids = set(model.config.eos_token_ids)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_preemptions = 0
        self.pool: BlockManager | None = None
        self.cache: KVCache | None = None

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path,
        max_batch: int = 16,
        max_model_len: int | None = None,
        *,
        dtype: torch.dtype | str = torch.float32,
        device: torch.device | str = "cpu",
        mla_cache: str = "latent",
        **pool: Any,
    ):
        """Load a checkpoint dir with every routed expert in this process, on `device`.

        dtype: a torch dtype, its name, or "auto" (the checkpoint's; see `CheckpointReader`);
        mla_cache: see `MoEForCausalLM`; pool: num_blocks, block_size, enable_prefix_caching.
        """
        config = MoEConfig.from_pretrained(model_dir)
        reader = CheckpointReader(model_dir, config, dtype)
        model = MoEForCausalLM(
            config, reader.dense_state(device), dtype=reader.dtype, device=device, mla_cache=mla_cache
        )
        experts = {
            layer: reader.read_experts(layer, list(range(config.num_experts)), device)
            for layer in config.moe_layers
        }
        return cls(model, local_moe_fn(experts), max_batch, max_model_len, **pool)

    def _request_blocks(self, prompt: list[int], params: SamplingParams) -> int:
        """Blocks a request holds at its longest."""
        return blocks_for(min(len(prompt) + params.max_tokens, self.max_model_len), self.block_size)

    def _ensure_pool(self, needed_blocks: int) -> tuple[BlockManager, KVCache]:
        if self.pool is None or (self.num_blocks is None and self.pool.num_blocks < needed_blocks):
            num_blocks = self.num_blocks or needed_blocks
            self.pool = BlockManager(num_blocks, self.block_size, self.enable_prefix_caching)
            self.cache = self.model.new_kv_cache(num_blocks, self.block_size)
        assert self.cache is not None
        return self.pool, self.cache

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[GenerationResult]:
        """Token ids out for token ids in, in prompt order.

        A request without a seed uses its index in `prompts` as its seed.
        Raises ElasticEPError for an empty prompt, one that leaves no room in the context, a
        request the whole pool cannot hold, or sampling params out of range (InvalidSamplingParams).
        """
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        for i, (prompt, p) in enumerate(zip(prompts, params_list, strict=True)):
            p.validate()
            self._check_prompt(i, prompt)
        needs = [self._request_blocks(prompt, p) for prompt, p in zip(prompts, params_list, strict=True)]
        pool, cache = self._ensure_pool(sum(sorted(needs, reverse=True)[: self.max_batch]) or 1)
        for i, need in enumerate(needs):
            if need > pool.num_blocks:
                raise ElasticEPError(
                    f"request {i} needs {need} KV blocks of {self.block_size} tokens (prompt {len(prompts[i])} + "
                    f"max_tokens {params_list[i].max_tokens}), the pool holds {pool.num_blocks}; lower max_tokens "
                    "or give the cache more memory"
                )
        results = [GenerationResult(list(prompt)) for prompt in prompts]
        states = {
            i: _Running(i, p, p.seed if p.seed is not None else i, results[i]) for i, p in enumerate(params_list)
        }
        waiting = deque(range(len(prompts)))
        running: dict[int, _Running] = {}  # in admission order: the last is the newest
        while waiting or running:
            self._make_room(running, waiting, pool, cache)
            chunks = [SeqChunk(i, [r.result.token_ids[-1]], r.length - 1) for i, r in running.items()]
            for c in chunks:
                cache.set_blocks(c.seq_id, pool.tables[c.seq_id])
            while waiting and len(running) < self.max_batch:
                state = states[waiting[0]]
                tokens = state.tokens
                cached = pool.allocate(state.index, tokens, len(tokens))
                if cached is None:
                    break
                waiting.popleft()
                running[state.index] = state
                cache.set_blocks(state.index, pool.tables[state.index], num_cached=cached)
                chunks.append(SeqChunk(state.index, tokens[cached:], cached))
            logits = self.model.forward(chunks, cache, self.moe_fn)
            batch = [running[c.seq_id] for c in chunks]
            for c, state in zip(chunks, batch, strict=True):
                pool.cache_computed(state.index, state.tokens, c.start_pos + len(c.token_ids))
            sampled = sample_tokens(
                logits,
                [s.params for s in batch],
                [s.seed for s in batch],
                [s.history for s in batch],
                self.eos_ids,
            )
            for state, token, logprobs in zip(batch, sampled.tokens, sampled.logprobs, strict=True):
                state.result.token_ids.append(token)
                if logprobs is not None:
                    state.result.logprobs.append(logprobs)
                reason = self._finish_reason(state, token)
                if reason:
                    state.result.finish_reason = reason
                    pool.free(state.index)
                    cache.free(state.index)
                    del running[state.index]
        return results

    def _make_room(self, running: dict[int, _Running], waiting: deque[int], pool: BlockManager,
                   cache: KVCache) -> None:
        """Give every running sequence the blocks of its next token, oldest first, preempting the
        newest while none is free: its blocks go back to the pool and it waits at the front of
        the queue, to be recomputed."""
        for i in list(running):
            while i in running and not pool.grow(i, running[i].length):
                newest = next(reversed(running))
                pool.free(newest)
                cache.free(newest)
                del running[newest]
                waiting.appendleft(newest)
                self.num_preemptions += 1

    def _check_prompt(self, index: int, prompt: list[int]) -> None:
        if not prompt:
            raise ElasticEPError(f"prompt {index} is empty; give at least one token")
        if len(prompt) >= self.max_model_len:
            raise ElasticEPError(
                f"prompt {index} has {len(prompt)} tokens, the context holds {self.max_model_len} "
                "(prompt plus at least one generated token); shorten the prompt"
            )

    def _finish_reason(self, state: _Running, token: int) -> str:
        if token in state.params.stop_ids(self.eos_ids):
            return "stop"
        if len(state.result.token_ids) >= state.params.max_tokens or state.length >= self.max_model_len:
            return "length"
        return ""


def greedy(max_tokens: int, ignore_eos: bool = False) -> SamplingParams:
    """Greedy sampling params."""
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
