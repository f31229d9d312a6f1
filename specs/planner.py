"""Memory planner: cache bytes of a model, per token, per request and per budget (docs/memory.md).

Everything follows from :mod:`dsv4.specs.geometry`: a layer holds, in every cache group it belongs
to, ``group.pages_for(N)`` pages of ``group.page_bytes`` (padding included). Growing groups
(compressed KV, indexer keys) cost ``page_bytes / raw_tokens_per_page`` per raw token; window
groups (SWA, compressor state) cost a bounded number of pages however long the request is, bounded
by the window plus the tokens of the request's latest step (``step_tokens``: 1 for a decode; size a
pool with the engine's most tokens a step, as vLLM does with ``max_num_batched_tokens``).
"""
from __future__ import annotations

from typing import Any

from dsv4.specs.config import ModelConfig
from dsv4.specs.errors import ConfigError
from dsv4.specs.geometry import CacheGeometry, CacheGroup, cache_geometry
from dsv4.specs.layer_kinds import LayerKind

__all__ = [
    "kind_bytes_per_token",
    "layer_bytes",
    "max_tokens",
    "model_bytes_per_token",
    "plan_report",
    "request_bytes",
]

GIB = 1 << 30


def _geometry(cfg: ModelConfig, profile: str, geometry: str | CacheGeometry, include_mtp: bool) -> CacheGeometry:
    if isinstance(geometry, CacheGeometry):
        return geometry
    return cache_geometry(cfg, profile, geometry, include_mtp=include_mtp)


def _check_tokens(num_tokens: int, argument: str = "num_tokens") -> int:
    if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 0:
        raise ConfigError.of(argument, "a non-negative integer", num_tokens)
    return num_tokens


def _check_step_tokens(step_tokens: int) -> int:
    if not isinstance(step_tokens, int) or isinstance(step_tokens, bool) or step_tokens < 1:
        raise ConfigError.of("step_tokens", "a positive integer (tokens of a step)", step_tokens)
    return step_tokens


