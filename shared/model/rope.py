"""Rotary position embeddings (RoPE) in the rotate-half layout of Hugging Face checkpoints.

Positions are absolute (docs/architecture.md §3.1: a tree node sits at base + len(cond) + depth - 1), so
the cos/sin rows are computed per packed row from its own position, once per forward, and shared
by every layer.
"""

from __future__ import annotations

import math

import torch

from shared.model.model_config import ModelConfig, RopeScaling


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies, with the model's rope scaling applied."""
    dim = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    sc = config.rope_scaling
    if sc is None or sc.kind == "linear":
        return inv
    if sc.freq_factors is not None:
        factors = torch.tensor(sc.freq_factors, dtype=torch.float32)
        if factors.numel() != inv.numel():
            raise ValueError(f"rope freq_factors has {factors.numel()} entries, expected {inv.numel()}")
        return inv / factors
    if sc.kind == "llama3":
        return _llama3_scaled(inv, sc)
    raise ValueError(f"rope scaling {sc.kind!r} is not supported")


def _llama3_scaled(inv: torch.Tensor, sc: RopeScaling) -> torch.Tensor:
    """Llama 3.1's rule: keep high frequencies, divide low ones by `factor`, blend in between.

    Wavelengths shorter than original_max_position / high_freq_factor are untouched; those longer
    than original_max_position / low_freq_factor are stretched by `factor`; the band between is a
    linear blend in (original_max_position / wavelength).
    """
    wavelength = 2 * math.pi / inv
    low_wl = sc.original_max_position / sc.low_freq_factor
    high_wl = sc.original_max_position / sc.high_freq_factor
    stretched = torch.where(wavelength > low_wl, inv / sc.factor, inv)
    blend = (sc.original_max_position / wavelength - sc.low_freq_factor) / (
        sc.high_freq_factor - sc.low_freq_factor
    )
    smoothed = (1 - blend) * stretched / sc.factor + blend * stretched
    middle = (wavelength >= high_wl) & (wavelength <= low_wl)
    return torch.where(middle, smoothed, stretched)


class Rotary:
    """Computes cos and sign-folded sin rows for absolute positions.

    The rotate-half rotation is x*cos + rotate_half(x)*sin with rotate_half(x) = [-x2, x1]. Folding
    the minus sign into sin ([-sin, sin]) turns it into x*cos + swap(x)*sin_signed: one cat and one
    fused multiply-add per call instead of a negation, a cat and two products.
    """

    def __init__(self, config: ModelConfig, device: torch.device) -> None:
        self.inv_freq = inverse_frequencies(config).to(device)  # [head_dim / 2] float32
        sc = config.rope_scaling
        self.position_scale = 1.0 / sc.factor if sc is not None and sc.kind == "linear" else 1.0
        self.half = config.head_dim // 2

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] int64 -> (cos, sin_signed), each [T, 1, head_dim] in `dtype`."""
        pos = positions.to(torch.float32)
        if self.position_scale != 1.0:
            pos = pos * self.position_scale
        freqs = torch.outer(pos, self.inv_freq)  # [T, head_dim / 2]
        cos = freqs.cos()
        sin = freqs.sin()
        cos_full = torch.cat((cos, cos), dim=-1)
        sin_signed = torch.cat((-sin, sin), dim=-1)
        return cos_full.to(dtype).unsqueeze(1), sin_signed.to(dtype).unsqueeze(1)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, head_dim]; cos, sin_signed: [T, 1, head_dim] -> rotated [T, heads, head_dim]."""
        swapped = torch.cat((x[..., self.half :], x[..., : self.half]), dim=-1)
        return torch.addcmul(x * cos, swapped, sin_signed)
