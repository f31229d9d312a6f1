"""Rotary position embedding of DeepSeek-V4: YaRN tables and GPT-J (interleaved) rotation (SPEC §4).

Every rotary use inside a layer shares one fp32 table ``cos_sin [P, rope_dim]`` whose row ``p`` is
``[cos_0 .. cos_{n-1} | sin_0 .. sin_{n-1}]`` (``n = rope_dim // 2``, angle ``p * inv_freq_i``).
SWA-only layers use ``rope_theta`` without YaRN; compressed layers (ratio 4 or 128) use
``compress_rope_theta`` with the YaRN frequency blend and no magnitude scale.

The table is built the way vLLM's ``DeepseekScalingRotaryEmbedding`` builds it: inverse
frequencies and angles in fp32, then ``cos()`` / ``sin()``, so its bits equal vLLM's. DeepSeek's
``precompute_freqs_cis`` computes the same fp32 angles but takes ``torch.polar(1, angles)``,
whose cos/sin may round differently: every entry is within 1 ulp of DeepSeek's, and some (about
4% on torch 2.13 CPU) differ by that ulp. (At very large positions an fp32 angle carries an
absolute error of ``|angle| * 2**-24``; both engines share it.)
"""
from __future__ import annotations

import math
from typing import Any

import torch
from dsv4.specs.errors import DSV4TypeError, DSV4ValueError

__all__ = [
    "apply_rope",
    "apply_rope_to_tail",
    "cos_sin_from_inv_freq",
    "rope_cos_sin",
    "rope_inv_freq",
    "yarn_correction_range",
]


