"""dsv4: DeepSeek-V4 hybrid compressed attention, the same on every accelerator.

Public API (docs/ARCHITECTURE.md)::

    cfg = dsv4.ModelConfig.preset("v4-flash")          # or ModelConfig.from_hf_config(config_json)
    attn = dsv4.Attention(cfg, layer_id=2)              # official parameter names
    cache = dsv4.PagedKVCache(cfg, [2], num_blocks=1024)
    step = cache.plan_step([dsv4.StepRequest("r0", 300)])
    y = attn(x, step)

Names are resolved lazily so that ``import dsv4`` stays light and free of import cycles.
"""
from __future__ import annotations

import importlib
from typing import Any

from dsv4.specs.errors import (
    BackendUnavailableError,
    CacheLayoutError,
    ConfigError,
    DSV4Error,
    DSV4TypeError,
    DSV4ValueError,
    NoBackendError,
)

__version__ = "0.1.0"

_LAZY = {
    "ModelConfig": "dsv4.specs.config",
    "RopeScaling": "dsv4.specs.config",
    "LayerKind": "dsv4.specs.layer_kinds",
    "NumericsProfile": "dsv4.specs.numerics",
    "get_profile": "dsv4.specs.numerics",
    "get_format": "dsv4.specs.formats",
    "Attention": "dsv4.layer",
    "PagedKVCache": "dsv4.cache",
    "StepRequest": "dsv4.cache",
    "Step": "dsv4.cache",
    "OutOfBlocksError": "dsv4.cache",
    "StaleStepError": "dsv4.cache",
    "StepMetadata": "dsv4.metadata",
    "get_codec": "dsv4.codecs",
}

__all__ = [
    "Attention",
    "BackendUnavailableError",
    "CacheLayoutError",
    "ConfigError",
    "DSV4Error",
    "DSV4TypeError",
    "DSV4ValueError",
    "LayerKind",
    "ModelConfig",
    "NoBackendError",
    "NumericsProfile",
    "OutOfBlocksError",
    "PagedKVCache",
    "RopeScaling",
    "StaleStepError",
    "Step",
    "StepMetadata",
    "StepRequest",
    "__version__",
    "get_codec",
    "get_format",
    "get_profile",
]
assert set(__all__) >= set(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'dsv4' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
