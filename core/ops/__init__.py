"""``dsv4.ops``: the six ops of ARCHITECTURE.md §3, dispatched to a backend.

Each function validates its arguments, then calls the ``torch.ops.dsv4.<op>`` custom op, which
selects a backend through :mod:`dsv4.registry` (explicit ``backend``, then ``DSV4_BACKEND``, then
the platform priority list) and runs it. Every check runs before the backend, so a rejected call
writes nothing (SPEC §12). Two kinds of checks:

* dtypes, ranks, row counts: always (they read no values).
* value ranges of every index-like argument (SPEC §10, §12): slot mappings in ``[-1, capacity)``
  (capacity = cache blocks x block size, from the format's codec), block-table pages in
  ``[-1, num_blocks)``, positions in ``[0, rows of cos_sin)`` (``>= 0`` for ``indexer_topk``),
  ``token_request`` in the block table's rows, sparse ``lens`` in ``[0, width]`` and the entries
  they cover in ``[-1, capacity)``, compressed slots only where a block closes, with a state page
  for every position its window reads. One min/max reduction per tensor, which on an accelerator
  is a device sync, so: **always on the CPU; on an accelerator only when switched on**, by
  ``DSV4_VALIDATE=1`` (read once, at the first check) or :func:`set_value_checks` (``True`` /
  ``False``; ``None`` goes back to the environment). Never while ``torch.compile`` traces or a
  CUDA graph is captured. The :class:`~dsv4.Attention` layer's metadata comes from ``plan_step``
  and is valid by construction, so its GPU path stays sync-free by default; switch validation on
  when calling the ops directly with hand-built metadata (a backend kernel given an out-of-range
  index reads or writes outside the cache).

``backend`` may be ``"auto"``, a registered name, or a :class:`~dsv4.backend.Backend` instance
(an unregistered instance is called directly, outside the custom op).
"""
from __future__ import annotations

import operator

import torch
from dsv4.backend import OP_NAMES, Backend
from dsv4.cache_args import MAX_SLOTS
from dsv4.metadata import check_compressed_pages, topk_local_to_global
from dsv4.ops import library
from dsv4.ops.dispatch import backend_name, eager_untraced
from dsv4.ops.validate import (
    FLOATS,
    cache_block_size,
    cache_capacity,
    check_compressed_slots,
    check_dtype,
    check_indices,
    check_key_pages,
    check_pages,
    check_positions_nonnegative,
    check_positions_range,
    check_rank,
    check_request_ids,
    check_rows,
    check_slots,
    closing_windows,
    set_value_checks,
    value_checks_enabled,
)
from dsv4.registry import get_registry
from dsv4.specs.config import ROPE_DIM
from dsv4.specs.errors import CacheLayoutError, DSV4TypeError, DSV4ValueError
from dsv4.specs.formats import format_names, get_format

__all__ = [
    "OP_NAMES",
    "compress_insert",
    "indexer_q",
    "indexer_topk",
    "indexer_topk_slots",
    "output_projection",
    "qnorm_rope_insert",
    "set_value_checks",
    "sparse_attention",
    "value_checks_enabled",
]

BackendArg = str | Backend | None
I32, I64 = torch.int32, torch.int64


def _call(op: str, backend: BackendArg, args: tuple, kwargs: dict, hints: dict | None = None):
    """Run ``op``: ``kwargs`` go to the backend, ``hints`` (selection only) to the custom op and the registry.

    In eager inference (``dsv4.ops.dispatch.eager_untraced``) the backend runs without the custom op,
    whose machinery costs ~30-150 µs a call on an H200 host and adds nothing there; traced, autograd or
    autocast calls keep the opaque custom op."""
    hints = hints or {}
    if isinstance(backend, Backend):
        registry = get_registry()
        if backend.name not in registry.backend_names() or registry.get(backend.name) is not backend:
            return library.run_backend(op, backend, args, kwargs, hints)
    if eager_untraced(args[0]):
        return library.run_backend(op, backend_name(backend), args, kwargs, hints)
    return getattr(torch.ops.dsv4, op)(*args, **kwargs, **hints, backend=backend_name(backend))


