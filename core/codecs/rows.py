"""Codecs of the typed row formats (SPEC §9.2, §9.4).

- ``bf16``: ``[nb, B, 512]`` bf16 rows ``[448 nope | 64 roped]``.
- ``fp8_e4m3``: ``[nb, B, 512]`` e4m3 rows with one per-tensor scale (``scale`` attribute, 1.0 by
  default as in vLLM); stored ``clamp(x / scale, -448, 448)``.
- ``ascend_bf16``: Ascend A2/A3 ``[nb, B, 1, 512]`` bf16.
- ``compressor_state``: fp32 ``[nb, B, 2*coff*d]`` rows ``[kv | score + ape]``, stored exactly.
"""
from __future__ import annotations

import torch
from dsv4.codecs.base import RowsCodec
from dsv4.quant import FP8_E4M3_MAX
from dsv4.specs.errors import DSV4ValueError
from dsv4.specs.formats import CompressorStateFormat, get_format
from torch import Tensor

__all__ = ["AscendBf16Codec", "Bf16RowsCodec", "CompressorStateCodec", "Fp8E4m3RowsCodec"]


class Bf16RowsCodec(RowsCodec):
    """bf16 rows; write rounds to bf16 (round to nearest even), read widens to fp32."""

    def __init__(self) -> None:
        super().__init__(get_format("bf16"))


class AscendBf16Codec(RowsCodec):
    """Ascend A2/A3 bf16 ``[nb, B, 1, 512]``."""

    def __init__(self) -> None:
        super().__init__(get_format("ascend_bf16"))


class Fp8E4m3RowsCodec(RowsCodec):
    """e4m3 rows with one per-tensor ``scale`` (fp32, > 0); read returns ``e4m3 * scale``."""

    def __init__(self, scale: float = 1.0) -> None:
        if not scale > 0:
            raise DSV4ValueError.of("scale", "a positive number", scale)
        super().__init__(get_format("fp8_e4m3"))
        self.scale = float(scale)

    def _to_storage(self, rows: Tensor) -> Tensor:
        return (rows.float() / self.scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)

    def _from_storage(self, stored: Tensor) -> Tensor:
        return stored.float() * self.scale


class CompressorStateCodec(RowsCodec):
    """Compressor state rows (SPEC §9.4), fp32, exact; ``row_dim = 2 * coff * head_dim``."""

    format: CompressorStateFormat

    def __init__(self, ratio: int = 4, head_dim: int = 512) -> None:
        super().__init__(get_format("compressor_state", ratio=ratio, head_dim=head_dim))