def _payload_bytes(group: CacheGroup, num_tokens: int) -> int:
    """Bytes of one layer of ``group`` that hold data (no page padding, no empty slots)."""
    if group.window is None:
        return (num_tokens // group.ratio) * group.token_bytes
    return min(num_tokens, group.window) * group.token_bytes


def layer_bytes(geo: CacheGeometry, layer_id: int, num_tokens: int, step_tokens: int = 1) -> int:
    """Bytes of one layer for one request of ``num_tokens`` raw tokens (every group of the layer);
    ``step_tokens``: tokens of its latest step (``CacheGroup.pages_for``)."""
    return sum(g.pages_for(num_tokens, step_tokens) * g.page_bytes for g in geo.groups_of_layer(layer_id))


def kind_bytes_per_token(cfg: ModelConfig, profile: str = "deepseek", geometry: str | CacheGeometry = "vllm",
                         *, padded: bool = True) -> dict[LayerKind, float]:
    """Asymptotic cache bytes per raw token of ONE layer of each kind (growing groups only).

    ``geometry``: a name, or a built :class:`CacheGeometry` (used as is: its formats, its profile).
    ``padded``: page bytes (what is allocated); otherwise the stored entries' bytes.
    SWA-only layers cost 0: their window is a constant (see :func:`request_bytes`).
    """
    geo = _geometry(cfg, profile, geometry, include_mtp=True)
    result = {kind: 0.0 for kind in LayerKind}
    for kind in LayerKind:
        ids = cfg.layer_ids(kind)
        if not ids:
            continue
        for group in geo.groups_of_layer(ids[0]):
            if group.window is None:
                result[kind] += (group.page_bytes / group.raw_tokens_per_page if padded
                                 else group.token_bytes / group.ratio)
    return result


def model_bytes_per_token(cfg: ModelConfig, profile: str = "deepseek", geometry: str | CacheGeometry = "vllm",
                          *, include_mtp: bool = True, padded: bool = True) -> float:
    """Asymptotic cache bytes per raw token of the whole model (every layer)."""
    per_kind = kind_bytes_per_token(cfg, profile, geometry, padded=padded)
    counts = cfg.layer_kind_counts(include_mtp)
    return sum(per_kind[kind] * counts[kind] for kind in LayerKind)


def request_bytes(cfg: ModelConfig, num_tokens: int, profile: str = "deepseek",
                  geometry: str | CacheGeometry = "vllm", *, include_mtp: bool = True, step_tokens: int = 1) -> int:
    """Total cache bytes of one request of ``num_tokens`` raw tokens: every group of every layer,
    page padding, the SWA window and the compressor state included; ``step_tokens``: tokens of the
    request's latest step (1: decode; the window groups hold the pages of a whole step until the next
    plan, ``CacheGroup.pages_for``)."""
    geo = _geometry(cfg, profile, geometry, include_mtp)
    _check_tokens(num_tokens)
    _check_step_tokens(step_tokens)
    return sum(g.bytes_for(num_tokens, step_tokens) for g in geo.groups)


def max_tokens(cfg: ModelConfig, budget_bytes: int, profile: str = "deepseek",
               geometry: str | CacheGeometry = "vllm", *, include_mtp: bool = True, limit: int | None = None,
               step_tokens: int = 1) -> int:
    """Largest ``N <= limit`` (default ``max_position_embeddings``) with ``request_bytes(N, step_tokens)
    <= budget``.

    ``request_bytes`` never decreases with N, so a binary search is exact. 0 if not even one token fits.
    """
    _check_tokens(budget_bytes, "budget_bytes")
    geo = _geometry(cfg, profile, geometry, include_mtp)
    high = cfg.max_position_embeddings if limit is None else _check_tokens(limit, "limit")
    if request_bytes(cfg, high, geometry=geo, step_tokens=step_tokens) <= budget_bytes:
        return high
    low = 0  # invariant: request_bytes(low) <= budget < request_bytes(high)
    while high - low > 1:
        middle = (low + high) // 2
        if request_bytes(cfg, middle, geometry=geo, step_tokens=step_tokens) <= budget_bytes:
            low = middle
        else:
            high = middle
    return low


def plan_report(cfg: ModelConfig, num_tokens: int, profile: str = "deepseek",
                geometry: str | CacheGeometry = "vllm", *, include_mtp: bool = True,
                step_tokens: int = 1) -> dict[str, Any]:
    """JSON-ready plan of one request of ``num_tokens`` whose latest step added ``step_tokens``: per layer
    kind, per group, totals.

    A :class:`CacheGeometry` ``geometry`` is used as is for every figure (``profile`` is then ignored).
    """
    _check_tokens(num_tokens)
    _check_step_tokens(step_tokens)
    geo = _geometry(cfg, profile, geometry, include_mtp)
    counts = cfg.layer_kind_counts(include_mtp)
    per_token = kind_bytes_per_token(cfg, geometry=geo)
    per_token_payload = kind_bytes_per_token(cfg, geometry=geo, padded=False)
    kinds = {}
    for kind in LayerKind:
        ids = cfg.layer_ids(kind, include_mtp)
        kinds[kind.value] = {
            "ratio": kind.ratio, "count": counts[kind], "layer_ids": list(ids),
            "bytes_per_token_per_layer": per_token[kind],
            "payload_bytes_per_token_per_layer": per_token_payload[kind],
            "bytes": sum(layer_bytes(geo, i, num_tokens, step_tokens) for i in ids),
        }
    groups = []
    for group in geo.groups:
        pages = group.pages_for(num_tokens, step_tokens)
        groups.append({**group.summary(), "pages_per_layer": pages, "pages": pages * group.num_layers,
                       "bytes": group.bytes_for(num_tokens, step_tokens),
                       "payload_bytes": _payload_bytes(group, num_tokens) * group.num_layers})
    total = sum(g["bytes"] for g in groups)
    payload = sum(g["payload_bytes"] for g in groups)
    return {
        "model": {"hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_hidden_layers,
                  "num_layers_counted": cfg.num_layers_total if include_mtp else cfg.num_hidden_layers,
                  "include_mtp": include_mtp, "sliding_window": cfg.sliding_window},
        "profile": geo.profile, "geometry": geo.name, "kv_format": geo.kv_format,
        "indexer_key_format": geo.indexer_key_format, "block_size": geo.block_size,
        "num_tokens": num_tokens,
        "step_tokens": step_tokens,
        "layer_kinds": kinds,
        "groups": groups,
        "totals": {
            "pages": sum(g["pages"] for g in groups),
            "bytes": total,
            "gib": total / GIB,
            "payload_bytes": payload,
            "padding_bytes": total - payload,
            "bytes_per_token": total / num_tokens if num_tokens else None,
            "asymptotic_bytes_per_token": model_bytes_per_token(cfg, geometry=geo, include_mtp=include_mtp),
        },
    }
