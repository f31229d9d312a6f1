"""Codec machinery shared by every cache format (SPEC §9, §10, §12).

A codec turns rows (``[N, row_dim]`` floats) into a format's bytes at given slots and back.
Slot ``s`` lives in page ``s // B`` at token ``s % B`` (SPEC §10); ``-1`` means "skip" on write and
"zeros" on read. Every check runs before the first byte is written (SPEC §12): a rejected call
leaves the cache untouched.

Byte formats store ``uint8 [num_blocks, page_stride]``. Their page is a sequence of *sections*: a
section holds ``B`` equal per-token records back to back, so section ``k`` starts at
``B * sum(widths[:k])``; bytes past the last section are page padding and never touched.
Typed views reinterpret little-endian bytes (every supported device is little-endian).
"""
from __future__ import annotations

from typing import ClassVar

import torch
from dsv4.specs.errors import CacheLayoutError, DSV4TypeError, DSV4ValueError
from dsv4.specs.formats import CacheFormat
from torch import Tensor

__all__ = ["ByteCodec", "Codec", "RowsCodec", "check_slots", "reinterpret"]

_ELEMENT_TYPES = {torch.float8_e4m3fn: "e4m3", torch.bfloat16: "bf16", torch.float32: "fp32"}


def reinterpret(raw: Tensor, dtype: torch.dtype) -> Tensor:
    """uint8 ``[..., n]`` bytes as ``dtype`` ``[..., n / itemsize]`` (or back when ``dtype`` is uint8)."""
    return raw.contiguous().view(dtype)


def check_slots(slots: Tensor, capacity: int, device: torch.device, argument: str = "slots") -> None:
    """``slots``: int64 ``[N]`` on ``device``, every value in ``[-1, capacity)`` (one device sync)."""
    if not isinstance(slots, Tensor):
        raise DSV4TypeError.of(argument, "a torch.Tensor", type(slots).__name__)
    if slots.dtype != torch.int64:
        raise DSV4TypeError.of(argument, "dtype torch.int64", slots.dtype)
    if slots.dim() != 1:
        raise DSV4ValueError.of(argument, "shape [N]", tuple(slots.shape))
    if slots.device != device:
        raise DSV4ValueError.of(argument, f"device {device} (the cache's)", slots.device)
    if slots.numel():
        low, high = int(slots.min()), int(slots.max())
        if low < -1 or high >= capacity:
            raise DSV4ValueError.of(argument, f"values in [-1, {capacity}) (-1 = skip)", f"min {low}, max {high}")


class Codec:
    """Base of every codec: ``allocate``, ``block_size_of``, ``write_rows``, ``read_rows``."""

    format: CacheFormat

    def __init__(self, fmt: CacheFormat) -> None:
        self.format = fmt

    @property
    def name(self) -> str:
        return self.format.name

    @property
    def row_dim(self) -> int:
        return self.format.row_dim

    @property
    def row_elements(self) -> tuple[tuple[str, int], ...]:
        """What a dequantized row's elements are stored as, in ``read_rows`` order: ``(type, count)`` runs
        with type one of ``e4m3``, ``bf16``, ``e2m1``, ``int8``, ``fp32``. A row format's is its storage dtype;
        a byte format's codec sets its own (a class attribute)."""
        if self.format.storage_dtype not in _ELEMENT_TYPES:
            raise NotImplementedError(f"{self.name}: a byte format's codec states its row_elements")
        return ((_ELEMENT_TYPES[self.format.storage_dtype], self.row_dim),)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.format.name!r})"

    # ------------------------------------------------------------------ storage
    def allocate(self, num_blocks: int, block_size: int, device: torch.device | str = "cpu") -> Tensor:
        """Zeroed storage of ``num_blocks`` pages of ``block_size`` tokens (see ``format.storage_shape``)."""
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise DSV4ValueError.of("num_blocks", "a positive integer", num_blocks)
        shape = self.format.storage_shape(num_blocks, block_size)
        return torch.zeros(shape, dtype=self.format.storage_dtype, device=device)

    def block_size_of(self, cache: Tensor) -> int:
        """Tokens a page of ``cache``."""
        raise NotImplementedError

    def _check_cache(self, cache: Tensor) -> None:
        if not isinstance(cache, Tensor):
            raise DSV4TypeError.of("cache", "a torch.Tensor", type(cache).__name__)
        if cache.dtype != self.format.storage_dtype:
            raise CacheLayoutError.of("cache", f"dtype {self.format.storage_dtype} ({self.name})", cache.dtype)

    def _check_rows(self, rows: Tensor, num_slots: int) -> None:
        if not isinstance(rows, Tensor) or not rows.is_floating_point():
            got = rows.dtype if isinstance(rows, Tensor) else type(rows).__name__
            raise DSV4TypeError.of("rows", "a floating-point tensor", got)
        if tuple(rows.shape) != (num_slots, self.row_dim):
            raise DSV4ValueError.of("rows", f"shape [{num_slots}, {self.row_dim}]", tuple(rows.shape))

    def _capacity(self, cache: Tensor, block_size: int) -> int:
        return cache.shape[0] * block_size

    # ------------------------------------------------------------------ rows
    def write_rows(self, cache: Tensor, slots: Tensor, rows: Tensor, *, block_size: int | None = None,
                   check: bool = True) -> None:
        """Quantize ``rows [N, row_dim]`` float into ``cache`` at ``slots [N]`` int64 (-1 skipped).

        ``check=False`` skips the slot-range check (one device sync) for hot paths that built the
        slots themselves.
        """
        self._check_cache(cache)
        block = self.block_size_of(cache) if block_size is None else block_size
        self._check_block_size(cache, block)
        if check:
            check_slots(slots, self._capacity(cache, block), cache.device)
        self._check_rows(rows, slots.shape[0])
        keep = (slots >= 0).nonzero().squeeze(1)
        slots, rows = slots.index_select(0, keep), rows.index_select(0, keep)
        self._scatter(cache, slots, rows, block)

    def read_rows(self, cache: Tensor, slots: Tensor, *, block_size: int | None = None,
                  check: bool = True) -> Tensor:
        """Dequantized rows at ``slots [N]`` int64 -> fp32 ``[N, row_dim]`` (zeros where slot is -1)."""
        self._check_cache(cache)
        block = self.block_size_of(cache) if block_size is None else block_size
        self._check_block_size(cache, block)
        if check:
            check_slots(slots, self._capacity(cache, block), cache.device)
        valid = slots >= 0
        rows = self._gather(cache, torch.where(valid, slots, torch.zeros_like(slots)), block)
        return torch.where(valid.unsqueeze(1), rows, torch.zeros_like(rows))

    def _check_block_size(self, cache: Tensor, block_size: int) -> None:
        raise NotImplementedError

    def _scatter(self, cache: Tensor, slots: Tensor, rows: Tensor, block_size: int) -> None:
        raise NotImplementedError

    def _gather(self, cache: Tensor, slots: Tensor, block_size: int) -> Tensor:
        raise NotImplementedError


