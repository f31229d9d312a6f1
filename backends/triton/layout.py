"""Byte layouts the Triton kernels read and write, derived from ``dsv4.specs.formats``.

No byte count is written here: every offset and stride comes from the format objects (SPEC §9),
so a format change there reaches the kernels without edits.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from dsv4.specs.errors import CacheLayoutError, DSV4TypeError
from dsv4.specs.formats import get_format

__all__ = [
    "KEY_FORMATS",
    "LATENT_FORMATS",
    "KeyLayout",
    "LatentLayout",
    "key_layout",
    "latent_layout",
    "unit_stride",
]

def unit_stride(t: torch.Tensor | None) -> torch.Tensor | None:
    """Integer metadata as the kernels read it (the backend's stride policy, ``backend.py``): a [T] index
    tensor (positions, slot mappings, token_request, lens) at ``ptr + t``, a block table or index row at
    ``ptr + row * stride(0) + column``. A view whose last dim is not unit-stride (``t2[:, 0]``,
    ``table[:, ::2]``) is copied; any other tensor is passed as it is (no copy)."""
    return t if t is None or t.is_contiguous() or t.stride(-1) == 1 else t.contiguous()  # common case first


# Formats the kernels implement (SPEC §9.1-9.3). fp8_e4m3 rows need a per-tensor scale that the op
# signature does not carry, and Ascend's int8 keys have no Triton writer yet.
LATENT_FORMATS: tuple[str, ...] = ("fp8_ds_mla", "bf16", "ascend_bf16", "ascend_a5")
KEY_FORMATS: tuple[str, ...] = ("indexer_fp8", "indexer_mxfp4")


@dataclass(frozen=True)
class LatentLayout:
    """Where one token's 512-d latent row lives, in bytes from the start of the storage.

    token record at ``page * page_stride + (slot % block_size) * token_stride``; nope values at
    ``+ nope_offset`` (e4m3 bytes when ``fp8_nope``, else bf16); rope bf16 at ``+ rope_offset``;
    UE8M0 scale bytes at ``page * page_stride + scale_offset + (slot % block_size) * scale_stride``.
    """

    format_name: str
    fp8_nope: bool
    block_size: int
    page_stride: int
    token_stride: int
    nope_offset: int
    rope_offset: int
    scale_offset: int
    scale_stride: int
    nope_dim: int
    rope_dim: int
    quant_block: int
    num_scales: int
    scale_row_bytes: int

    @property
    def row_dim(self) -> int:
        return self.nope_dim + self.rope_dim

    def kernel_args(self) -> tuple[int, ...]:
        """(block_size, page_stride, token_stride, nope_offset, rope_offset, scale_offset, scale_stride)."""
        return (self.block_size, self.page_stride, self.token_stride, self.nope_offset, self.rope_offset,
                self.scale_offset, self.scale_stride)

    def byte_views(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(uint8 view, bf16 view) of the same storage; kernels index both in bytes / 2-byte units."""
        if cache.dtype == torch.uint8:
            return cache, cache.view(torch.bfloat16)
        return cache.view(torch.uint8), cache

    @property
    def num_slots_per_page(self) -> int:
        return self.block_size


@dataclass(frozen=True)
class KeyLayout:
    """Indexer key page: ``[B x value_bytes][B x scale_bytes]`` (SPEC §9.3)."""

    format_name: str
    block_size: int
    page_stride: int
    value_bytes: int
    scale_offset: int
    scale_bytes: int
    dim: int
    quant_block: int  # mxfp4: elements per UE8M0 scale; fp8: the whole vector

    def kernel_args(self) -> tuple[int, ...]:
        """(block_size, page_stride, value_bytes, scale_offset, scale_bytes)."""
        return (self.block_size, self.page_stride, self.value_bytes, self.scale_offset, self.scale_bytes)


def _block_size_of_rows(cache: torch.Tensor) -> int:
    return cache.shape[1]


def latent_layout(kv_format: str, cache: torch.Tensor, argument: str = "swa_cache") -> LatentLayout:
    """Layout of a 512-d latent cache of format ``kv_format`` with storage ``cache``."""
    if kv_format not in LATENT_FORMATS:
        raise CacheLayoutError.of("kv_format", f"one of {', '.join(LATENT_FORMATS)} (Triton backend)",
                                  repr(kv_format))
    fmt = get_format(kv_format)
    if fmt.layout == "rows":
        if cache.dtype != fmt.storage_dtype:
            raise DSV4TypeError.of(argument, f"dtype {fmt.storage_dtype} ({kv_format} rows)", cache.dtype)
        block_size = _block_size_of_rows(cache)
        if tuple(cache.shape) != fmt.storage_shape(cache.shape[0], block_size) or not cache.is_contiguous():
            raise CacheLayoutError.of(argument, f"contiguous {kv_format} storage "
                                      f"{list(fmt.storage_shape(cache.shape[0], block_size))}", list(cache.shape))
        rope_dim = get_format("fp8_ds_mla").rope_dim
        nope_dim = fmt.row_dim - rope_dim
        return LatentLayout(kv_format, False, block_size, fmt.page_stride(block_size), fmt.token_bytes,
                            0, nope_dim * fmt.elem_bytes, 0, 0, nope_dim, rope_dim, nope_dim, 0, 0)
    if cache.dtype != torch.uint8 or cache.dim() != 2 or not cache.is_contiguous():
        raise DSV4TypeError.of(argument, f"contiguous uint8 [num_blocks, page_stride] ({kv_format})",
                               f"{cache.dtype} {list(cache.shape)}")
    block_size = _infer_block_size(fmt, cache.shape[1], argument)
    if kv_format == "fp8_ds_mla":
        return LatentLayout(kv_format, True, block_size, cache.shape[1], fmt.data_bytes, 0, fmt.nope_bytes,
                            fmt.scale_offset(block_size), fmt.scale_row_bytes, fmt.nope_dim, fmt.rope_dim,
                            fmt.quant_block, fmt.scale_bytes, fmt.scale_row_bytes)
    # ascend_a5: [rope bf16 | nope e4m3 | scales | pad] records (SPEC §9.2)
    rope_dim = fmt.rope_bytes // 2
    quant_block = fmt.nope_bytes // fmt.scale_bytes
    return LatentLayout(kv_format, True, block_size, cache.shape[1], fmt.record_bytes, fmt.nope_offset,
                        fmt.rope_offset, fmt.scale_offset, fmt.record_bytes, fmt.nope_bytes, rope_dim,
                        quant_block, fmt.scale_bytes, fmt.record_bytes - fmt.scale_offset)


def _infer_block_size(fmt, page_stride: int, argument: str) -> int:
    try:
        return _block_size_for_stride(fmt.name, page_stride)
    except CacheLayoutError as exc:
        raise CacheLayoutError.of(argument, f"a {fmt.name} page stride", page_stride) from exc


@functools.lru_cache(maxsize=256)
def _block_size_for_stride(format_name: str, page_stride: int) -> int:
    # The codec owns the inversion page_stride -> block size (SPEC §9.1 padding rules); cached because
    # every op call asks it (host overhead per call, measured on the H200).
    from dsv4.codecs import get_codec

    probe = torch.empty((1, page_stride), dtype=torch.uint8, device="meta")
    return get_codec(format_name).block_size_of(probe)


def key_layout(key_format: str, cache: torch.Tensor, argument: str = "key_cache") -> KeyLayout:
    """Layout of an indexer key cache (uint8 ``[num_blocks, page_stride]``)."""
    if key_format not in KEY_FORMATS:
        raise CacheLayoutError.of("key_format", f"one of {', '.join(KEY_FORMATS)} (Triton backend)",
                                  repr(key_format))
    fmt = get_format(key_format)
    if cache.dtype != torch.uint8 or cache.dim() != 2 or not cache.is_contiguous():
        raise DSV4TypeError.of(argument, f"contiguous uint8 [num_blocks, page_stride] ({key_format})",
                               f"{cache.dtype} {list(cache.shape)}")
    block_size = _infer_block_size(fmt, cache.shape[1], argument)
    quant_block = getattr(fmt, "quant_block", fmt.row_dim)
    return KeyLayout(key_format, block_size, cache.shape[1], fmt.value_bytes, fmt.scale_offset(block_size),
                     fmt.scale_bytes, fmt.row_dim, quant_block)
