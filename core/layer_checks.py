"""What ``Attention`` checks before it writes a cache byte (SPEC §12), kept apart from the forward.

Every check here raises a :class:`~dsv4.specs.errors.DSV4Error` naming the argument, what was
expected and what came, and runs before the first write of a forward: a rejected call leaves every
cache byte as it was. Backend choices are checked twice: names against the registry when the layer
is built (here), and every op's selection for the step's actual request before the first write (the
selections are memoized, ``dsv4.layer_dispatch``).
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

import torch
from dsv4.backend import Backend
from dsv4.cache import LayerCache, PagedKVCache, Step
from dsv4.registry import get_registry
from dsv4.specs.errors import CacheLayoutError, DSV4TypeError, DSV4ValueError

if TYPE_CHECKING:
    from dsv4.layer import Attention

__all__ = ["check_cache_matches", "check_parameters", "check_step", "row_range", "validate_backends"]


def validate_backends(backends: object, op_names: tuple[str, ...]) -> dict[str, str | Backend]:
    """``{op: backend}`` for every op from ``Attention``'s ``backends`` argument.

    backends: None / ``"auto"``, a registered backend name or a :class:`~dsv4.backend.Backend` for every
    op, or a mapping ``{op_name: name or Backend}`` (missing ops: ``"auto"``). Unknown op keys and names
    that no registered backend has are refused here, when the layer is built."""
    if backends is None or isinstance(backends, (str, Backend)):
        chosen = dict.fromkeys(op_names, backends or "auto")
    elif isinstance(backends, Mapping):
        unknown = sorted(set(backends) - set(op_names), key=str)
        if unknown:
            raise DSV4ValueError.of("backends", f"keys among {op_names}", unknown)
        chosen = {op: backends.get(op, "auto") for op in op_names}
    else:
        raise DSV4TypeError.of("backends", "None, a backend name, a dsv4.Backend or {op_name: backend}",
                               f"{type(backends).__name__} {backends!r}"[:120])
    registry = get_registry()
    for op, backend in chosen.items():
        where = "backends" if isinstance(backends, (str, Backend)) else f"backends[{op!r}]"
        if isinstance(backend, Backend):
            continue
        if not isinstance(backend, str):
            raise DSV4TypeError.of(where, "a backend name (str) or a dsv4.Backend", type(backend).__name__)
        if backend in ("", "auto"):
            continue
        if backend not in registry.backend_names():
            raise DSV4ValueError.of(where, f"'auto' or a registered backend ({', '.join(registry.backend_names())})",
                                    repr(backend), hint=registry.failed_plugins_hint())
        implemented = registry.get(backend).capabilities.ops
        if op not in implemented:  # said now, not as the probe's reason at the first forward
            raise DSV4ValueError.of(where, f"a backend that implements {op}",
                                    f"{backend!r}, which implements {', '.join(sorted(implemented))}",
                                    hint=f"name it for the ops it implements: backends={{{min(implemented)!r}: "
                                    f"{backend!r}}} (the rest 'auto')")
    return chosen


def check_step(step: object) -> PagedKVCache:
    """``step`` must be a :class:`~dsv4.cache.Step` that is still the latest plan of its requests."""
    if not isinstance(step, Step):
        raise DSV4TypeError.of("step", "a dsv4.cache.Step from PagedKVCache.plan_step", type(step).__name__)
    step.cache.check_step(step)
    return step.cache


def row_range(rows: object, num_tokens: int) -> tuple[int, int]:
    """``Attention.forward``'s ``rows``: None (every token) or a contiguous slice of the step's ``num_tokens``
    tokens with int (or None) bounds -> ``(lo, hi)``, ``0 <= lo <= hi <= num_tokens``; checked before the forward
    marks anything."""
    if rows is None:
        return 0, num_tokens
    if isinstance(rows, slice) and rows.step in (None, 1):
        try:
            lo, hi, _ = rows.indices(num_tokens)
        except TypeError:  # bounds that are not ints (slice.indices names no argument)
            pass
        else:
            return lo, max(lo, hi)
    raise DSV4ValueError.of("rows", "None or a contiguous slice of the step's tokens, with int bounds", rows)


def check_cache_matches(attn: Attention, cache: PagedKVCache) -> LayerCache:
    """The cache was built for a config that agrees with the layer's: profile, layer kind, window, positions
    (the cache's bound no larger than the layer's RoPE table), and for a CSA layer the indexer's top-k (the
    step's ``topk_lens`` are built from the cache's). Returns the layer's storage: the forward's one look-up
    of its layer id in the cache."""
    cache.check_profile(attn.profile)
    lc = cache.layers.get(attn.layer_id)
    if lc is None:
        raise DSV4ValueError.of("step", f"a step of a cache serving layer {attn.layer_id} (this layer)",
                                f"a step of a cache serving layers {cache.layer_ids}",
                                hint="build the PagedKVCache with every layer id that runs its steps")
    if lc.kind != attn.kind:
        raise CacheLayoutError.of(
            f"step.cache layer {attn.layer_id}",
            f"a {attn.kind.name} layer (compress ratio {attn.kind.ratio}), as the layer's config says",
            f"{lc.kind.name} (ratio {lc.kind.ratio}) in the cache's config",
            hint="build the cache and the layer from the same ModelConfig")
    if cache.window != attn.cfg.sliding_window:
        raise CacheLayoutError.of("step.cache sliding_window", f"{attn.cfg.sliding_window} (the layer's config)",
                                  cache.window, hint="build the cache and the layer from the same ModelConfig")
    if cache.cfg.max_position_embeddings > attn.cfg.max_position_embeddings:  # plan_step bounds positions by it
        raise CacheLayoutError.of("step.cache max_position_embeddings",
                                  f"at most {attn.cfg.max_position_embeddings} (the layer's RoPE table rows)",
                                  cache.cfg.max_position_embeddings,
                                  hint="build the cache and the layer from the same ModelConfig")
    if attn.indexer is not None and cache.cfg.index_topk != attn.cfg.index_topk:  # sizes RatioMetadata.topk_lens
        raise CacheLayoutError.of("step.cache index_topk", f"{attn.cfg.index_topk} (the layer's config)",
                                  cache.cfg.index_topk, hint="build the cache and the layer from the same ModelConfig")
    return lc


def _parameter_tensors(attn: Attention) -> Iterator[tuple[str, torch.Tensor, bool]]:
    """Every tensor of the layer -> (name, tensor, kept fp32): SPEC keeps the sink, norm weights, compressor
    weights and APE and the RoPE table in fp32 whatever the activations (SPEC §3-§5, §7); the projections
    take the activations' dtype. The parameters are found once (a name walk costs ~20 µs a forward) and
    kept as module paths; each is looked up through ``_modules`` every call, so a cast, a replaced parameter,
    a ``.data`` swap or a replaced submodule shows. A path that no longer resolves (a submodule swapped for one
    of another shape) triggers one fresh walk."""
    for fresh in (False, True):
        if fresh or attn._parameter_slots is None:
            slots = []
            for name, _ in attn.named_parameters():
                fp32 = name == "attn_sink" or name.endswith("norm.weight") or "compressor." in name
                owner, _, attr = name.rpartition(".")
                slots.append((name, tuple(owner.split(".")) if owner else (), attr, fp32))
            attn._parameter_slots = slots
        found = _resolve_slots(attn, attn._parameter_slots)
        if found is not None:
            break
    yield from found
    yield "cos_sin (RoPE table buffer)", attn.cos_sin, True


def _resolve_slots(attn: Attention, slots: list) -> list[tuple[str, torch.Tensor]] | None:
    """``slots`` looked up from ``attn`` through ``_modules`` / ``_parameters``; None where a path is gone."""
    out = []
    for name, path, attr, fp32 in slots:
        module = attn
        for part in path:
            module = module._modules.get(part)
            if module is None:
                return None
        t = module._parameters.get(attr)
        if t is None:
            return None
        out.append((name, t, fp32))
    return out


def check_parameters(attn: Attention, x: torch.Tensor) -> None:
    """Every parameter on x's device; fp32 parameters still fp32 (float64 allowed for the float64 ideal):
    ``attn.to(torch.bfloat16)`` or ``.half()`` casts them too; the projections in x's dtype. Otherwise an op
    would fail later (after the first cache write) with torch's own error, naming no parameter."""
    dtype, where = x.dtype, x.device
    allowed = (torch.float32, torch.float64) if dtype == torch.float64 else (torch.float32,)
    bad, act, device = [], None, None
    for name, t, fp32 in _parameter_tensors(attn):
        if fp32:
            if t.dtype not in allowed:
                bad.append((name, t.dtype))
        elif t.dtype != dtype and act is None:
            act = (name, t.dtype)
        if device is None and t.device != where:
            device = (name, t.device)
    if bad:
        also = f"{', '.join(n for n, _ in bad[1:])} were cast too; " if len(bad) > 1 else ""
        raise DSV4TypeError.of(
            f"layer parameter {bad[0][0]}", "dtype torch.float32 (SPEC §3-§5: kept fp32 for bf16 input)", bad[0][1],
            hint=f"{also}Attention.to(dtype) / .half() / .bfloat16() casts every floating parameter: build the "
            "layer in its own dtypes and cast the input x (load bf16 weights with load_state_dict), not the layer")
    if act is not None:
        raise DSV4TypeError.of(f"layer parameter {act[0]}", f"dtype {dtype} (x's: the projections run in it)",
                               act[1], hint="load the projection weights in the activations' dtype")
    if device is not None:
        raise DSV4ValueError.of(f"layer parameter {device[0]}", f"device {where} (x's and the cache's)", device[1],
                                hint="move the layer with attn.to(device) (it keeps each parameter's dtype)")
