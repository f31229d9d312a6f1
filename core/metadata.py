"""Per-step metadata for a mixed batch of requests (SPEC §10).

A step is a list of requests, each bringing ``num_tokens`` new tokens (a prefill, a chunk of a
prefill, or one decode token). Tokens of a request are contiguous in the batch, requests in the
order given. Everything a backend needs to place and find KV is derived here once per step, on the
host, and copied to the cache's device; the hot path never recomputes it.

Slot convention (SPEC §10): logical index ``i`` of a request in a group with page size ``B`` lives at
``block_table[req][i // B] * B + i % B``; slot ``-1`` means "skip".
"""
from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from dsv4.specs.errors import DSV4TypeError, DSV4ValueError
from dsv4.specs.formats import round_up

__all__ = [
    "GroupTable",
    "RatioMetadata",
    "StepMetadata",
    "closing_windows_in_call",
    "copy_metadata_",
    "dense_compressed_indices",
    "mark_planned",
    "planned_serial",
    "round_up",
    "slots_from_block_table",
    "topk_local_to_global",
]

# Index tables whose width depends on the context are padded to this multiple, which is what the
# vendor kernels need (FlashMLA decode % 64, prefill % 128; vLLM's _C128A_TOPK_ALIGNMENT = 128).
INDEX_ALIGNMENT = 128


@dataclass(frozen=True)
class GroupTable:
    """Block table of one cache group for the requests of a step.

    block_table: ``[R, max_blocks]`` int32, physical page of each logical page, -1 where none.
    block_size: logical entries per page (tokens for SWA, compressed entries, state rows).
    """

    block_table: torch.Tensor
    block_size: int


@dataclass(frozen=True)
class RatioMetadata:
    """Metadata shared by every layer of one compress ratio ``r`` (4 or 128) in a step.

    compressed_slot_mapping: ``[T]`` int64; slot of entry ``p // r`` where ``(p+1) % r == 0``, else -1.
    state_slot_mapping: ``[T]`` int64; compressor-state row of position ``p``.
    compressed: the compressed (and, for r=4, indexer-key) group's table.
    state: the compressor-state group's table (indexed by absolute position).
    hca_indices / hca_lens: r=128 only: ``[T, W]`` int32 global slots of every visible entry
        ``i < (p+1)//128`` (-1 padded, W a multiple of 128) and ``[T]`` int32 counts.
    topk_lens: r=4 only: ``[T]`` int32 ``min(index_topk, (p+1)//4)``, how many of the indexer's picks
        can be valid (they come first, SPEC §6.3). Every CSA layer of the step passes this one tensor as
        sparse attention's extra lens: a pick on an unallocated page is a -1 slot inside it, skipped
        (SPEC §10: -1 is padding; ARCHITECTURE §3), and a kernel that plans its work from the lens
        (FlashMLA's tile schedule) plans it once a step instead of once a layer. None where a builder
        does not give it.
    """

    ratio: int
    compressed_slot_mapping: torch.Tensor
    state_slot_mapping: torch.Tensor
    compressed: GroupTable
    state: GroupTable
    hca_indices: torch.Tensor | None = None
    hca_lens: torch.Tensor | None = None
    topk_lens: torch.Tensor | None = None


