"""How ``Attention`` reaches its backends: every op selected once a configuration, before anything is
written, then called directly where nothing traces the forward.

The ``dsv4.ops`` boundary checks each call's arguments and then goes through the ``torch.ops.dsv4``
custom op, which selects a backend again. For the layer both are work done twice: its metadata comes
from ``plan_step`` (valid by construction), ``Attention._check`` has checked the rest, and
:func:`resolve_backends` has already selected every op's backend for this forward's requests. On an
accelerator that costs ~40-60% of an eager decode step's host time (``tools/host_overhead.py``).
:func:`direct_calls` says when the layer may skip both and call the selected backends itself:

* eager inference only: never with autograd on (the custom ops refuse a backward; the backends alone
  would give partial gradients), while ``torch.compile`` or ``torch.jit.trace`` traces, under a
  ``torch_dispatch`` mode (``make_fx``, fake tensors, functionalization) or autocast, or for tensor
  subclasses; these keep the opaque custom ops;
* never where the ops' value checks run (the CPU, or an accelerator with ``DSV4_VALIDATE=1`` /
  ``set_value_checks(True)``): those callers asked for every index to be range-checked.

The backend methods' own checks still run, and the results are the same either way (tests hold both
paths bit-equal).
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
from dsv4.backend import Backend
from dsv4.cache import PagedKVCache, Step
from dsv4.ops.dispatch import eager_untraced, record, recording, resolve
from dsv4.ops.library import request_fields
from dsv4.ops.validate import device_value_checks
from dsv4.registry import get_registry

if TYPE_CHECKING:
    from dsv4.layer import Attention

__all__ = ["DirectOps", "direct_calls", "resolve_backends"]

# The op calls of a forward, by role: compress_insert runs twice in a CSA layer, for the latent cache and
# for the indexer keys, and the two may select different backends.
INDEXER_KEYS = "indexer_keys"
_OP_OF_ROLE = {INDEXER_KEYS: "compress_insert"}
_MEMO_ENTRIES = 256  # selections a layer keeps (HCA widths grow by 64 entries: 128 at a 1M context)


def _meta(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def resolve_backends(attn: Attention, x: torch.Tensor, step: Step, attends: bool, capturing: bool) -> DirectOps:
    """The selected backend of every op call this forward makes, as :class:`DirectOps` (``chosen``:
    ``{role: backend}``, roles the op names and ``indexer_keys`` for the indexer's ``compress_insert``),
    selected before anything is written: a backend that cannot run
    (or a bad ``DSV4_BACKEND``) raises here.

    attends: the forward runs the indexer's scoring, attention and the output projection (a non-empty
    row range); otherwise only the cache writes run. capturing: a CUDA graph is being captured (the
    layer asks once a forward). The selection is made once per layer and key: the key holds every
    request field's source (device, capture, dtype, cache formats, rows, HCA width, the layer's
    profile and config), the registry's generation (a backend registered or removed), ``DSV4_BACKEND`` and
    the layer's ``backends`` (a ``Backend`` instance by identity: it need not be hashable). An unregistered
    instance's ``probe`` and ``not_supported_reasons`` are therefore asked once per key, not every forward.
    A later call inside ``record_selections`` still records the selection."""
    md, cache = step.metadata, step.cache
    hca_width = (md.ratios[attn.kind.ratio].hca_indices.shape[1]
                 if attends and attn.compressor is not None and attn.indexer is None else None)
    registry = get_registry()
    key = (x.device, capturing, x.dtype, cache.kv_format, cache.indexer_key_format, attends, hca_width,
           attn.profile,
           id(attn.cfg), registry.generation, os.environ.get("DSV4_BACKEND", ""),
           tuple((op, b if isinstance(b, str) else id(b)) for op, b in attn.backends.items()))
    memo = attn._selection_memo
    direct = memo.get(key)
    if direct is None:
        be = attn.backends
        direct = DirectOps({role: resolve(op, x.device, be[op], **fields)
                            for role, op, fields in _request_fields_of_forward(attn, x, cache, attends, hca_width)})
        if len(memo) >= _MEMO_ENTRIES:  # stale generations, many HCA widths: start over
            memo.clear()
        memo[key] = direct  # holds the instances keyed by id: their ids cannot be reused meanwhile
    elif recording():
        for role, impl in direct.chosen.items():
            record(_OP_OF_ROLE.get(role, role), impl)
    return direct


def _request_fields_of_forward(attn: Attention, x: torch.Tensor, cache: PagedKVCache, attends: bool,
                               hca_width: int | None) -> list[tuple[str, str, dict]]:
    """``(role, op, OpRequest fields)`` of every op call ``Attention.forward`` makes (meta tensors stand
    in). Field values mirror ``dsv4.ops.library.request_fields`` of the calls in ``Attention.forward``."""
    cfg = attn.cfg
    H, D, dtype, profile = cfg.num_attention_heads, cfg.head_dim, x.dtype, attn.profile
    calls: list[tuple[str, str, tuple, dict, dict | None]] = [
        ("qnorm_rope_insert", "qnorm_rope_insert", (_meta((0, H, D), dtype),),
         {"kv_format": cache.kv_format, "profile": profile}, None)]
    if attn.compressor is not None:
        calls.append(("compress_insert", "compress_insert", (), {"out_format": cache.kv_format, "profile": profile},
                      None))
    if attn.indexer is not None:
        key_format, idx = cache.indexer_key_format, attn.indexer
        calls.append((INDEXER_KEYS, "compress_insert", (), {"out_format": key_format, "profile": profile}, None))
        if attends:
            iq = _meta((0, idx.n_heads, idx.head_dim), dtype)
            calls.append(("indexer_q", "indexer_q", (iq,), {"profile": profile}, None))
            calls.append(("indexer_topk", "indexer_topk", (iq,), {"key_format": key_format, "topk": cfg.index_topk},
                          None))
    if attends:
        kind = attn.kind.compressed_list
        width = {"topk": cfg.index_topk, "dense": hca_width}.get(kind)
        extra = None if width is None else _meta((0, width), torch.int32)
        q = _meta((0, H, D), dtype)
        calls.append(("sparse_attention", "sparse_attention", (q, None, None, None, None, extra),
                      {"kv_format": cache.kv_format, "profile": profile}, {"extra_kind": kind}))
        calls.append(("output_projection", "output_projection", (q,), {}, None))
    return [(role, op, request_fields(op, args, kwargs, hints)) for role, op, args, kwargs, hints in calls]


def direct_calls(x: torch.Tensor) -> bool:
    """The layer may call its selected backends directly (module docstring): ``eager_untraced(x)`` (eager
    inference, no tracing, no autocast) and no value checks for ``x``'s device. Host checks only (no device
    query beyond a capture test)."""
    return eager_untraced(x) and not device_value_checks(x.device)


class DirectOps:
    """The ``dsv4.ops`` functions the layer calls, with their signatures, running the backends that
    :func:`resolve_backends` selected: no boundary checks, no custom op, no second selection.
    ``backend`` (already applied by the selection) and ``extra_kind`` (a selection hint) are ignored."""

    def __init__(self, chosen: dict[str, Backend]):
        self.chosen = chosen

    def qnorm_rope_insert(self, *args: Any, backend: Any = None, **kwargs: Any) -> torch.Tensor:
        return self.chosen["qnorm_rope_insert"].qnorm_rope_insert(*args, **kwargs)

    def compress_insert(self, *args: Any, backend: Any = None, **kwargs: Any) -> None:
        role = INDEXER_KEYS if kwargs["out_format"].startswith("indexer_") else "compress_insert"
        self.chosen[role].compress_insert(*args, **kwargs)

    def indexer_q(self, *args: Any, backend: Any = None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self.chosen["indexer_q"].indexer_q(*args, **kwargs)

    def indexer_topk(self, *args: Any, backend: Any = None, **kwargs: Any) -> torch.Tensor:
        return self.chosen["indexer_topk"].indexer_topk(*args, **kwargs)

    def indexer_topk_slots(self, *args: Any, backend: Any = None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self.chosen["indexer_topk"].indexer_topk_slots(*args, **kwargs)

    def sparse_attention(self, *args: Any, backend: Any = None, extra_kind: str = "unknown",
                         **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self.chosen["sparse_attention"].sparse_attention(*args, **kwargs)

    def output_projection(self, *args: Any, backend: Any = None, **kwargs: Any) -> torch.Tensor:
        return self.chosen["output_projection"].output_projection(*args, **kwargs)
