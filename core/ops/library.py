"""The six ``dsv4::<op>`` torch.library custom ops (ARCHITECTURE.md §3), with fake kernels.

Each op is opaque to torch.compile and CUDA-graph friendly: the real kernel selects a backend
through the registry and calls it; the fake kernel only allocates outputs of the right shape
and dtype, contiguous whatever the inputs' strides (ARCHITECTURE §3: what every backend returns;
torch.compile builds the consumers of an output for the fake's strides, and the conformance suite
checks a backend's outputs against them, ``conformance/layout.py``). A fake takes the op's defaults
too: the dispatcher drops trailing arguments equal to their defaults before it calls the fake. Cache writes are declared in ``mutates_args`` (``swa_cache``; ``state_cache`` and
``out_cache``) so functionalization keeps them. The backend travels as a string (``"auto"`` or
a registered name). No ``from __future__ import annotations`` here: ``custom_op`` reads the
annotations to infer the schema.
"""

import torch
from dsv4.backend import Backend
from dsv4.ops.dispatch import resolve
from dsv4.specs.errors import DSV4ValueError
from torch import Tensor

__all__ = ["CUSTOM_OPS", "EXTRA_KINDS", "check_extra_kind", "request_fields", "run_backend"]


# what sparse_attention's extra list is (selection hint: dsv4.ops.sparse_attention's docstring)
EXTRA_KINDS = ("topk", "dense", "none", "unknown")


def check_extra_kind(kind: str, has_extra: bool) -> None:
    """``kind`` is one of ``EXTRA_KINDS`` and ``"none"`` exactly when there is no extra list. Checked in
    ``request_fields``, which every path to a backend takes (``dsv4.ops`` and ``torch.ops.dsv4``)."""
    if kind not in EXTRA_KINDS:
        raise DSV4ValueError.of("extra_kind", f"one of {', '.join(EXTRA_KINDS)}", kind)
    if kind != "unknown" and (kind == "none") == has_extra:
        raise DSV4ValueError.of("extra_kind", "'none' exactly when there is no extra list",
                                f"{kind!r} with extra_indices {'given' if has_extra else 'None'}")


def request_fields(op: str, args: tuple, kwargs: dict, hints: dict | None = None) -> dict:
    """``OpRequest`` fields for one call of ``op`` (positional args and keyword args as in §3; ``hints``:
    selection-only arguments, sparse_attention's ``extra_kind``)."""
    if op == "qnorm_rope_insert":
        q = args[0]
        return {"dtype": q.dtype, "kv_format": kwargs["kv_format"], "heads": q.shape[1],
                "profile": kwargs["profile"]}
    if op == "compress_insert":
        out_format = kwargs["out_format"]
        # SPEC §5.2: d = 128 writes the indexer key cache, d = 512 the latent cache.
        key = "indexer_key_format" if out_format.startswith("indexer") else "kv_format"
        return {key: out_format, "profile": kwargs["profile"]}
    if op == "indexer_q":
        return {"dtype": args[0].dtype, "profile": kwargs["profile"]}
    if op == "indexer_topk":
        return {"dtype": args[0].dtype, "indexer_key_format": kwargs["key_format"], "topk": kwargs["topk"]}
    if op == "sparse_attention":
        q, extra_indices = args[0], args[5]
        kind = (hints or {}).get("extra_kind", "unknown")
        check_extra_kind(kind, extra_indices is not None)
        return {"dtype": q.dtype, "kv_format": kwargs["kv_format"], "heads": q.shape[1],
                "topk": None if extra_indices is None else extra_indices.shape[1],
                "has_sink": True, "profile": kwargs["profile"],
                "extra": () if kind == "unknown" else (("extra_kind", kind),)}
    if op == "output_projection":
        return {"dtype": args[0].dtype, "heads": args[0].shape[1]}
    raise KeyError(op)


def run_backend(op: str, backend: "str | Backend | None", args: tuple, kwargs: dict, hints: dict | None = None):
    """Select the backend for this call (``hints`` inform the selection only) and run ``op`` on it."""
    impl = resolve(op, args[0].device, backend, **request_fields(op, args, kwargs, hints))
    return getattr(impl, op)(*args, **kwargs)


@torch.library.custom_op("dsv4::qnorm_rope_insert", mutates_args=("swa_cache",))
def qnorm_rope_insert(q: Tensor, kv: Tensor, positions: Tensor, cos_sin: Tensor, swa_cache: Tensor,
                      swa_slot_mapping: Tensor, kv_format: str, eps: float, profile: str, backend: str) -> Tensor:
    return run_backend("qnorm_rope_insert", backend, (q, kv, positions, cos_sin, swa_cache, swa_slot_mapping),
                       {"kv_format": kv_format, "eps": eps, "profile": profile})


