"""Token sampling, the one function every engine calls: `sample_tokens`.

The token a row gets is a pure function of (seed, position, logits, the row's token history,
its `SamplingParams`), so a recomputation on any rank, in any batch, after any fault, draws
the same token. The steps and their order follow vLLM's sampler:

1. logit_bias is added to the raw logits;
2. penalties: repetition over prompt and output tokens (positive logits divided by it,
   negative ones multiplied), then frequency (times the count) and presence (once) over
   output tokens only;
3. EOS and stop_token_ids are banned while the row has fewer than `min_tokens` outputs;
4. greedy (temperature 0) takes the argmax here; otherwise the logits are divided by the
   temperature, then min_p, top_k and top_p cut the candidates, and one token is drawn from
   what is left with a generator seeded by (seed, position).

Logprobs are the model's raw log-softmax (vLLM's default `raw_logprobs` mode): before bias,
penalties, temperature and cuts, so they describe the model, not the sampling settings.

Numerical robustness: NaN and infinite logits are replaced by the most negative / positive
finite float64 before anything else, every later step keeps the row finite or -inf with at
least one finite candidate, and the temperature division runs in float64 after subtracting
the row's maximum. So no accepted `SamplingParams` (any temperature in (0, 2], huge logits,
top_p / min_p at their bounds) yields a NaN or infinite probability.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from elastic_ep.errors import ElasticEPError

from .seeds import SEED_MAX, SEED_MIN

MAX_TEMPERATURE = 2.0
MAX_ABS_PENALTY = 2.0
"""presence_penalty and frequency_penalty lie in [-2, 2], as in OpenAI's API and vLLM."""
MAX_REPETITION_PENALTY = 2.0
MAX_ABS_LOGIT_BIAS = 100.0
MAX_LOGPROBS = 20
"""Most top logprobs one token may ask for (vLLM's default `--max-logprobs`)."""


