"""Codecs of the indexer key caches (d = 128), SPEC §9.3; they quantize on write (SPEC §6.6).

Every page is split: ``B`` value records first, then ``B`` scale records.

- ``indexer_fp8``: 128 e4m3 + fp32 scale ``2^ceil(log2(max(amax, 1e-4)/448))`` (vllm row).
- ``indexer_mxfp4``: 64 bytes of packed e2m1 (element 2i in the low nibble) + 4 UE8M0 bytes, one
  per 32 elements (deepseek row).
- ``indexer_ascend_int8``: 128 int8 + fp16 per-row scale (ascend row).
"""
from __future__ import annotations

import torch
from dsv4.codecs.base import ByteCodec, reinterpret
from dsv4.quant import (
    dequantize_fp4_blocks,
    dequantize_int8_rows,
    exponent_to_ue8m0,
    pack_nibbles,
    quantize_fp4_blocks,
    quantize_fp8_vector,
    quantize_int8_rows,
    ue8m0_to_exponent,
    unpack_nibbles,
)
from dsv4.specs.formats import IndexerAscendInt8Format, IndexerFp8Format, IndexerMxfp4Format, get_format
from torch import Tensor

__all__ = ["IndexerAscendInt8Codec", "IndexerFp8Codec", "IndexerMxfp4Codec"]


def _sections(name: str) -> tuple[tuple[str, int], ...]:
    fmt = get_format(name)
    return (("values", fmt.value_bytes), ("scales", fmt.scale_bytes))


class IndexerFp8Codec(ByteCodec):
    """Fields: ``values`` e4m3 ``[..., 128]``, ``scale`` fp32 ``[...]`` (a power of two)."""

    format: IndexerFp8Format
    sections = _sections("indexer_fp8")
    row_elements = (("e4m3", get_format("indexer_fp8").row_dim),)

    def __init__(self) -> None:
        super().__init__(get_format("indexer_fp8"))

    def encode(self, rows: Tensor) -> list[Tensor]:
        values, scale = quantize_fp8_vector(rows)
        return self.from_fields({"values": values, "scale": scale})

    def decode(self, sections: list[Tensor]) -> Tensor:
        fields = self.to_fields(sections)
        return fields["values"].float() * fields["scale"].unsqueeze(-1)

    def to_fields(self, sections: list[Tensor]) -> dict[str, Tensor]:
        values, scales = sections
        return {"values": reinterpret(values, torch.float8_e4m3fn),
                "scale": reinterpret(scales, torch.float32).squeeze(-1)}

    def from_fields(self, fields: dict[str, Tensor]) -> list[Tensor]:
        scale = fields["scale"].to(torch.float32).unsqueeze(-1)
        return [reinterpret(fields["values"], torch.uint8), reinterpret(scale, torch.uint8)]


class IndexerMxfp4Codec(ByteCodec):
    """Fields: ``codes`` uint8 ``[..., 128]`` (0..15, sign << 3 | e2m1), ``scale`` UE8M0 uint8 ``[..., 4]``."""

    format: IndexerMxfp4Format
    sections = _sections("indexer_mxfp4")
    row_elements = (("e2m1", get_format("indexer_mxfp4").row_dim),)

    def __init__(self) -> None:
        super().__init__(get_format("indexer_mxfp4"))

    def encode(self, rows: Tensor) -> list[Tensor]:
        codes, exponent = quantize_fp4_blocks(rows, self.format.quant_block)
        return self.from_fields({"codes": codes, "scale": exponent_to_ue8m0(exponent)})

    def decode(self, sections: list[Tensor]) -> Tensor:
        fields = self.to_fields(sections)
        return dequantize_fp4_blocks(fields["codes"], ue8m0_to_exponent(fields["scale"]), self.format.quant_block)

    def to_fields(self, sections: list[Tensor]) -> dict[str, Tensor]:
        packed, scales = sections
        return {"codes": unpack_nibbles(packed), "scale": scales.contiguous()}

    def from_fields(self, fields: dict[str, Tensor]) -> list[Tensor]:
        return [pack_nibbles(fields["codes"]), fields["scale"].to(torch.uint8)]


class IndexerAscendInt8Codec(ByteCodec):
    """Fields: ``values`` int8 ``[..., 128]``, ``scale`` fp16 ``[...]``."""

    format: IndexerAscendInt8Format
    sections = _sections("indexer_ascend_int8")
    row_elements = (("int8", get_format("indexer_ascend_int8").row_dim),)

    def __init__(self) -> None:
        super().__init__(get_format("indexer_ascend_int8"))

    def encode(self, rows: Tensor) -> list[Tensor]:
        values, scale = quantize_int8_rows(rows)
        return self.from_fields({"values": values, "scale": scale})

    def decode(self, sections: list[Tensor]) -> Tensor:
        fields = self.to_fields(sections)
        return dequantize_int8_rows(fields["values"], fields["scale"])

    def to_fields(self, sections: list[Tensor]) -> dict[str, Tensor]:
        values, scales = sections
        return {"values": reinterpret(values, torch.int8), "scale": reinterpret(scales, torch.float16).squeeze(-1)}

    def from_fields(self, fields: dict[str, Tensor]) -> list[Tensor]:
        scale = fields["scale"].to(torch.float16).unsqueeze(-1)
        return [reinterpret(fields["values"], torch.uint8), reinterpret(scale, torch.uint8)]