def yarn_correction_range(beta_fast: float, beta_slow: float, rope_dim: int, theta: float,
                          original_max_positions: int) -> tuple[int, int]:
    """DeepSeek's ``yarn_find_correction_range``: ``(low, high)`` pair indices (SPEC §4).

    The correction dim of ``r`` rotations is ``rope_dim * ln(L / (2 pi r)) / (2 ln theta)``;
    ``low = floor(dim(beta_fast))``, ``high = ceil(dim(beta_slow))``, clamped to ``[0, rope_dim-1]``.
    """
    def correction_dim(rotations: float) -> float:
        return rope_dim * math.log(original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = math.floor(correction_dim(beta_fast))
    high = math.ceil(correction_dim(beta_slow))
    return max(low, 0), min(high, rope_dim - 1)


def rope_inv_freq(rope_dim: int, theta: float, scaling: Any | None = None) -> torch.Tensor:
    """Inverse frequencies ``fp32 [rope_dim // 2]``, YaRN-blended when ``scaling`` is given (SPEC §4).

    ``inv_i = theta ** (-2i / rope_dim)``. With ``scaling`` (an object with ``factor``,
    ``original_max_position_embeddings``, ``beta_fast``, ``beta_slow``):
    ``ramp = clamp((i - low) / (high - low), 0, 1)``, ``inv = inv / factor * ramp + inv * (1 - ramp)``.
    The arithmetic order mirrors DeepSeek's ``precompute_freqs_cis`` (it blends with
    ``smooth = 1 - ramp``) so that these fp32 inverse frequencies agree bit for bit (the table
    built from them does not quite: see the module docstring).
    """
    if rope_dim <= 0 or rope_dim % 2:
        raise DSV4ValueError.of("rope_dim", "a positive even number", rope_dim)
    inv_freq = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    if scaling is None:
        return inv_freq
    factor = float(scaling.factor)
    low, high = yarn_correction_range(scaling.beta_fast, scaling.beta_slow, rope_dim, theta,
                                      scaling.original_max_position_embeddings)
    # SPEC §4: guard high == low (DeepSeek nudges high by 0.001).
    span = (high - low) if high != low else 0.001
    ramp = torch.clamp((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / span, 0, 1)
    smooth = 1 - ramp
    return inv_freq / factor * (1 - smooth) + inv_freq * smooth


def cos_sin_from_inv_freq(inv_freq: torch.Tensor, num_positions: int,
                          device: torch.device | str | None = None) -> torch.Tensor:
    """Table ``fp32 [num_positions, 2 * len(inv_freq)]``, rows ``[cos | sin]`` of ``p * inv_freq``."""
    if num_positions <= 0:
        raise DSV4ValueError.of("num_positions", "a positive number", num_positions)
    positions = torch.arange(num_positions, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq.to(torch.float32))
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(device)


def rope_cos_sin(cfg: Any, layer_id: int, max_positions: int | None = None,
                 device: torch.device | str | None = None) -> torch.Tensor:
    """The rotary table of layer ``layer_id`` of ``cfg`` (a ``ModelConfig``): ``fp32 [P, 64]``.

    SWA-only layers (ratio 1, MTP included): ``rope_theta``, plain RoPE. Compressed layers:
    ``compress_rope_theta`` and YaRN from ``cfg.rope_scaling`` (SPEC §1, §4).
    ``P = max_positions`` or ``cfg.max_position_embeddings`` (1M rows is 256 MiB: pass a bound).
    """
    rope_dim = int(cfg.qk_rope_head_dim)
    if cfg.compress_ratio(layer_id) > 1:
        inv_freq = rope_inv_freq(rope_dim, float(cfg.compress_rope_theta), cfg.rope_scaling)
    else:
        # DeepSeek disables YaRN in pure sliding-window layers.
        inv_freq = rope_inv_freq(rope_dim, float(cfg.rope_theta), None)
    num_positions = int(max_positions if max_positions is not None else cfg.max_position_embeddings)
    return cos_sin_from_inv_freq(inv_freq, num_positions, device)


def _check_cos_sin(x: torch.Tensor, cos_sin: torch.Tensor) -> None:
    if not cos_sin.is_floating_point():
        raise DSV4TypeError.of("cos_sin", "a floating-point tensor", cos_sin.dtype)
    if cos_sin.dim() != 2 or cos_sin.shape[-1] % 2:
        raise DSV4ValueError.of("cos_sin", "shape [N, rope_dim] with rope_dim even", tuple(cos_sin.shape))
    if x.dim() < 1 or x.shape[0] != cos_sin.shape[0]:
        raise DSV4ValueError.of("x", f"leading dim {cos_sin.shape[0]} (one cos_sin row per x row)",
                                tuple(x.shape))


def apply_rope(x: torch.Tensor, cos_sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """GPT-J rotation of ``x [N, ..., rope_dim]`` by the per-row table ``cos_sin [N, rope_dim]``.

    Pair ``i`` acts on ``(x[2i], x[2i+1])``: ``e' = e cos - o sin``, ``o' = o cos + e sin``;
    ``inverse`` rotates by the negative angle (SPEC §4). Rows of ``cos_sin`` broadcast over the
    middle dims of ``x`` (heads). Math in fp32 (float64 for float64 ``x``); returns ``x.dtype``
    (one rounding, as in DeepSeek's ``apply_rotary_emb`` and vLLM's kernels).
    """
    _check_cos_sin(x, cos_sin)
    rope_dim = cos_sin.shape[-1]
    if x.shape[-1] != rope_dim:
        raise DSV4ValueError.of("x", f"last dim {rope_dim} (the rope dims)", tuple(x.shape))
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    half = rope_dim // 2
    view = (cos_sin.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos = cos_sin[:, :half].to(compute).reshape(view)
    sin = cos_sin[:, half:].to(compute).reshape(view)
    if inverse:
        sin = -sin
    xc = x.to(compute)
    even, odd = xc[..., 0::2], xc[..., 1::2]
    rotated = torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1).flatten(-2)
    return rotated.to(x.dtype)


def apply_rope_to_tail(x: torch.Tensor, cos_sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """``x [N, ..., D]`` with :func:`apply_rope` on its LAST ``rope_dim`` dims, the rest unchanged.

    This is how every DSV4 head is rotated (SPEC §4: the last 64 of 512, or of 128 for the
    indexer). Check vector: nope 2, rope 2, cos 0, sin 1, inverse: ``[1,2,3,4] -> [1,2,4,-3]``.
    """
    _check_cos_sin(x, cos_sin)
    rope_dim = cos_sin.shape[-1]
    if x.shape[-1] < rope_dim:
        raise DSV4ValueError.of("x", f"last dim >= {rope_dim}", tuple(x.shape))
    tail = apply_rope(x[..., x.shape[-1] - rope_dim:], cos_sin, inverse)
    return torch.cat([x[..., : x.shape[-1] - rope_dim], tail], dim=-1)
