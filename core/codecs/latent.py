"""Codecs of the 512-d latent caches: ``fp8_ds_mla`` and ``ascend_a5`` (bytes), plus the lossless
converters between them (SPEC §9.1, §9.2).

Both formats hold the same three fields a token: ``nope`` (448 e4m3, quantized per 64 with UE8M0
scales ``amax = max(|x|, 1e-4)``, ``e = ceil(log2(amax/448))``), ``rope`` (64 bf16, the roped
dims as given) and ``scale`` (7 UE8M0 bytes ``e + 127``). Only their placement differs, so a
conversion is a byte permutation.
"""
from __future__ import annotations

import torch
from dsv4.codecs.base import ByteCodec, reinterpret
from dsv4.quant import dequantize_fp8_blocks, exponent_to_ue8m0, quantize_fp8_blocks, ue8m0_to_exponent
from dsv4.specs.errors import CacheLayoutError
from dsv4.specs.formats import AscendA5Format, Fp8DsMlaFormat, get_format
from torch import Tensor

__all__ = ["AscendA5Codec", "Fp8DsMlaCodec", "a5_to_fp8_ds_mla", "fp8_ds_mla_to_a5"]


class _LatentByteCodec(ByteCodec):
    """Shared quantization of the latent byte formats; subclasses place the fields."""

    format: Fp8DsMlaFormat | AscendA5Format
    # read_rows returns [nope | rope]: e4m3 (block-scaled) then bf16, in both placements
    row_elements = (("e4m3", get_format("fp8_ds_mla").nope_dim), ("bf16", get_format("fp8_ds_mla").rope_dim))

    def _quantize(self, rows: Tensor) -> dict[str, Tensor]:
        """rows ``[N, 512]`` float -> fields nope e4m3 ``[N,448]``, rope bf16 ``[N,64]``, scale uint8 ``[N,7]``."""
        fmt = get_format("fp8_ds_mla")
        values, exponent = quantize_fp8_blocks(rows[:, : fmt.nope_dim], fmt.quant_block)
        return {"nope": values, "rope": rows[:, fmt.nope_dim:].to(torch.bfloat16), "scale": exponent_to_ue8m0(exponent)}

    def _dequantize(self, fields: dict[str, Tensor]) -> Tensor:
        """Fields -> fp32 ``[..., 512]``: ``e4m3 * 2^(byte - 127)`` then the rope dims."""
        block = get_format("fp8_ds_mla").quant_block
        nope = dequantize_fp8_blocks(fields["nope"], ue8m0_to_exponent(fields["scale"]), block)
        return torch.cat([nope, fields["rope"].float()], dim=-1)

    def encode(self, rows: Tensor) -> list[Tensor]:
        return self.from_fields(self._quantize(rows))

    def decode(self, sections: list[Tensor]) -> Tensor:
        return self._dequantize(self.to_fields(sections))


class Fp8DsMlaCodec(_LatentByteCodec):
    """SPEC §9.1 page: ``[B x data_bytes][B x scale_row_bytes][tail padding]``; storage uint8 ``[nb, stride]``.

    A token's data is the e4m3 nope bytes then the little-endian bf16 rope dims; its scale row is one
    UE8M0 byte per nope block of 64 then one pad byte, written 0. The page tail past ``B * token_bytes``
    is never touched. (Sizes: ``dsv4.specs.formats.get_format("fp8_ds_mla")``.)
    """

    format: Fp8DsMlaFormat
    sections = (("data", get_format("fp8_ds_mla").data_bytes), ("scales", get_format("fp8_ds_mla").scale_row_bytes))

    def __init__(self) -> None:
        super().__init__(get_format("fp8_ds_mla"))

    def to_fields(self, sections: list[Tensor]) -> dict[str, Tensor]:
        data, scales = sections
        nope_bytes = self.format.nope_bytes
        return {
            "nope": reinterpret(data[..., :nope_bytes], torch.float8_e4m3fn),
            "rope": reinterpret(data[..., nope_bytes:], torch.bfloat16),
            "scale": scales[..., : self.format.scale_bytes].contiguous(),
        }

    def from_fields(self, fields: dict[str, Tensor]) -> list[Tensor]:
        nope, rope, scale = _check_fields(fields)
        pad = torch.zeros((*scale.shape[:-1], self.format.scale_pad_bytes), dtype=torch.uint8, device=scale.device)
        data = torch.cat([reinterpret(nope, torch.uint8), reinterpret(rope, torch.uint8)], dim=-1)
        return [data, torch.cat([scale, pad], dim=-1)]