def closing_windows_in_call(context_lens: Sequence[int], query_lens: Sequence[int], ratio: int) -> bool:
    """Host-side: True when every request that closes a ``ratio`` block among its new positions
    ``[c, c+n)`` (``(c+n)//ratio - c//ratio`` of them) starts at position 0: the ``windows_in_call``
    promise of ``compress_insert``."""
    return all(c == 0 or (c + n) // ratio == c // ratio for c, n in zip(context_lens, query_lens, strict=True))


@dataclass(frozen=True)
class StepMetadata:
    """Everything derived from (seq_len, query_len) per request and the block tables (SPEC §10).

    positions: ``[T]`` int64 absolute positions. token_request: ``[T]`` int32 batch row of each
    token. query_start_loc: ``[R+1]`` int32. seq_lens: ``[R]`` int32 lengths after this step.
    swa_slot_mapping: ``[T]`` int64. swa_indices: ``[T, window]`` int32 global SWA slots of
    positions ``max(0, p-window+1) .. p`` (-1 padded). swa_lens: ``[T]`` int32.
    ratios: per compress ratio present in the cache. query_lens, max_seq_len: host-side copies
    (no device sync needed to size tables). context_lens: host-side tokens of each request before
    this step (``seq_len - query_len``), or None where the builder did not give them.

    The tensors ``plan_step`` makes are read-only: refill them (a captured graph's inputs) only with
    :func:`copy_metadata_`; kernels may share per-step plans keyed on them (:func:`planned_serial`).
    """

    request_ids: tuple
    positions: torch.Tensor
    token_request: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    query_lens: tuple[int, ...]
    max_seq_len: int
    swa: GroupTable
    swa_slot_mapping: torch.Tensor
    swa_indices: torch.Tensor
    swa_lens: torch.Tensor
    ratios: dict[int, RatioMetadata] = field(default_factory=dict)
    context_lens: tuple[int, ...] | None = None
    # windows_in_step per ratio, computed once a step (every layer asks; O(requests) on the host)
    _windows_in_step: dict[int, bool] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    def windows_in_step(self, ratio: int) -> bool:
        """Host-side, no device sync: True when every request with a block closing in this step (a new
        position p with ``(p+1) % ratio == 0``) starts at position 0 in it, so every closing block's
        window (SPEC §5.2) is tokens of this step or positions < 0: the ``windows_in_call`` promise of
        ``compress_insert``. False when ``context_lens`` is unknown."""
        if self.context_lens is None:
            return False
        known = self._windows_in_step.get(ratio)
        if known is None:
            known = self._windows_in_step[ratio] = closing_windows_in_call(self.context_lens, self.query_lens,
                                                                           ratio)
        return known

    @property
    def is_decode_only(self) -> bool:
        return all(n == 1 for n in self.query_lens)


def slots_from_block_table(
    index: torch.Tensor, token_request: torch.Tensor, block_table: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Global slots of request-local indices (SPEC §10).

    index: ``[T, K]`` or ``[T]`` integer, -1 (or any negative) for padding.
    token_request: ``[T]`` batch row of each token. block_table: ``[R, max_blocks]`` int32.
    Returns int64 of ``index``'s shape, -1 where ``index < 0`` or the page is not allocated.
    """
    squeeze = index.dim() == 1
    idx = index.long().unsqueeze(-1) if squeeze else index.long()
    valid = idx >= 0
    safe = idx.clamp(min=0)
    page = safe // block_size
    rows = token_request.long().unsqueeze(-1).expand_as(page)
    in_range = page < block_table.shape[1]
    phys = block_table[rows, page.clamp(max=block_table.shape[1] - 1)].long()  # no int64 copy of the table
    slots = phys * block_size + safe % block_size
    slots = torch.where(valid & in_range & (phys >= 0), slots, torch.full_like(slots, -1))
    return slots.squeeze(-1) if squeeze else slots


def check_compressed_pages(block_table: object, block_size: object) -> int:
    """The one structural rule for ``indexer_topk_slots``' page arguments, at every entry (``dsv4.ops``, the
    base ``Backend`` composition, fused backends): ``compressed_block_table`` a 2-D int32 tensor and
    ``compressed_block_size`` a positive integer (an ``int`` or anything with ``__index__``; a float, even
    64.0, is refused rather than truncated). Reads no values. Returns the size as ``int``."""
    if not isinstance(block_table, torch.Tensor):
        raise DSV4TypeError.of("compressed_block_table", "a torch.Tensor", type(block_table).__name__)
    if block_table.dtype != torch.int32:
        raise DSV4TypeError.of("compressed_block_table", "dtype torch.int32", block_table.dtype)
    if block_table.dim() != 2:
        raise DSV4ValueError.of("compressed_block_table", "a 2-D [R, max_blocks] tensor", tuple(block_table.shape))
    if isinstance(block_size, bool) or not hasattr(block_size, "__index__") or operator.index(block_size) <= 0:
        raise DSV4ValueError.of("compressed_block_size", "a positive int (the compressed pages' entries)",
                                repr(block_size))
    return operator.index(block_size)


def topk_local_to_global(
    topk_local: torch.Tensor, token_request: torch.Tensor, block_table: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Request-local compressed indices -> global slots of the compressed cache (SPEC §10).

    topk_local: ``[T, K]`` int32, valid first, -1 padded (the indexer's canonical output).
    Returns ``(global [T, K] int32, lens [T] int32)`` where lens counts the valid entries.
    """
    if topk_local.dim() != 2:
        raise DSV4ValueError.of("topk_local", "a 2-D [T, K] tensor", tuple(topk_local.shape))
    slots = slots_from_block_table(topk_local, token_request, block_table, block_size)
    lens = (slots >= 0).sum(dim=-1).to(torch.int32)
    return slots.to(torch.int32), lens


def dense_compressed_indices(
    positions: torch.Tensor, token_request: torch.Tensor, block_table: torch.Tensor, block_size: int, ratio: int,
    max_visible: int, alignment: int = INDEX_ALIGNMENT,
) -> tuple[torch.Tensor, torch.Tensor]:
    """HCA index lists (SPEC §2, §10): every compressed entry ``i < (p+1)//ratio`` of a token's request.

    positions: ``[T]`` int64. token_request: ``[T]`` batch row. block_table: ``[R, max_blocks]`` int32 of the
    compressed group. max_visible: host-side ``max((p+1)//ratio)`` over the tokens (sizes the table with
    no device sync). Returns ``(indices [T, W] int32 global slots, -1 padded; lens [T] int32)`` with
    ``W = max(alignment, round_up(max_visible, alignment))``, on ``positions``' device.

    The slots of entry j depend only on the request, so they are computed once per request (``[R, W]``)
    and gathered per token: two ``[T, W]`` int32 passes, no int64 ``[T, W]`` temporaries.
    """
    width = max(alignment, round_up(int(max_visible), alignment))
    device = positions.device
    cols = torch.arange(width, device=device)
    pages = cols // block_size
    table = block_table.to(device=device, dtype=torch.int32)
    phys = table[:, pages.clamp(max=table.shape[1] - 1)]  # [R, W]
    per_request = torch.where((pages < table.shape[1]) & (phys >= 0), phys * block_size + (cols % block_size).to(
        torch.int32), torch.full_like(phys, -1))
    visible = (positions + 1) // ratio  # [T]
    indices = per_request.index_select(0, token_request.to(device=device, dtype=torch.long))
    indices.masked_fill_(cols[None, :] >= visible[:, None], -1)
    return indices, visible.to(torch.int32)


# A step-metadata tensor made by ``plan_step`` carries the plan's serial in this attribute: plan_step's
# tensors are read-only by contract (only copy_metadata_ refills them, and it drops the mark), so a kernel
# plan keyed on them (FlashMLA's tile schedule) may be shared by every layer of the step even where a
# version counter cannot show an in-place write (inference tensors, ``torch.inference_mode``).
_PLANNED = "_dsv4_plan"


def _tensors(md: object, prefix: str = ""):
    """``(name, tensor)`` of every tensor of step metadata ``md`` (nested dataclasses and the ratios dict
    included), in field order."""
    for f in dataclasses.fields(md):
        value = getattr(md, f.name)
        if isinstance(value, torch.Tensor):
            yield prefix + f.name, value
        elif dataclasses.is_dataclass(value):
            yield from _tensors(value, f"{prefix}{f.name}.")
        elif isinstance(value, dict):  # ratios; host-side memos (windows_in_step) are not tensors
            for key, item in value.items():
                if dataclasses.is_dataclass(item):
                    yield from _tensors(item, f"{prefix}{f.name}[{key}].")


def mark_planned(md: StepMetadata, serial: int) -> None:
    """Mark every tensor of ``md`` as made by plan ``serial`` (``PagedKVCache.plan_step``)."""
    for _, t in _tensors(md):
        setattr(t, _PLANNED, serial)


def planned_serial(t: torch.Tensor) -> int | None:
    """The plan that made ``t`` and still owns its values, or None (not plan_step's, a view of it, or
    refilled by :func:`copy_metadata_`)."""
    return getattr(t, _PLANNED, None)


def copy_metadata_(dst: StepMetadata, src: StepMetadata) -> None:
    """Every tensor of step metadata ``src`` into ``dst``'s, in place: how an engine feeds a CUDA graph,
    captured with ``dst``'s step, the next step (then ``cache.mark_written(step)`` after the replay).
    Shapes must agree (same batch rows and widths), all checked before anything is copied; host-side
    values are not graph inputs and stay."""
    pairs = list(zip(_tensors(dst), _tensors(src), strict=True))
    for (name, a), (_, b) in pairs:
        if a.shape != b.shape:
            raise DSV4ValueError.of(f"src.{name}", f"shape {tuple(a.shape)} (the captured step's)",
                                    f"shape {tuple(b.shape)}")
    for (_, a), (_, b) in pairs:
        a.copy_(b)
        if hasattr(a, _PLANNED):
            delattr(a, _PLANNED)  # its values are no longer the plan's
