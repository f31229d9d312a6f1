"""Small independent helpers for the reference-op tests (float64 formulas written from scratch)."""
from __future__ import annotations

import torch


def random_cos_sin(num_positions: int, rope_dim: int = 64, dtype: torch.dtype = torch.float32,
                   seed: int | None = None) -> torch.Tensor:
    """A random rotary table ``[P, rope_dim]`` rows ``[cos | sin]`` of random angles."""
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    angles = torch.rand(num_positions, rope_dim // 2, generator=generator, dtype=torch.float64) * 6.3
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(dtype)


def rope_tail_complex(x: torch.Tensor, cos_sin_rows: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """GPT-J rotation of the last ``rope_dim`` dims as a complex multiplication, float64."""
    rope_dim = cos_sin_rows.shape[-1]
    half = rope_dim // 2
    x = x.double()
    cos, sin = cos_sin_rows[:, :half].double(), cos_sin_rows[:, half:].double()
    rotation = torch.complex(cos, -sin if inverse else sin)
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    tail = torch.view_as_complex(x[..., -rope_dim:].unflatten(-1, (half, 2)).contiguous())
    tail = torch.view_as_real(tail * rotation.reshape(shape)).flatten(-2)
    return torch.cat([x[..., :-rope_dim], tail], dim=-1)


def bf16(x: torch.Tensor) -> torch.Tensor:
    """Round to bf16 and back to the input dtype."""
    return x.to(torch.bfloat16).to(x.dtype)
