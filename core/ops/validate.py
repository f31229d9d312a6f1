"""Boundary checks shared by the public ops (SPEC §12): dtype, rank and row-count checks only.

Nothing here reads tensor values, so no check costs a device sync; everything runs before the
backend is called, so a rejected call writes nothing.
"""
from __future__ import annotations

import torch
from dsv4.specs.errors import DSV4TypeError, DSV4ValueError

__all__ = ["FLOATS", "check_dtype", "check_rank", "check_rows", "check_tensor"]

FLOATS = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def check_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise DSV4TypeError.of(name, "a torch.Tensor", type(t).__name__)
    return t


def check_dtype(name: str, t: torch.Tensor, *dtypes: torch.dtype) -> None:
    check_tensor(name, t)
    if t.dtype not in dtypes:
        expected = " or ".join(f"dtype {d}" for d in dtypes)
        raise DSV4TypeError.of(name, expected, t.dtype)


def check_rank(name: str, t: torch.Tensor, ndim: int) -> None:
    check_tensor(name, t)
    if t.dim() != ndim:
        raise DSV4ValueError.of(name, f"a {ndim}-D tensor", f"shape {tuple(t.shape)}")


def check_rows(name: str, t: torch.Tensor, num_tokens: int) -> None:
    if t.shape[0] != num_tokens:
        raise DSV4ValueError.of(name, f"{num_tokens} rows (one per token)", f"shape {tuple(t.shape)}")
