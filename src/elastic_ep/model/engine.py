"""The offline single-process engine: continuous batching over one KV cache, all experts local.

Each step runs, in one forward, the whole prompt of every newly admitted request and one
decode token of every running one; a finished request (EOS, max_tokens or full context) frees
its cache row for the next waiting prompt. Sampling goes through `model.sampling.sample_tokens`,
a pure function of (seed, position, logits, token history), so the same request gives the same
tokens in any batch; this engine is the reference the distributed one is compared with.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from elastic_ep.errors import ElasticEPError

from .checkpoint import CheckpointReader
from .config import MoEConfig
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
    def history(self) -> TokenHistory:
        return TokenHistory(self.result.prompt_token_ids, self.result.token_ids)


class OfflineEngine:
    """Generates for a list of prompts with at most `max_batch` sequences in flight."""

    def __init__(
        self, model: MoEForCausalLM, moe_fn: MoEFn, max_batch: int = 16, max_model_len: int | None = None
    ):
        self.model = model
        self.moe_fn = moe_fn
        self.max_batch = max_batch
        self.max_model_len = max_model_len or model.config.max_position_embeddings
        self.eos_ids = set(model.config.eos_token_ids)

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
    ):
        """Load a checkpoint dir with every routed expert in this process, on `device`.

        dtype: a torch dtype, its name, or "auto" (the checkpoint's; see `CheckpointReader`);
        mla_cache: see `MoEForCausalLM`.
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
        return cls(model, local_moe_fn(experts), max_batch, max_model_len)

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[GenerationResult]:
        """Token ids out for token ids in, in prompt order.

        A request without a seed uses its index in `prompts` as its seed.
        Raises ElasticEPError for an empty prompt, one that leaves no room in the context, or
        sampling params out of range (InvalidSamplingParams).
        """
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        for i, (prompt, p) in enumerate(zip(prompts, params_list, strict=True)):
            p.validate()
            self._check_prompt(i, prompt)
        results = [GenerationResult(list(prompt)) for prompt in prompts]
        waiting = deque(range(len(prompts)))
        running: dict[int, _Running] = {}
        longest = max(
            (len(prompt) + p.max_tokens for prompt, p in zip(prompts, params_list, strict=True)), default=1
        )
        cache = self.model.new_kv_cache(
            min(self.max_batch, max(len(prompts), 1)), self.max_model_len, initial_capacity=longest
        )
        while waiting or running:
            chunks = [SeqChunk(i, [r.result.token_ids[-1]], r.length - 1) for i, r in running.items()]
            while waiting and len(running) < self.max_batch:
                i = waiting.popleft()
                p = params_list[i]
                running[i] = _Running(i, p, p.seed if p.seed is not None else i, results[i])
                cache.allocate(i)
                chunks.append(SeqChunk(i, results[i].prompt_token_ids, 0))
            logits = self.model.forward(chunks, cache, self.moe_fn)
            states = [running[c.seq_id] for c in chunks]
            sampled = sample_tokens(
                logits,
                [s.params for s in states],
                [s.seed for s in states],
                [s.history for s in states],
                self.eos_ids,
            )
            for state, token, logprobs in zip(states, sampled.tokens, sampled.logprobs, strict=True):
                state.result.token_ids.append(token)
                if logprobs is not None:
                    state.result.logprobs.append(logprobs)
                reason = self._finish_reason(state, token)
                if reason:
                    state.result.finish_reason = reason
                    cache.free(state.index)
                    del running[state.index]
        return results

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
