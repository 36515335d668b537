"""Small pure building blocks shared by both architectures: RMSNorm, rotary embedding, gated MLP."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .config import RopeConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., D], weight: [D] -> [..., D] in x's dtype; normalized in float32 (as transformers)."""
    x32 = x.float()
    variance = x32.pow(2).mean(-1, keepdim=True)
    return weight * (x32 * torch.rsqrt(variance + eps)).to(x.dtype)


SMALL_BATCH_ROWS = 8


def gated_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """SwiGLU MLP. x: [n, H], gate_up: [2I, H] (gate rows then up rows), down: [H, I] -> [n, H].

    For the few rows a routed expert gets per decode step the CPU matrix kernels are far from
    their peak and layout decides the speed (measured, 1 thread, 512 x 128 expert): W @ x^T with
    x^T a transposed view beats `F.linear` ~1.8x, the activation must enter the second product
    in the same transposed layout (3x faster than as [I, n]), and a single row is doubled since
    the matrix-vector path is slower than a two-column product. From ~16 rows `F.linear` wins.
    """
    rows = x.shape[0]
    if rows > SMALL_BATCH_ROWS:
        gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, down)
    if rows == 1:
        x = torch.cat([x, x])
    gate, up = (gate_up @ x.T).chunk(2, dim=0)
    act = (F.silu(gate) * up).T.contiguous()
    out = (down @ act.T).T
    return out[:1] if rows == 1 else out


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


class Rotary:
    """Rotary position embedding, default or YaRN-scaled, as Hugging Face computes it.

    `interleave` selects DeepSeek's layout (rotated pairs are (x0, x1), (x2, x3), ...) instead of
    the half-split layout (x_i, x_{i + d/2}). The frequencies are computed on the CPU, as
    transformers computes them, then kept on `device`.
    """

    def __init__(self, rope: RopeConfig, device: torch.device | str = "cpu"):
        self.interleave = rope.interleave
        self.inv_freq = self._inv_freq(rope).to(device)
        self.attention_factor = 1.0
        self.softmax_scale_factor = 1.0
        if rope.rope_type == "default":
            return
        factor = rope.factor
        if rope.attention_factor is not None:
            self.attention_factor = float(rope.attention_factor)
        elif rope.mscale and rope.mscale_all_dim:
            self.attention_factor = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(
                factor, rope.mscale_all_dim
            )
        else:
            self.attention_factor = _yarn_mscale(factor)
        if rope.mscale_all_dim:
            # Only DeepSeek's MLA applies this to its softmax scale (as transformers does).
            self.softmax_scale_factor = _yarn_mscale(factor, rope.mscale_all_dim) ** 2

    @classmethod
    def _inv_freq(cls, rope: RopeConfig) -> torch.Tensor:
        """[d/2] float32 inverse frequencies, on the CPU."""
        dim = rope.dim
        exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
        pos_freqs = rope.theta**exponents
        if rope.rope_type == "default":
            return 1.0 / pos_freqs
        low, high = cls._correction_range(rope)
        if low == high:
            high += 0.001
        ramp = torch.clamp(
            (torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1
        )
        extrapolation_weight = 1 - ramp
        return (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolation_weight) + (
            1.0 / pos_freqs
        ) * extrapolation_weight

    @staticmethod
    def _correction_range(rope: RopeConfig) -> tuple[float, float]:
        def dim_for(rotations: float) -> float:
            return (
                rope.dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))
            ) / (2 * math.log(rope.theta))

        low, high = dim_for(rope.beta_fast), dim_for(rope.beta_slow)
        if rope.truncate:
            low, high = math.floor(low), math.ceil(high)
        return max(low, 0), min(high, rope.dim - 1)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] int64 -> cos, sin: [T, 1, d/2] in `dtype` (broadcast over heads),
        computed in float32."""
        freqs = positions[:, None].float() * self.inv_freq
        cos, sin = freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, d] -> rotated [T, heads, d] (half-split output layout, as Hugging Face)."""
        if self.interleave:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            half = x.shape[-1] // 2
            x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