def qnorm_rope_insert(q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                      swa_cache: torch.Tensor, swa_slot_mapping: torch.Tensor, *, kv_format: str, eps: float,
                      profile: str = "deepseek", backend: BackendArg = "auto") -> torch.Tensor:
    """SPEC §3 steps 2-3. q [T,H,512] bf16, kv [T,512] bf16, positions [T] int64, cos_sin [P,64] fp32,
    swa_slot_mapping [T] int64 -> q_out [T,H,512] q.dtype; writes roped kv into ``swa_cache``."""
    check_rank("q", q, 3)
    check_dtype("q", q, *FLOATS)
    _row_width("q", q, "kv_format", kv_format)
    num_tokens = q.shape[0]
    check_rank("kv", kv, 2)
    check_rows("kv", kv, num_tokens)
    if kv.shape[1] != q.shape[2]:
        raise DSV4ValueError.of("kv", f"shape [{num_tokens}, {q.shape[2]}]", f"shape {tuple(kv.shape)}")
    _positions(positions, num_tokens)
    _cos_sin(cos_sin)
    _slots("swa_slot_mapping", swa_slot_mapping, num_tokens)
    _same_device("q", q, kv=kv, positions=positions, cos_sin=cos_sin, swa_cache=swa_cache,
                 swa_slot_mapping=swa_slot_mapping)
    if value_checks_enabled(q):
        check_positions_range(positions, cos_sin.shape[0])
        _slots_in_cache("swa_slot_mapping", swa_slot_mapping, kv_format, swa_cache)
    return _call("qnorm_rope_insert", backend, (q, kv, positions, cos_sin, swa_cache, swa_slot_mapping),
                 {"kv_format": kv_format, "eps": _real("eps", eps), "profile": profile})