class InvalidSamplingParams(ElasticEPError, ValueError):
    """A sampling parameter out of its range; `param` names it."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next tokens of one request (vLLM's meanings).

    temperature 0 means greedy. top_k 0 and min_p 0 are off. `logit_bias`: (token id, bias)
    pairs added to the logits. `min_tokens`: EOS and `stop_token_ids` cannot be drawn before
    that many output tokens. `stop_token_ids`: tokens that end the request (finish_reason
    "stop"), as EOS does even with `ignore_eos`. `logprobs`: None for none, k >= 0 for the
    drawn token's logprob plus the k most likely. `seed` None means a seed chosen by the
    caller; sampling is always a pure function of (seed, position, logits, history).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None
    seed: int | None = None
    ignore_eos: bool = False

    def validate(self) -> None:
        """Raise InvalidSamplingParams naming the first field out of range."""
        checks = [
            ("max_tokens", self.max_tokens >= 1, "must be >= 1"),
            ("temperature", 0 <= self.temperature <= MAX_TEMPERATURE, f"must be in [0, {MAX_TEMPERATURE}]"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("top_k", self.top_k >= 0, "must be >= 0 (0 = off)"),
            ("min_p", 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("presence_penalty", abs(self.presence_penalty) <= MAX_ABS_PENALTY, "must be in [-2, 2]"),
            ("frequency_penalty", abs(self.frequency_penalty) <= MAX_ABS_PENALTY, "must be in [-2, 2]"),
            (
                "repetition_penalty",
                0 < self.repetition_penalty <= MAX_REPETITION_PENALTY,
                f"must be in (0, {MAX_REPETITION_PENALTY}]",
            ),
            (
                "logit_bias",
                all(abs(b) <= MAX_ABS_LOGIT_BIAS for _, b in self.logit_bias),
                f"values must be in [-{MAX_ABS_LOGIT_BIAS:g}, {MAX_ABS_LOGIT_BIAS:g}]",
            ),
            (
                "min_tokens",
                0 <= self.min_tokens <= self.max_tokens,
                f"must be in [0, max_tokens={self.max_tokens}]",
            ),
            ("stop_token_ids", all(t >= 0 for t in self.stop_token_ids), "must be token ids >= 0"),
            (
                "logprobs",
                self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                f"must be in [0, {MAX_LOGPROBS}]",
            ),
            ("seed", self.seed is None or SEED_MIN <= self.seed <= SEED_MAX, "must fit in 64 bits"),
        ]
        for name, ok, rule in checks:
            # `not ok` also catches NaN, for which every comparison is False.
            if not ok:
                raise InvalidSamplingParams(name, f"{name} {rule}, got {getattr(self, name)!r}")

    def stop_ids(self, eos_token_ids: Collection[int]) -> frozenset[int]:
        """The tokens that end this request: stop_token_ids, and EOS unless ignore_eos."""
        return frozenset(self.stop_token_ids) | frozenset(() if self.ignore_eos else eos_token_ids)


@dataclass(frozen=True)
class TokenHistory:
    """The tokens of one sequence when its next token is sampled. The position of that token
    (which seeds the draw) is their count."""

    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]

    @property
    def position(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


@dataclass(frozen=True)
class TokenLogprobs:
    """The raw log-probabilities of one sampled token: its own, and the `k` most likely
    (token id, logprob) pairs, most likely first (k = SamplingParams.logprobs). A logprob
    may be -inf for a token the model rules out."""

    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class SampleOutput:
    """tokens: [N] sampled ids; logprobs: [N], None for rows whose params.logprobs is None."""

    tokens: list[int]
    logprobs: list[TokenLogprobs | None]


def sample_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    histories: Sequence[TokenHistory],
    eos_token_ids: Collection[int] = (),
) -> SampleOutput:
    """Pick one token per row.

    logits: [N, V], each row the next-token logits of one sequence, on any device: sampling
        runs on the CPU, so a seed draws the same token whatever device computed the logits.
    params, seeds, histories: length N; a row's seed is its request's fixed seed.
    eos_token_ids: the model's EOS tokens (banned with stop_token_ids until min_tokens).
    """
    logits = logits.cpu()
    n = logits.shape[0]
    if not len(params) == len(seeds) == len(histories) == n:
        raise ValueError(
            f"{n} logit rows but {len(params)} params, {len(seeds)} seeds, {len(histories)} histories"
        )
    tokens: list[int] = []
    logprobs: list[TokenLogprobs | None] = []
    for row, p, seed, history in zip(logits, params, seeds, histories, strict=True):
        probs = token_distribution(row, p, history, eos_token_ids)
        if p.temperature == 0:
            token = int(torch.argmax(probs).item())
        else:
            token = int(torch.multinomial(probs, 1, generator=_generator(seed, history.position)).item())
        tokens.append(token)
        logprobs.append(None if p.logprobs is None else _token_logprobs(row, token, p.logprobs))
    return SampleOutput(tokens, logprobs)


def token_distribution(
    logits: torch.Tensor, params: SamplingParams, history: TokenHistory, eos_token_ids: Collection[int] = ()
) -> torch.Tensor:
    """The distribution `sample_tokens` draws the next token of one sequence from.

    logits: [V] -> [V] float64 probabilities: finite, >= 0, summing to 1 (up to rounding);
    for greedy (temperature 0), one-hot at the argmax of the processed logits.
    """
    scores = _processed_logits(_finite(logits.double()), params, history, eos_token_ids)
    if params.temperature == 0:
        return torch.zeros_like(scores).index_fill_(0, torch.argmax(scores), 1.0)
    # Subtracting the maximum first keeps every value in [-inf, 0] with a 0 at the top, so
    # the division cannot overflow to +inf and softmax's denominator is at least 1.
    z = (scores - scores.max()) / params.temperature
    if params.min_p > 0:
        # p_i >= min_p * p_max  <=>  z_i - z_max >= log(min_p), and z_max is 0.
        z = z.masked_fill(z < math.log(params.min_p), -math.inf)
    if 0 < params.top_k < z.numel():
        kth = torch.topk(z, params.top_k).values[-1]
        z = z.masked_fill(z < kth, -math.inf)
    probs = torch.softmax(z, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before > params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
        probs = probs / probs.sum()
    return probs


_F64 = torch.finfo(torch.float64)


def _finite(x: torch.Tensor) -> torch.Tensor:
    """[V] -> [V] with NaN and -inf as the lowest float64, +inf as the highest."""
    return torch.nan_to_num(x, nan=_F64.min, posinf=_F64.max, neginf=_F64.min)


def _processed_logits(
    raw: torch.Tensor, p: SamplingParams, history: TokenHistory, eos_token_ids: Collection[int]
) -> torch.Tensor:
    """Steps 1-3 of the module docstring. raw: [V] finite float64 -> [V] finite or -inf
    (banned), with at least one finite entry."""
    vocab = raw.numel()
    x = raw
    bias = [(t, b) for t, b in p.logit_bias if 0 <= t < vocab]
    if bias:
        ids = torch.tensor([t for t, _ in bias], dtype=torch.long)
        x = x.index_add(0, ids, torch.tensor([b for _, b in bias], dtype=torch.float64))
    if p.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool)
        seen[_ids_in_vocab(history.prompt_token_ids, vocab)] = True
        seen[_ids_in_vocab(history.output_token_ids, vocab)] = True
        penalized = torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
        x = torch.where(seen, penalized, x)
    if p.frequency_penalty or p.presence_penalty:
        counts = torch.bincount(_ids_in_vocab(history.output_token_ids, vocab), minlength=vocab).double()
        x = x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).double()
    x = _finite(x)
    if len(history.output_token_ids) < p.min_tokens:
        banned = torch.zeros(vocab, dtype=torch.bool)
        banned[_ids_in_vocab(p.stop_ids(eos_token_ids), vocab)] = True
        # A vocabulary of stop tokens only leaves nothing to draw: min_tokens cannot hold.
        if not banned.all():
            x = x.masked_fill(banned, -math.inf)
    return x


def _ids_in_vocab(ids: Collection[int], vocab: int) -> torch.Tensor:
    return torch.tensor([t for t in ids if 0 <= t < vocab], dtype=torch.long)


def _token_logprobs(logits: torch.Tensor, token: int, k: int) -> TokenLogprobs:
    """logits: [V] raw -> the log-softmax entry of `token` and the top k."""
    logprobs = torch.log_softmax(_finite(logits.double()), dim=-1)
    top = torch.topk(logprobs, min(k, logprobs.numel()))
    pairs = tuple(zip(top.indices.tolist(), top.values.tolist(), strict=True))
    return TokenLogprobs(float(logprobs[token]), pairs)


_SEED_MIX = 0x9E3779B97F4A7C15


def _generator(seed: int, position: int) -> torch.Generator:
    gen = torch.Generator()
    gen.manual_seed(((seed * _SEED_MIX) ^ (position + 1) * 0xBF58476D1CE4E5B9) & 0x7FFF_FFFF_FFFF_FFFF)
    return gen
