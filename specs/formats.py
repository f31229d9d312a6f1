"""Cache formats with named byte fields (SPEC §9). Every byte count of the project lives here.

Each format is a frozen model exposing ``token_bytes``, ``page_bytes(block_size)`` (unpadded),
``page_stride(block_size)`` (padded to the format's own ``alignment``), ``storage_dtype``,
``row_dim`` and ``storage_shape(num_blocks, block_size)``. Byte formats are stored as
``uint8 [num_blocks, page_stride]``; row formats as typed tensors.

Layouts (B = tokens a page):

- ``fp8_ds_mla`` (§9.1): ``[B x (448 e4m3 nope | 64 bf16 rope)] [B x (7 ue8m0 | 1 pad)] [pad to 576k]``.
- ``ascend_a5`` (§9.2): ``B x [64 bf16 rope | 448 e4m3 | 7 ue8m0 | pad]`` records of 640 B.
- ``indexer_fp8`` (§9.3): ``[B x 128 e4m3] [B x fp32 scale]``.
- ``indexer_mxfp4`` (§9.3): ``[B x 64 packed e2m1] [B x 4 ue8m0]``.
- ``indexer_ascend_int8`` (§9.3): ``[B x 128 int8] [B x fp16 scale]``.
- ``bf16`` / ``fp8_e4m3`` rows ``[nb, B, 512]``; ``ascend_bf16`` ``[nb, B, 1, 512]``;
  ``compressor_state`` fp32 ``[nb, B, 2*coff*d]`` (§9.4).
"""
from __future__ import annotations

from typing import Any, ClassVar, Literal

import torch
from dsv4.specs.errors import CacheLayoutError, ConfigError
from pydantic import BaseModel, ConfigDict, model_validator

__all__ = [
    "PLAIN_MLA_ALIGNMENT",
    "AscendA5Format",
    "AscendBf16Format",
    "Bf16RowsFormat",
    "CacheFormat",
    "CompressorStateFormat",
    "Fp8DsMlaFormat",
    "Fp8E4m3RowsFormat",
    "IndexerAscendInt8Format",
    "IndexerFp8Format",
    "IndexerMxfp4Format",
    "format_names",
    "get_format",
    "round_up",
]


# vLLM's page alignment of MLA-type cache groups when the latent cache is not fp8_ds_mla
# (SPEC §9.5; with fp8_ds_mla every group aligns to Fp8DsMlaFormat.alignment).
PLAIN_MLA_ALIGNMENT = 512


