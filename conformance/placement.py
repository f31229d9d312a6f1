"""Far placement: the same case with every paged cache's pages moved past 16 GiB of their tensor.

A serving engine allocates one KV pool per layer group for the whole GPU, so the pages a step
reads sit gigabytes past the pool's base. A kernel that forms a page's address in 32-bit
arithmetic (``page * page_stride``, ``slot * row_elements``) is right on the small caches of the
cases and wrong there. :func:`place_far` rebuilds a prepared case so that it tests that: each paged
cache becomes a larger tensor whose first ``pad`` pages are unused, the case's pages are copied
behind them, and every block-table entry and slot that addresses the cache moves by ``pad`` pages.
The op's outputs must not change, and the written caches, read back behind the pad
(``Prepared.leading``), must equal the near run's.

The pad is chosen so that the case's pages start past 16 GiB (``FAR_MIN_BYTES``): past 2**31 units of
1, 2 and 4 bytes, so a 32-bit offset overflows whether a kernel counts bytes, bf16 elements or int32 /
fp32 words (a uint8 page is often read through such views: scales, word loads), and past 2**32 of them,
so the overflowed offset wraps to the pad's first megabytes rather than before the tensor. Those
megabytes, and the page just before the case's, are poisoned (NaN): a wrapped read shows as a NaN and a
wrapped write lands where no output is read. A 32-bit offset in 8-byte units (an int64 view) goes
negative, 16 GiB before the tensor: a fault on a GPU, undefined under the interpreter. The rest of the pad is left unwritten: on the CPU it is never
touched (no memory is committed for it); on a GPU it is allocated, ~16 GiB a paged cache and up to
~32 GiB a case. Where that memory is not there the far run is reported as not run (``run@far``, not a
failure). ``gib`` (``--far-gib 8`` or ``4``) places the pages nearer for less memory, catching 32-bit
offsets in bytes and 2-byte units, or in bytes only; ``--near-only`` skips the far run.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

__all__ = ["FAR_GIB", "FAR_GIB_CHOICES", "FAR_MIN_BYTES", "CachePages", "far_copy", "far_pad_blocks", "far_pages",
           "place_far"]

FAR_GIB = 16  # the default: a 32-bit offset in 1-, 2- or 4-byte units wraps to the pad's start
# A smaller pad for a device without ~2 x 16 GiB to spare: 8 catches 1- and 2-byte units onto the poison
# (4-byte ones go negative, before the tensor); 4 catches 32-bit byte offsets only.
FAR_GIB_CHOICES = (4, 8, 16)
FAR_MIN_BYTES = (FAR_GIB << 30) + 2**20  # where the case's pages start at the default: 16 GiB + 1 MiB
_WRAP_POISON_BYTES = 2**22  # a wrapped offset lands within the pad's first MiBs: poison them


@dataclass(frozen=True)
class CachePages:
    """How an op's arguments address one paged cache argument (SPEC §10).

    block_size: tokens a page (dim 0 of the cache tensor is pages). tables: argument indices of
    block tables (``int32 [R, pages]``, page numbers, -1 none). slots: argument indices of slot
    numbers (``page * block_size + offset``, -1 none), int32 or int64, any shape."""

    block_size: int
    tables: tuple[int, ...] = ()
    slots: tuple[int, ...] = ()


def far_pages(gib: int = FAR_GIB) -> str:
    """How messages name the placement: ``"pages past 16 GiB"``."""
    return f"pages past {gib} GiB"


def far_pad_blocks(cache: torch.Tensor, gib: int = FAR_GIB) -> int:
    """Leading pages to add before ``cache``'s pages: the first case page starts at or past ``gib`` GiB
    + 1 MiB (one of ``FAR_GIB_CHOICES``; the default 16 is past 2**32 elements of every dtype up to 4 bytes)."""
    if gib not in FAR_GIB_CHOICES:
        raise ValueError(f"far placement: gib must be one of {FAR_GIB_CHOICES}, got {gib!r}")
    page_bytes = cache[0].numel() * cache.element_size()
    return -(-((gib << 30) + 2**20) // page_bytes)


def far_copy(cache: torch.Tensor, gib: int = FAR_GIB) -> tuple[torch.Tensor, int]:
    """``(far, pad)``: ``far`` is ``[pad + n, ...]`` of ``cache``'s dtype on its device with ``cache`` copied
    behind ``pad = far_pad_blocks(cache, gib)`` pages (the wrap region and the page before poisoned); page
    ``i`` of ``cache`` is page ``pad + i`` of ``far``."""
    pad = far_pad_blocks(cache, gib)
    return _far_cache(cache, pad), pad


def _far_cache(cache: torch.Tensor, pad: int) -> torch.Tensor:
    """``[pad + n, ...]`` of ``cache``'s dtype on its device: ``cache`` copied behind ``pad`` pages."""
    far = torch.empty((pad + cache.shape[0], *cache.shape[1:]), dtype=cache.dtype, device=cache.device)
    page_bytes = cache[0].numel() * cache.element_size()
    wrapped = min(pad, -(-(_WRAP_POISON_BYTES + cache.shape[0] * page_bytes) // page_bytes))
    far[:wrapped].view(torch.uint8).fill_(0xFF)  # NaN in every float dtype (cases.poison_)
    far[pad - 1].view(torch.uint8).fill_(0xFF)
    far[pad:].copy_(cache)
    return far


def _shift(index: torch.Tensor, by: int) -> torch.Tensor:
    """``index + by`` where ``index >= 0`` (-1 stays -1), in ``index``'s dtype; int32 must hold it."""
    if index.dtype == torch.int32 and index.numel() and int(index.max().item()) + by >= 2**31:
        raise OverflowError(f"a far index does not fit int32 (+{by})")
    return torch.where(index >= 0, index + by, index)


def place_far(prepared: Any, gib: int = FAR_GIB) -> Any:
    """A new ``Prepared`` whose paged caches (``prepared.pages``) sit behind a pad of ``gib`` GiB (see the
    module docstring). The input is not modified; tensors not named in ``pages`` are shared with it.
    Raises ``ValueError`` on a case without paged caches."""
    if not prepared.pages:
        raise ValueError(f"{prepared.case.id}: no paged cache to place far")
    args0 = prepared.steps[0][0]
    replaced: dict[int, torch.Tensor] = {}  # id(original tensor) -> its far version, across steps
    shifts: dict[int, int] = {}  # id(index tensor) -> its shift: one tensor cannot address two pads
    leading: dict[int, int] = {}

    def shift(t: torch.Tensor, by: int) -> None:
        if shifts.setdefault(id(t), by) != by:
            raise ValueError(f"{prepared.case.id}: one index tensor addresses two paged caches")
        if id(t) not in replaced:
            replaced[id(t)] = _shift(t, by)

    for cache_index, pages in prepared.pages.items():
        cache = args0[cache_index]
        replaced[id(cache)], pad = far_copy(cache, gib)
        leading[cache_index] = pad
        for step_args, _ in prepared.steps:
            for index in pages.tables:
                shift(step_args[index], pad)
            for index in pages.slots:
                shift(step_args[index], pad * pages.block_size)
    steps = [(tuple(replaced.get(id(a), a) if isinstance(a, torch.Tensor) else a for a in args), dict(kwargs))
             for args, kwargs in prepared.steps]
    return replace(prepared, steps=steps, leading=leading)
