"""dsv4: DeepSeek-V4 hybrid compressed attention, the same on every accelerator.

The public API is re-exported here as the modules land (see docs/ARCHITECTURE.md).
"""
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

__all__ = [
    "__version__",
    "DSV4Error",
    "DSV4ValueError",
    "DSV4TypeError",
    "ConfigError",
    "CacheLayoutError",
    "BackendUnavailableError",
    "NoBackendError",
]