@qnorm_rope_insert.register_fake
def _(q, kv, positions, cos_sin, swa_cache, swa_slot_mapping, kv_format, eps, profile, backend):
    return q.new_empty(q.shape)


@torch.library.custom_op("dsv4::compress_insert", mutates_args=("state_cache", "out_cache"))
def compress_insert(kv_score: Tensor, positions: Tensor, token_request: Tensor, state_cache: Tensor,
                    state_block_table: Tensor, state_slot_mapping: Tensor, ape: Tensor, norm_weight: Tensor,
                    cos_sin: Tensor, out_cache: Tensor, out_slot_mapping: Tensor, ratio: int, head_dim: int,
                    out_format: str, profile: str, eps: float, windows_in_call: bool, backend: str) -> None:
    run_backend("compress_insert", backend,
                (kv_score, positions, token_request, state_cache, state_block_table, state_slot_mapping, ape,
                 norm_weight, cos_sin, out_cache, out_slot_mapping),
                {"ratio": ratio, "head_dim": head_dim, "out_format": out_format, "profile": profile, "eps": eps,
                 "windows_in_call": windows_in_call})


@compress_insert.register_fake
def _(kv_score, positions, token_request, state_cache, state_block_table, state_slot_mapping, ape, norm_weight,
      cos_sin, out_cache, out_slot_mapping, ratio, head_dim, out_format, profile, eps, windows_in_call, backend):
    return None


@torch.library.custom_op("dsv4::indexer_q", mutates_args=())
def indexer_q(index_q: Tensor, weights: Tensor, positions: Tensor, cos_sin: Tensor, profile: str,
              backend: str) -> tuple[Tensor, Tensor]:
    return run_backend("indexer_q", backend, (index_q, weights, positions, cos_sin), {"profile": profile})


@indexer_q.register_fake
def _(index_q, weights, positions, cos_sin, profile, backend):
    return index_q.new_empty(index_q.shape), weights.new_empty(weights.shape, dtype=torch.float32)


@torch.library.custom_op("dsv4::indexer_topk", mutates_args=())
def indexer_topk(q: Tensor, w: Tensor, positions: Tensor, token_request: Tensor, key_cache: Tensor,
                 key_block_table: Tensor, topk: int, key_format: str, ratio: int, backend: str) -> Tensor:
    return run_backend("indexer_topk", backend, (q, w, positions, token_request, key_cache, key_block_table),
                       {"topk": topk, "key_format": key_format, "ratio": ratio})


@indexer_topk.register_fake
def _(q, w, positions, token_request, key_cache, key_block_table, topk, key_format, ratio, backend):
    return q.new_empty((q.shape[0], topk), dtype=torch.int32)


@torch.library.custom_op("dsv4::sparse_attention", mutates_args=())
def sparse_attention(q: Tensor, swa_cache: Tensor, swa_indices: Tensor, swa_lens: Tensor,
                     extra_cache: Tensor | None, extra_indices: Tensor | None, extra_lens: Tensor | None,
                     sink: Tensor, kv_format: str, softmax_scale: float, profile: str, extra_kind: str = "unknown",
                     backend: str = "auto") -> tuple[Tensor, Tensor]:
    return run_backend("sparse_attention", backend,
                       (q, swa_cache, swa_indices, swa_lens, extra_cache, extra_indices, extra_lens, sink),
                       {"kv_format": kv_format, "softmax_scale": softmax_scale, "profile": profile},
                       {"extra_kind": extra_kind})


@sparse_attention.register_fake
def _(q, swa_cache, swa_indices, swa_lens, extra_cache, extra_indices, extra_lens, sink, kv_format,
      softmax_scale, profile, extra_kind="unknown", backend="auto"):
    return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=torch.float32)


@torch.library.custom_op("dsv4::output_projection", mutates_args=())
def output_projection(o: Tensor, positions: Tensor, cos_sin: Tensor, wo_a: Tensor, wo_b: Tensor,
                      fp8_activations: bool, backend: str) -> Tensor:
    return run_backend("output_projection", backend, (o, positions, cos_sin, wo_a, wo_b),
                       {"fp8_activations": fp8_activations})


@output_projection.register_fake
def _(o, positions, cos_sin, wo_a, wo_b, fp8_activations, backend):
    return o.new_empty((o.shape[0], wo_b.shape[0]))


CUSTOM_OPS = {
    "qnorm_rope_insert": qnorm_rope_insert,
    "compress_insert": compress_insert,
    "indexer_q": indexer_q,
    "indexer_topk": indexer_topk,
    "sparse_attention": sparse_attention,
    "output_projection": output_projection,
}