class AscendA5Codec(_LatentByteCodec):
    """SPEC §9.2 A5 records: ``B x [bf16 rope | e4m3 nope | UE8M0 scales | pad]`` of ``record_bytes`` each
    (pad written 0; sizes in ``dsv4.specs.formats.get_format("ascend_a5")``)."""

    format: AscendA5Format
    sections = (("records", get_format("ascend_a5").record_bytes),)

    def __init__(self) -> None:
        super().__init__(get_format("ascend_a5"))

    def to_fields(self, sections: list[Tensor]) -> dict[str, Tensor]:
        (records,) = sections
        f = self.format
        return {
            "nope": reinterpret(records[..., f.nope_offset: f.nope_offset + f.nope_bytes], torch.float8_e4m3fn),
            "rope": reinterpret(records[..., f.rope_offset: f.rope_offset + f.rope_bytes], torch.bfloat16),
            "scale": records[..., f.scale_offset: f.scale_offset + f.scale_bytes].contiguous(),
        }

    def from_fields(self, fields: dict[str, Tensor]) -> list[Tensor]:
        nope, rope, scale = _check_fields(fields)
        f = self.format
        records = torch.zeros((*scale.shape[:-1], f.record_bytes), dtype=torch.uint8, device=scale.device)
        records[..., f.rope_offset: f.rope_offset + f.rope_bytes] = reinterpret(rope, torch.uint8)
        records[..., f.nope_offset: f.nope_offset + f.nope_bytes] = reinterpret(nope, torch.uint8)
        records[..., f.scale_offset: f.scale_offset + f.scale_bytes] = scale
        return [records]


def _check_fields(fields: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    fmt = get_format("fp8_ds_mla")
    expected = {"nope": (torch.float8_e4m3fn, fmt.nope_dim), "rope": (torch.bfloat16, fmt.rope_dim),
                "scale": (torch.uint8, fmt.scale_bytes)}
    for name, (dtype, width) in expected.items():
        value = fields.get(name)
        if value is None or value.dtype != dtype or value.shape[-1] != width:
            got = None if value is None else f"{value.dtype} {tuple(value.shape)}"
            raise CacheLayoutError.of(f"fields[{name!r}]", f"{dtype} [..., {width}]", got)
    return fields["nope"], fields["rope"], fields["scale"]


def a5_to_fp8_ds_mla(a5_cache: Tensor, block_size: int | None = None, page_stride: int | None = None) -> Tensor:
    """Ascend A5 pages uint8 ``[nb, B*record_bytes]`` -> fp8_ds_mla pages uint8 ``[nb, page_stride]``, losslessly.

    Every nope, rope and scale byte moves unchanged; pad bytes become 0.
    """
    a5, fp8 = AscendA5Codec(), Fp8DsMlaCodec()
    block = a5.block_size_of(a5_cache) if block_size is None else block_size
    return fp8.pack_page(a5.unpack_page(a5_cache, block), block, page_stride)


def fp8_ds_mla_to_a5(fp8_cache: Tensor, block_size: int | None = None, page_stride: int | None = None) -> Tensor:
    """fp8_ds_mla pages uint8 ``[nb, stride]`` -> Ascend A5 pages uint8 ``[nb, B*record_bytes]``, losslessly."""
    a5, fp8 = AscendA5Codec(), Fp8DsMlaCodec()
    block = fp8.block_size_of(fp8_cache) if block_size is None else block_size
    return a5.pack_page(fp8.unpack_page(fp8_cache, block), block, page_stride)