def compress_insert(kv_score: torch.Tensor, positions: torch.Tensor, token_request: torch.Tensor,
                    state_cache: torch.Tensor, state_block_table: torch.Tensor, state_slot_mapping: torch.Tensor,
                    ape: torch.Tensor, norm_weight: torch.Tensor, cos_sin: torch.Tensor, out_cache: torch.Tensor,
                    out_slot_mapping: torch.Tensor, *, ratio: int, head_dim: int, out_format: str, profile: str,
                    eps: float, windows_in_call: bool = False, backend: BackendArg = "auto") -> None:
    """SPEC §5. kv_score [T, 2*coff*d] fp32, state_cache fp32 [nb, bs, 2*coff*d], state_block_table
    [R, mb] int32, slot mappings [T] int64, ape [r, coff*d] fp32, norm_weight [d] fp32.

    windows_in_call: the caller's host-side promise that every block closing in this call has its whole
    window among this call's tokens (each request with a closing token starts at position 0 here, its
    tokens consecutive in position order, slot mappings derived from the block tables:
    ``StepMetadata.windows_in_step``). The result is the same either way; a backend may skip work
    (Triton: the state-pool launch, outside CUDA-graph capture). A false promise gives wrong blocks."""
    if ratio not in (4, 128):
        raise DSV4ValueError.of("ratio", "4 (CSA) or 128 (HCA)", ratio)
    width = 2 * (2 if ratio == 4 else 1) * head_dim  # SPEC §9.4: [kv (coff*d) | score (coff*d)]
    check_rank("kv_score", kv_score, 2)
    check_dtype("kv_score", kv_score, torch.float32, torch.float64)
    num_tokens = kv_score.shape[0]
    if kv_score.shape[1] != width:
        raise DSV4ValueError.of("kv_score", f"shape [{num_tokens}, {width}]", f"shape {tuple(kv_score.shape)}")
    _positions(positions, num_tokens)
    _request_ids(token_request, num_tokens)
    check_dtype("state_cache", state_cache, torch.float32)  # SPEC §12: compressor state must be fp32
    check_rank("state_cache", state_cache, 3)
    if state_cache.shape[-1] != width:
        raise DSV4ValueError.of("state_cache", f"rows of {width} fp32", f"shape {tuple(state_cache.shape)}")
    check_rank("state_block_table", state_block_table, 2)
    check_dtype("state_block_table", state_block_table, I32)
    _slots("state_slot_mapping", state_slot_mapping, num_tokens)
    _slots("out_slot_mapping", out_slot_mapping, num_tokens)
    if tuple(ape.shape) != (ratio, width // 2):
        raise DSV4ValueError.of("ape", f"shape ({ratio}, {width // 2})", f"shape {tuple(ape.shape)}")
    if tuple(norm_weight.shape) != (head_dim,):
        raise DSV4ValueError.of("norm_weight", f"shape ({head_dim},)", f"shape {tuple(norm_weight.shape)}")
    rows = _format_width("out_format", out_format)
    if rows != head_dim:
        raise DSV4ValueError.of("head_dim", f"{rows} (the rows of {out_format})", head_dim)
    check_dtype("ape", ape, torch.float32, torch.float64)  # SPEC §5: kept fp32 whatever the activations
    check_dtype("norm_weight", norm_weight, torch.float32, torch.float64)
    _cos_sin(cos_sin)
    _same_device("kv_score", kv_score, positions=positions, token_request=token_request, state_cache=state_cache,
                 state_block_table=state_block_table, state_slot_mapping=state_slot_mapping, ape=ape,
                 norm_weight=norm_weight, cos_sin=cos_sin, out_cache=out_cache, out_slot_mapping=out_slot_mapping)
    if value_checks_enabled(kv_score):
        check_positions_range(positions, cos_sin.shape[0])
        check_slots("state_slot_mapping", state_slot_mapping, state_cache.shape[0] * state_cache.shape[1])
        _slots_in_cache("out_slot_mapping", out_slot_mapping, out_format, out_cache)
        check_request_ids(token_request, state_block_table.shape[0])
        check_pages("state_block_table", state_block_table, state_cache.shape[0])
        check_compressed_slots(positions, out_slot_mapping, ratio)
        closing_windows(positions, token_request, out_slot_mapping, state_block_table, state_cache.shape[1], ratio)
    _call("compress_insert", backend,
          (kv_score, positions, token_request, state_cache, state_block_table, state_slot_mapping, ape, norm_weight,
           cos_sin, out_cache, out_slot_mapping),
          {"ratio": int(ratio), "head_dim": int(head_dim), "out_format": out_format, "profile": profile,
           "eps": _real("eps", eps), "windows_in_call": bool(windows_in_call)})


def indexer_q(index_q: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, *,
              profile: str, backend: BackendArg = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """SPEC §6.1-6.2. index_q [T,64,128] bf16, weights [T,64] -> (q [T,64,128] bf16, w [T,64] fp32)."""
    check_rank("index_q", index_q, 3)
    check_dtype("index_q", index_q, *FLOATS)
    num_tokens = index_q.shape[0]
    check_rank("weights", weights, 2)
    if tuple(weights.shape) != tuple(index_q.shape[:2]):
        raise DSV4ValueError.of("weights", f"shape {tuple(index_q.shape[:2])}", f"shape {tuple(weights.shape)}")
    _positions(positions, num_tokens)
    _cos_sin(cos_sin)
    _same_device("index_q", index_q, weights=weights, positions=positions, cos_sin=cos_sin)
    if value_checks_enabled(index_q):
        check_positions_range(positions, cos_sin.shape[0])
    return _call("indexer_q", backend, (index_q, weights, positions, cos_sin), {"profile": profile})


def indexer_topk(q: torch.Tensor, w: torch.Tensor, positions: torch.Tensor, token_request: torch.Tensor,
                 key_cache: torch.Tensor, key_block_table: torch.Tensor, *, topk: int, key_format: str,
                 ratio: int = 4, backend: BackendArg = "auto") -> torch.Tensor:
    """SPEC §6.3. q [T,64,128] bf16, w [T,64] fp32, key_block_table [R,mb] int32 -> [T, topk] int32
    request-local compressed indices, valid entries first, -1 padded."""
    check_rank("q", q, 3)
    check_dtype("q", q, *FLOATS)
    num_tokens = q.shape[0]
    _row_width("q", q, "key_format", key_format)
    check_rank("w", w, 2)
    if tuple(w.shape) != tuple(q.shape[:2]):
        raise DSV4ValueError.of("w", f"shape {tuple(q.shape[:2])} (q's tokens and heads)", f"shape {tuple(w.shape)}")
    check_dtype("w", w, torch.float32, torch.float64)  # SPEC §6.2: indexer_q's fp32 head weights
    _positions(positions, num_tokens)
    _request_ids(token_request, num_tokens)
    check_rank("key_block_table", key_block_table, 2)
    check_dtype("key_block_table", key_block_table, I32)
    _same_device("q", q, w=w, positions=positions, token_request=token_request, key_cache=key_cache,
                 key_block_table=key_block_table)
    topk = _integer("topk", topk)
    if topk <= 0:
        raise DSV4ValueError.of("topk", "a positive width", topk)
    if not isinstance(ratio, int) or ratio <= 0:  # the reference's rule, before check_key_pages divides by it
        raise DSV4ValueError.of("ratio", "a positive int", ratio)
    if value_checks_enabled(q):
        check_positions_nonnegative(positions)
        check_request_ids(token_request, key_block_table.shape[0])
        check_pages("key_block_table", key_block_table, key_cache.shape[0])
        key_block_size = cache_block_size(key_format, key_cache)
        if key_block_size is not None:
            check_key_pages(positions, token_request, key_block_table, key_block_size, int(ratio))
    return _call("indexer_topk", backend, (q, w, positions, token_request, key_cache, key_block_table),
                 {"topk": int(topk), "key_format": key_format, "ratio": int(ratio)})


def indexer_topk_slots(q: torch.Tensor, w: torch.Tensor, positions: torch.Tensor, token_request: torch.Tensor,
                       key_cache: torch.Tensor, key_block_table: torch.Tensor, compressed_block_table: torch.Tensor,
                       *, topk: int, key_format: str, compressed_block_size: int, ratio: int = 4,
                       backend: BackendArg = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`indexer_topk`, then its indices as global slots of the compressed cache (SPEC §10) with
    :func:`dsv4.metadata.topk_local_to_global`: (slots [T, topk] int32, lens [T] int32).
    compressed_block_table [R, mb] int32 with pages of ``compressed_block_size`` entries. The layer's
    direct path runs ``Backend.indexer_topk_slots`` instead, which a backend may fuse; equal results."""
    block_size = check_compressed_pages(compressed_block_table, compressed_block_size)
    local = indexer_topk(q, w, positions, token_request, key_cache, key_block_table, topk=topk,
                         key_format=key_format, ratio=ratio, backend=backend)  # checks its own arguments first
    if value_checks_enabled(q):  # the op has no compressed cache: its slots must fit int32 (SPEC §10)
        if compressed_block_table.shape[0] < key_block_table.shape[0]:  # else indexer_topk's check covered it
            check_request_ids(token_request, compressed_block_table.shape[0])
        check_pages("compressed_block_table", compressed_block_table, MAX_SLOTS // block_size,
                    f"global slots below 2**31 at {block_size} entries a page")
    return topk_local_to_global(local, token_request, compressed_block_table, block_size)


def sparse_attention(q: torch.Tensor, swa_cache: torch.Tensor, swa_indices: torch.Tensor, swa_lens: torch.Tensor,
                     extra_cache: torch.Tensor | None, extra_indices: torch.Tensor | None,
                     extra_lens: torch.Tensor | None, sink: torch.Tensor, *, kv_format: str, softmax_scale: float,
                     profile: str, extra_kind: str = "unknown",
                     backend: BackendArg = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """SPEC §7. q [T,H,512], swa_indices [T,W] int32 global slots, swa_lens [T] int32, optional extra
    cache / indices [T,K] int32 / lens [T] int32, sink [H] fp32 -> (out [T,H,512] q.dtype, lse [T,H] fp32).

    ``extra_kind`` says what the extra list is, for backend selection only (kernels that take an indexer
    top-k of fixed widths but any HCA list): ``"topk"`` (CSA, the indexer's picks), ``"dense"`` (HCA, every
    visible compressed entry), ``"none"`` (no extra list) or ``"unknown"``. The layer always sets it."""
    check_rank("q", q, 3)
    check_dtype("q", q, *FLOATS)
    num_tokens, heads = q.shape[0], q.shape[1]
    _indices("swa_indices", swa_indices, swa_lens, "swa_lens", num_tokens)
    given = [x is not None for x in (extra_cache, extra_indices, extra_lens)]
    if any(given) and not all(given):
        raise DSV4ValueError.of("extra_cache, extra_indices, extra_lens", "all three or none",
                                f"{sum(given)} of 3 given")
    if extra_indices is not None:
        _indices("extra_indices", extra_indices, extra_lens, "extra_lens", num_tokens)
    if sink is None:  # SPEC §12: a missing sink is an error, never silently dropped
        raise DSV4ValueError.of("sink", f"a [{heads}] fp32 tensor", None)
    check_dtype("sink", sink, torch.float32, torch.float64)
    if tuple(sink.shape) != (heads,):
        raise DSV4ValueError.of("sink", f"shape ({heads},)", f"shape {tuple(sink.shape)}")
    _row_width("q", q, "kv_format", kv_format)
    _same_device("q", q, swa_cache=swa_cache, swa_indices=swa_indices, swa_lens=swa_lens, extra_cache=extra_cache,
                 extra_indices=extra_indices, extra_lens=extra_lens, sink=sink)
    if value_checks_enabled(q):
        check_indices("swa_indices", swa_indices, swa_lens, cache_capacity(kv_format, swa_cache))
        if extra_indices is not None:
            check_indices("extra_indices", extra_indices, extra_lens, cache_capacity(kv_format, extra_cache))
    return _call("sparse_attention", backend,
                 (q, swa_cache, swa_indices, swa_lens, extra_cache, extra_indices, extra_lens, sink),
                 {"kv_format": kv_format, "softmax_scale": _real("softmax_scale", softmax_scale), "profile": profile},
                 {"extra_kind": extra_kind})


def output_projection(o: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, wo_a: torch.Tensor,
                      wo_b: torch.Tensor, *, fp8_activations: bool, backend: BackendArg = "auto") -> torch.Tensor:
    """SPEC §3 steps 6-7, §8. o [T,H,512] bf16, wo_a [G*o_lora, (H/G)*512], wo_b [hidden, G*o_lora]
    -> [T, hidden] o.dtype."""
    check_rank("o", o, 3)
    check_dtype("o", o, *FLOATS)
    _positions(positions, o.shape[0])
    _cos_sin(cos_sin)
    check_rank("wo_a", wo_a, 2)
    check_rank("wo_b", wo_b, 2)
    width = o.shape[1] * o.shape[2]
    if wo_a.shape[1] == 0 or width % wo_a.shape[1] != 0:
        raise DSV4ValueError.of("wo_a", f"[G*o_lora, (H/G)*{o.shape[2]}] with G dividing H={o.shape[1]}",
                                f"shape {tuple(wo_a.shape)}")
    groups = width // wo_a.shape[1]
    if wo_a.shape[0] % groups != 0:
        raise DSV4ValueError.of("wo_a", f"{groups} groups of rows (shape [G*o_lora, {wo_a.shape[1]}] with G={groups})",
                                f"shape {tuple(wo_a.shape)}")
    if wo_b.shape[1] != wo_a.shape[0]:
        raise DSV4ValueError.of("wo_b", f"shape [hidden, {wo_a.shape[0]}]", f"shape {tuple(wo_b.shape)}")
    check_dtype("wo_a", wo_a, o.dtype)  # the projections run in the activations' dtype
    check_dtype("wo_b", wo_b, o.dtype)
    _same_device("o", o, positions=positions, cos_sin=cos_sin, wo_a=wo_a, wo_b=wo_b)
    if value_checks_enabled(o):
        check_positions_range(positions, cos_sin.shape[0])
    return _call("output_projection", backend, (o, positions, cos_sin, wo_a, wo_b),
                 {"fp8_activations": bool(fp8_activations)})


# -- shared argument checks ------------------------------------------------------------------------
def _positions(positions: torch.Tensor, num_tokens: int) -> None:
    check_dtype("positions", positions, I64)  # SPEC §12: positions not int64 is an error
    check_rank("positions", positions, 1)
    check_rows("positions", positions, num_tokens)


def _request_ids(token_request: torch.Tensor, num_tokens: int) -> None:
    check_dtype("token_request", token_request, I32)
    check_rank("token_request", token_request, 1)
    check_rows("token_request", token_request, num_tokens)


def _slots(name: str, slots: torch.Tensor, num_tokens: int) -> None:
    check_dtype(name, slots, I64)
    check_rank(name, slots, 1)
    check_rows(name, slots, num_tokens)


def _slots_in_cache(name: str, slots: torch.Tensor, format_name: str, cache: torch.Tensor) -> None:
    capacity = cache_capacity(format_name, cache)
    if capacity is not None:  # None: a layout the codec cannot read, which the backend reports
        check_slots(name, slots, capacity)


def _real(name: str, value: object) -> float:
    """``value`` as a float (anything ``float()`` takes but a bool), else an error naming ``name``."""
    try:
        if not isinstance(value, bool):
            return float(value)
    except (TypeError, ValueError):
        pass
    raise DSV4TypeError.of(name, "a real number", f"{type(value).__name__} {value!r}")


def _integer(name: str, value: object) -> int:
    """``value`` as an int (anything with ``__index__`` but a bool: not 8.0), else an error naming ``name``."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise DSV4TypeError.of(name, "an int", f"{type(value).__name__} {value!r}")


def _same_device(first: str, anchor: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    """Every tensor (None: absent) on ``anchor``'s device: a tensor elsewhere would reach the backend (Triton:
    a pointer error naming no argument; torch: a device error from inside an op)."""
    where = anchor.device
    for name, t in tensors.items():
        if t is not None and t.device != where:
            raise DSV4ValueError.of(name, f"device {where} ({first}'s)", t.device)


def _format_width(argument: str, format_name: str) -> int:
    """The row width of the cache format ``format_name``, the op's ``argument`` (a name SPEC does not list is
    refused here, naming it, rather than by a codec deep in a backend)."""
    try:
        return get_format(format_name).row_dim
    except CacheLayoutError:
        raise CacheLayoutError.of(argument, f"one of {', '.join(format_names())}", repr(format_name)) from None


def _row_width(name: str, t: torch.Tensor, argument: str, format_name: str) -> None:
    """``t``'s last dim is the row width of the cache format ``format_name`` (the op's ``argument``)."""
    width = _format_width(argument, format_name)
    if t.shape[-1] != width:
        raise DSV4ValueError.of(name, f"last dim {width} (the rows of {format_name})", f"shape {tuple(t.shape)}")


def _cos_sin(cos_sin: torch.Tensor) -> None:
    check_dtype("cos_sin", cos_sin, torch.float32, torch.float64)
    check_rank("cos_sin", cos_sin, 2)
    if cos_sin.shape[1] != ROPE_DIM:  # SPEC §1: every rotation is over the last ROPE_DIM dims
        raise DSV4ValueError.of("cos_sin", f"shape [P, {ROPE_DIM}] (the rope dims)", f"shape {tuple(cos_sin.shape)}")


def _indices(name: str, indices: torch.Tensor, lens: torch.Tensor | None, lens_name: str, num_tokens: int) -> None:
    check_dtype(name, indices, I32)
    check_rank(name, indices, 2)
    check_rows(name, indices, num_tokens)
    if lens is None:
        raise DSV4ValueError.of(lens_name, f"a [{num_tokens}] int32 tensor", None)
    check_dtype(lens_name, lens, I32)
    check_rank(lens_name, lens, 1)
    check_rows(lens_name, lens, num_tokens)
