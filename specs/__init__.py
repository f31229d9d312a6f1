"""dsv4.specs: what things ARE (configs, layer kinds, numerics profiles, cache formats, geometry, planner).

Pure data and arithmetic; no kernels. Everything public is re-exported here.
"""
from dsv4.specs.config import ModelConfig, RopeScaling, preset_names
from dsv4.specs.errors import (
    BackendUnavailableError,
    CacheLayoutError,
    ConfigError,
    DSV4Error,
    DSV4TypeError,
    DSV4ValueError,
    NoBackendError,
)
from dsv4.specs.formats import (
    PLAIN_MLA_ALIGNMENT,
    AscendA5Format,
    AscendBf16Format,
    Bf16RowsFormat,
    CacheFormat,
    CompressorStateFormat,
    Fp8DsMlaFormat,
    Fp8E4m3RowsFormat,
    IndexerAscendInt8Format,
    IndexerFp8Format,
    IndexerMxfp4Format,
    format_names,
    get_format,
    round_up,
)
from dsv4.specs.geometry import CacheGeometry, CacheGroup, cache_geometry, geometry_names
from dsv4.specs.layer_kinds import LayerKind
from dsv4.specs.numerics import DEFAULT_PROFILE, NumericsProfile, get_profile, profile_names
from dsv4.specs.planner import (
    kind_bytes_per_token,
    layer_bytes,
    max_tokens,
    model_bytes_per_token,
    plan_report,
    request_bytes,
)

__all__ = [
    "DEFAULT_PROFILE",
    "PLAIN_MLA_ALIGNMENT",
    "AscendA5Format",
    "AscendBf16Format",
    "BackendUnavailableError",
    "Bf16RowsFormat",
    "CacheFormat",
    "CacheGeometry",
    "CacheGroup",
    "CacheLayoutError",
    "CompressorStateFormat",
    "ConfigError",
    "DSV4Error",
    "DSV4TypeError",
    "DSV4ValueError",
    "Fp8DsMlaFormat",
    "Fp8E4m3RowsFormat",
    "IndexerAscendInt8Format",
    "IndexerFp8Format",
    "IndexerMxfp4Format",
    "LayerKind",
    "ModelConfig",
    "NoBackendError",
    "NumericsProfile",
    "RopeScaling",
    "cache_geometry",
    "format_names",
    "geometry_names",
    "get_format",
    "get_profile",
    "kind_bytes_per_token",
    "layer_bytes",
    "max_tokens",
    "model_bytes_per_token",
    "plan_report",
    "preset_names",
    "profile_names",
    "request_bytes",
    "round_up",
]