def round_up(value: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``value``."""
    return -(-value // multiple) * multiple


class CacheFormat(BaseModel):
    """Base of every cache format: one token (or state row) occupies ``token_bytes`` in a page."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    role: Literal["latent", "indexer_key", "compressor_state"]
    layout: Literal["bytes", "rows"]
    row_dim: int
    alignment: int = 1

    _storage_dtype: ClassVar[torch.dtype] = torch.uint8

    @property
    def token_bytes(self) -> int:
        raise NotImplementedError

    @property
    def storage_dtype(self) -> torch.dtype:
        """dtype of the storage tensor (uint8 for byte formats)."""
        return self._storage_dtype

    def page_bytes(self, block_size: int) -> int:
        """Bytes of ``block_size`` tokens, without any padding."""
        return self._check_block_size(block_size) * self.token_bytes

    def page_stride(self, block_size: int) -> int:
        """Bytes between pages: ``page_bytes`` rounded up to the format's ``alignment``."""
        return round_up(self.page_bytes(block_size), self.alignment)

    def storage_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of the storage tensor of ``num_blocks`` pages."""
        if self.layout == "bytes":
            return (num_blocks, self.page_stride(block_size))
        return (num_blocks, self._check_block_size(block_size), self.row_dim)

    @staticmethod
    def _check_block_size(block_size: int) -> int:
        if not isinstance(block_size, int) or block_size <= 0:
            raise CacheLayoutError.of("block_size", "a positive integer", block_size)
        return block_size


class Fp8DsMlaFormat(CacheFormat):
    """SPEC §9.1: FlashMLA's V4 page. Token data first, then 8-byte scale rows, then padding."""

    name: Literal["fp8_ds_mla"] = "fp8_ds_mla"
    role: Literal["latent"] = "latent"
    layout: Literal["bytes"] = "bytes"
    row_dim: int = 512
    nope_dim: int = 448  # e4m3, one byte each
    rope_dim: int = 64  # bf16, little-endian
    rope_elem_bytes: int = 2
    nope_bytes: int = 448
    rope_bytes: int = 128
    data_bytes: int = 576  # nope_bytes + rope_bytes
    quant_block: int = 64
    scale_bytes: int = 7  # one UE8M0 byte per nope block of 64
    scale_pad_bytes: int = 1  # writers write 0, readers ignore
    scale_row_bytes: int = 8
    bytes_per_token: int = 584  # data_bytes + scale_row_bytes
    alignment: int = 576

    @model_validator(mode="after")
    def _consistent(self) -> Fp8DsMlaFormat:
        _require(self, self.nope_bytes == self.nope_dim, "nope_bytes", "nope_dim")
        _require(self, self.rope_bytes == self.rope_dim * self.rope_elem_bytes, "rope_bytes", "rope_dim * 2")
        _require(self, self.data_bytes == self.nope_bytes + self.rope_bytes, "data_bytes", "nope + rope bytes")
        _require(self, self.scale_bytes == self.nope_dim // self.quant_block, "scale_bytes", "nope blocks")
        _require(self, self.scale_row_bytes == self.scale_bytes + self.scale_pad_bytes, "scale_row_bytes",
                 "scale + pad bytes")
        _require(self, self.bytes_per_token == self.data_bytes + self.scale_row_bytes, "bytes_per_token",
                 "data + scale row bytes")
        _require(self, self.row_dim == self.nope_dim + self.rope_dim, "row_dim", "nope + rope dims")
        return self

    @property
    def token_bytes(self) -> int:
        return self.bytes_per_token

    def data_offset(self, token: int) -> int:
        """Byte offset of token ``token``'s 576 data bytes inside its page."""
        return token * self.data_bytes

    def scale_offset(self, block_size: int, token: int = 0) -> int:
        """Byte offset of token ``token``'s scale row: after all ``block_size`` data rows."""
        return block_size * self.data_bytes + token * self.scale_row_bytes


class _RowsFormat(CacheFormat):
    role: Literal["latent"] = "latent"
    layout: Literal["rows"] = "rows"
    row_dim: int = 512
    elem_bytes: int

    @property
    def token_bytes(self) -> int:
        return self.row_dim * self.elem_bytes


class Bf16RowsFormat(_RowsFormat):
    """SPEC §9.2: bf16 rows ``[nb, B, 512]`` (``[448 nope | 64 roped]``)."""

    name: Literal["bf16"] = "bf16"
    elem_bytes: int = 2
    _storage_dtype: ClassVar[torch.dtype] = torch.bfloat16


class Fp8E4m3RowsFormat(_RowsFormat):
    """SPEC §9.2: e4m3 rows ``[nb, B, 512]`` with one per-tensor scale (FlashInfer SM10x)."""

    name: Literal["fp8_e4m3"] = "fp8_e4m3"
    elem_bytes: int = 1
    _storage_dtype: ClassVar[torch.dtype] = torch.float8_e4m3fn


class AscendBf16Format(_RowsFormat):
    """SPEC §9.2: Ascend A2/A3 bf16 ``[nb, B, 1, 512]``."""

    name: Literal["ascend_bf16"] = "ascend_bf16"
    elem_bytes: int = 2
    _storage_dtype: ClassVar[torch.dtype] = torch.bfloat16

    def storage_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (num_blocks, self._check_block_size(block_size), 1, self.row_dim)


class AscendA5Format(CacheFormat):
    """SPEC §9.2: Ascend A5 token records ``[64 bf16 rope | 448 e4m3 | 7 ue8m0 | pad]``, 640 B each."""

    name: Literal["ascend_a5"] = "ascend_a5"
    role: Literal["latent"] = "latent"
    layout: Literal["bytes"] = "bytes"
    row_dim: int = 512
    rope_offset: int = 0
    rope_bytes: int = 128
    nope_offset: int = 128
    nope_bytes: int = 448
    scale_offset: int = 576
    scale_bytes: int = 7
    record_bytes: int = 640

    @model_validator(mode="after")
    def _consistent(self) -> AscendA5Format:
        _require(self, self.nope_offset == self.rope_offset + self.rope_bytes, "nope_offset", "after rope")
        _require(self, self.scale_offset == self.nope_offset + self.nope_bytes, "scale_offset", "after nope")
        _require(self, self.record_bytes >= self.scale_offset + self.scale_bytes, "record_bytes", "room")
        return self

    @property
    def token_bytes(self) -> int:
        return self.record_bytes


class _SplitKeyFormat(CacheFormat):
    """Indexer keys: ``[B x value_bytes]`` then ``[B x scale_bytes]`` in one page (SPEC §9.3)."""

    role: Literal["indexer_key"] = "indexer_key"
    layout: Literal["bytes"] = "bytes"
    row_dim: int = 128
    value_bytes: int
    scale_bytes: int

    @property
    def token_bytes(self) -> int:
        return self.value_bytes + self.scale_bytes

    def scale_offset(self, block_size: int, token: int = 0) -> int:
        """Byte offset of token ``token``'s scale: after all ``block_size`` value rows."""
        return block_size * self.value_bytes + token * self.scale_bytes


class IndexerFp8Format(_SplitKeyFormat):
    """``fp8``: 128 e4m3 then one fp32 power-of-two scale; 132 B a token."""

    name: Literal["indexer_fp8"] = "indexer_fp8"
    value_bytes: int = 128
    scale_bytes: int = 4


class IndexerMxfp4Format(_SplitKeyFormat):
    """``mxfp4``: 64 packed e2m1 bytes (element 2i low nibble) then 4 UE8M0 bytes (per 32); 68 B."""

    name: Literal["indexer_mxfp4"] = "indexer_mxfp4"
    value_bytes: int = 64
    scale_bytes: int = 4
    quant_block: int = 32


class IndexerAscendInt8Format(_SplitKeyFormat):
    """Ascend A2/A3: 128 int8 then one fp16 scale; 130 B a token."""

    name: Literal["indexer_ascend_int8"] = "indexer_ascend_int8"
    value_bytes: int = 128
    scale_bytes: int = 2


class CompressorStateFormat(CacheFormat):
    """SPEC §9.4: fp32 rows ``[kv (coff*d) | score+ape (coff*d)]``, one row per position."""

    name: Literal["compressor_state"] = "compressor_state"
    role: Literal["compressor_state"] = "compressor_state"
    layout: Literal["rows"] = "rows"
    ratio: int = 4
    head_dim: int = 512
    elem_bytes: int = 4
    row_dim: int = 0  # derived: 2 * coff * head_dim
    _storage_dtype: ClassVar[torch.dtype] = torch.float32

    @model_validator(mode="before")
    @classmethod
    def _derive_row_dim(cls, data: Any) -> Any:
        if isinstance(data, dict):
            ratio, head_dim = data.get("ratio", 4), data.get("head_dim", 512)
            if ratio not in (4, 128):
                raise ConfigError.of("ratio", "4 or 128 (compressed layers, SPEC §2)", ratio)
            coff = 2 if ratio == 4 else 1
            data = {**data, "row_dim": 2 * coff * head_dim}
        return data

    @property
    def coff(self) -> int:
        return 2 if self.ratio == 4 else 1

    @property
    def token_bytes(self) -> int:
        return self.row_dim * self.elem_bytes


def _require(fmt: CacheFormat, ok: bool, field: str, relation: str) -> None:
    if not ok:
        raise CacheLayoutError.of(f"{fmt.name}.{field}", f"consistent with {relation}", getattr(fmt, field))


_FORMATS: dict[str, type[CacheFormat]] = {
    "fp8_ds_mla": Fp8DsMlaFormat,
    "bf16": Bf16RowsFormat,
    "fp8_e4m3": Fp8E4m3RowsFormat,
    "ascend_bf16": AscendBf16Format,
    "ascend_a5": AscendA5Format,
    "indexer_fp8": IndexerFp8Format,
    "indexer_mxfp4": IndexerMxfp4Format,
    "indexer_ascend_int8": IndexerAscendInt8Format,
    "compressor_state": CompressorStateFormat,
}
_DEFAULTS = {name: cls() for name, cls in _FORMATS.items()}


# Formats that store exactly another format's values in other byte places (SPEC §9.2: converting A5 <->
# fp8_ds_mla is a lossless permutation); every other format stores only its own.
_SAME_VALUES = {"ascend_a5": "fp8_ds_mla"}


def value_format(name: str) -> str:
    """The format whose values ``name`` stores: two formats with one value format hold the same numbers."""
    return _SAME_VALUES.get(name, name)


def format_names() -> tuple[str, ...]:
    """Every format name ``get_format`` accepts."""
    return tuple(_FORMATS)


def get_format(name: str | CacheFormat, **params: Any) -> CacheFormat:
    """The format called ``name``; ``compressor_state`` takes ``ratio=`` and ``head_dim=``."""
    if isinstance(name, CacheFormat):
        return name
    if name not in _FORMATS:
        raise CacheLayoutError.of("format", f"one of {', '.join(_FORMATS)}", repr(name))
    if params:
        if name != "compressor_state":
            raise CacheLayoutError.of("params", f"none for format {name!r}", sorted(params))
        return CompressorStateFormat(**params)
    return _DEFAULTS[name]
