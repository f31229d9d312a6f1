"""dsv4.codecs: per cache format, the code that writes and reads its bytes (SPEC §9).

``get_codec(name)`` returns the codec of a format of :mod:`dsv4.specs.formats`. Every codec has
``allocate``, ``block_size_of``, ``write_rows`` and ``read_rows``; byte formats add
``unpack_page`` / ``pack_page`` (named typed fields <-> page bytes, byte exact).
"""
from __future__ import annotations

from typing import Any

from dsv4.codecs.base import ByteCodec, Codec, RowsCodec, check_slots
from dsv4.codecs.indexer import IndexerAscendInt8Codec, IndexerFp8Codec, IndexerMxfp4Codec
from dsv4.codecs.latent import AscendA5Codec, Fp8DsMlaCodec, a5_to_fp8_ds_mla, fp8_ds_mla_to_a5
from dsv4.codecs.rows import AscendBf16Codec, Bf16RowsCodec, CompressorStateCodec, Fp8E4m3RowsCodec
from dsv4.specs.errors import CacheLayoutError
from dsv4.specs.formats import CacheFormat, format_names

__all__ = [
    "AscendA5Codec",
    "AscendBf16Codec",
    "Bf16RowsCodec",
    "ByteCodec",
    "Codec",
    "CompressorStateCodec",
    "Fp8DsMlaCodec",
    "Fp8E4m3RowsCodec",
    "IndexerAscendInt8Codec",
    "IndexerFp8Codec",
    "IndexerMxfp4Codec",
    "RowsCodec",
    "a5_to_fp8_ds_mla",
    "check_slots",
    "fp8_ds_mla_to_a5",
    "get_codec",
]

_CODECS: dict[str, type[Codec]] = {
    "fp8_ds_mla": Fp8DsMlaCodec,
    "bf16": Bf16RowsCodec,
    "fp8_e4m3": Fp8E4m3RowsCodec,
    "ascend_bf16": AscendBf16Codec,
    "ascend_a5": AscendA5Codec,
    "indexer_fp8": IndexerFp8Codec,
    "indexer_mxfp4": IndexerMxfp4Codec,
    "indexer_ascend_int8": IndexerAscendInt8Codec,
    "compressor_state": CompressorStateCodec,
}
assert set(_CODECS) == set(format_names()), "every format of dsv4.specs.formats has a codec"


def get_codec(format_name: str | CacheFormat, **params: Any) -> Codec:
    """Codec of ``format_name``; ``fp8_e4m3`` takes ``scale=``, ``compressor_state`` ``ratio=``, ``head_dim=``."""
    name = format_name.name if isinstance(format_name, CacheFormat) else format_name
    if name not in _CODECS:
        raise CacheLayoutError.of("format_name", f"one of {', '.join(_CODECS)}", repr(format_name))
    if isinstance(format_name, CacheFormat) and name == "compressor_state" and not params:
        params = {"ratio": format_name.ratio, "head_dim": format_name.head_dim}
    return _CODECS[name](**params)