class ByteCodec(Codec):
    """A byte format made of per-token sections (see module docstring).

    Subclasses set ``sections`` (``(field name, bytes a token)`` in page order) and implement
    ``encode`` (rows -> per-section uint8 ``[N, width]``), ``decode`` (the inverse, fp32 out),
    ``to_fields`` / ``from_fields`` (section bytes <-> named typed fields).
    """

    sections: ClassVar[tuple[tuple[str, int], ...]]

    def allocate(self, num_blocks: int, block_size: int, device: torch.device | str = "cpu",
                 page_stride: int | None = None) -> Tensor:
        """Zeroed ``uint8 [num_blocks, page_stride]``; a larger ``page_stride`` pads pages (shared groups)."""
        stride = self.format.page_stride(block_size)
        if page_stride is not None:
            if page_stride < stride:
                raise CacheLayoutError.of("page_stride", f">= {stride} ({self.name}, block_size {block_size})",
                                          page_stride)
            stride = page_stride
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise DSV4ValueError.of("num_blocks", "a positive integer", num_blocks)
        return torch.zeros((num_blocks, stride), dtype=torch.uint8, device=device)

    def block_size_of(self, cache: Tensor) -> int:
        """Invert ``page_stride``: the one block size whose stride equals ``cache.shape[1]``."""
        self._check_cache(cache)
        if cache.dim() != 2:
            raise CacheLayoutError.of("cache", "shape [num_blocks, page_stride]", tuple(cache.shape))
        stride, token = cache.shape[1], self.format.token_bytes
        low = max(1, (stride - self.format.alignment) // token)
        for block in range(low, stride // token + 1):
            if self.format.page_stride(block) == stride:
                return block
        raise CacheLayoutError.of("cache", f"a page stride of {self.name} for some block size", stride,
                                  "pass block_size= for pages padded past the format's own stride")

    def _check_block_size(self, cache: Tensor, block_size: int) -> None:
        if cache.dim() != 2 or cache.shape[1] < self.format.page_bytes(block_size):
            raise CacheLayoutError.of("cache", f"shape [num_blocks, >= {self.format.page_bytes(block_size)}] "
                                      f"for block_size {block_size}", tuple(cache.shape))

    def section_views(self, pages: Tensor, block_size: int) -> list[Tensor]:
        """Views ``[..., B, width]`` of each section of ``pages`` uint8 ``[..., page_stride]``."""
        views, offset = [], 0
        for _, width in self.sections:
            part = pages[..., offset: offset + block_size * width]
            views.append(part.unflatten(-1, (block_size, width)))
            offset += block_size * width
        return views

    def _scatter(self, cache: Tensor, slots: Tensor, rows: Tensor, block_size: int) -> None:
        pages, tokens = slots // block_size, slots % block_size
        for view, data in zip(self.section_views(cache, block_size), self.encode(rows)):
            view[pages, tokens] = data

    def _gather(self, cache: Tensor, slots: Tensor, block_size: int) -> Tensor:
        pages, tokens = slots // block_size, slots % block_size
        return self.decode([view[pages, tokens] for view in self.section_views(cache, block_size)])

    # ------------------------------------------------------------------ pages (byte level)
    def unpack_page(self, pages: Tensor, block_size: int | None = None) -> dict[str, Tensor]:
        """Named typed fields of ``pages`` uint8 ``[..., page_stride]``; each field is ``[..., B, ...]``.

        Padding (scale pad bytes, record tails, the page tail) is not returned.
        """
        if pages.dtype != torch.uint8:
            raise CacheLayoutError.of("pages", "dtype torch.uint8", pages.dtype)
        block = self.block_size_of(pages.reshape(-1, pages.shape[-1])) if block_size is None else block_size
        if pages.shape[-1] < self.format.page_bytes(block):
            raise CacheLayoutError.of("pages", f"last dim >= {self.format.page_bytes(block)}", pages.shape[-1])
        return self.to_fields([view.contiguous() for view in self.section_views(pages, block)])

    def field_byte_masks(self, block_size: int, page_stride: int | None = None) -> dict[str, Tensor]:
        """Per field of :meth:`unpack_page` (in its order), bool ``[page_stride]``: True where a page byte is
        read as that field. Derived from the codec's own field table (``to_fields`` / ``from_fields``): every
        field byte survives an all-0xFF round trip, and each field is packed alone."""
        stride, probe = self._all_ones_fields(block_size, page_stride)
        return {name: self.pack_page({k: v if k == name else torch.zeros_like(v) for k, v in probe.items()},
                                     block_size, stride)[0] != 0
                for name in probe}

    def field_byte_mask(self, block_size: int, page_stride: int | None = None) -> Tensor:
        """bool ``[page_stride]``: True where a page byte belongs to a field (what ``unpack_page`` and
        ``read_rows`` read), False for padding: scale pad bytes, record tails, the page tail. The union of
        :meth:`field_byte_masks` (one all-0xFF round trip: every field byte survives it)."""
        stride, probe = self._all_ones_fields(block_size, page_stride)
        return self.pack_page(probe, block_size, stride)[0] != 0

    def _all_ones_fields(self, block_size: int, page_stride: int | None) -> tuple[int, dict[str, Tensor]]:
        """``(page_stride, fields)``: the stride (the format's for ``block_size`` when None) and the
        :meth:`unpack_page` fields of one all-0xFF uint8 ``[1, page_stride]`` page, the probe of both masks."""
        stride = self.format.page_stride(block_size) if page_stride is None else page_stride
        return stride, self.unpack_page(torch.full((1, stride), 0xFF, dtype=torch.uint8), block_size)

    def pack_page(self, fields: dict[str, Tensor], block_size: int, page_stride: int | None = None) -> Tensor:
        """Inverse of :meth:`unpack_page`: uint8 ``[..., page_stride]`` with every padding byte 0."""
        sections = self.from_fields(fields)
        lead = sections[0].shape[:-2]
        stride = self.format.page_stride(block_size) if page_stride is None else page_stride
        pages = torch.zeros((*lead, stride), dtype=torch.uint8, device=sections[0].device)
        for view, data in zip(self.section_views(pages, block_size), sections):
            if tuple(data.shape[-2:]) != tuple(view.shape[-2:]):
                raise CacheLayoutError.of("fields", f"[..., {block_size}, {view.shape[-1]}] bytes per section",
                                          tuple(data.shape))
            view.copy_(data)
        return pages

    def encode(self, rows: Tensor) -> list[Tensor]:
        raise NotImplementedError

    def decode(self, sections: list[Tensor]) -> Tensor:
        raise NotImplementedError

    def to_fields(self, sections: list[Tensor]) -> dict[str, Tensor]:
        raise NotImplementedError

    def from_fields(self, fields: dict[str, Tensor]) -> list[Tensor]:
        raise NotImplementedError


class RowsCodec(Codec):
    """A typed row format: storage ``[nb, B, (1,) row_dim]``; slot ``s`` is flat row ``s``."""

    def block_size_of(self, cache: Tensor) -> int:
        self._check_cache(cache)
        expected = len(self.format.storage_shape(1, 1))
        if cache.dim() != expected or cache.shape[-1] != self.row_dim:
            raise CacheLayoutError.of("cache", f"{expected}-d storage ending in {self.row_dim} ({self.name})",
                                      tuple(cache.shape))
        return cache.shape[1]

    def _check_block_size(self, cache: Tensor, block_size: int) -> None:
        if self.block_size_of(cache) != block_size:
            raise CacheLayoutError.of("block_size", f"{cache.shape[1]} (the cache's)", block_size)

    def _flat(self, cache: Tensor) -> Tensor:
        return cache.view(-1, self.row_dim)

    def _to_storage(self, rows: Tensor) -> Tensor:
        return rows.to(self.format.storage_dtype)

    def _from_storage(self, stored: Tensor) -> Tensor:
        return stored.float()

    def _scatter(self, cache: Tensor, slots: Tensor, rows: Tensor, block_size: int) -> None:
        self._flat(cache)[slots] = self._to_storage(rows)

    def _gather(self, cache: Tensor, slots: Tensor, block_size: int) -> Tensor:
        return self._from_storage(self._flat(cache)[slots])
