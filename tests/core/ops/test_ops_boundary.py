"""dsv4.ops checks what every backend needs before the backend runs: shapes against the cache format's row
width, the fp32 weights' dtypes, the projections' dtypes and one device for all tensors. Before, the reference
raised a bare einsum error, computed with bf16 weights, or (another device) the Triton backend raised a pointer
error naming no argument; nothing is written to a cache on a refused call."""
from __future__ import annotations

import pytest
import torch
from dsv4 import ops
from dsv4.conformance.cases import default_cases, prepare
from dsv4.specs.errors import CacheLayoutError, DSV4TypeError, DSV4ValueError

_CASES = {c.op: c for c in reversed(default_cases()) if c.variant != "wide"}


def _meta(t: torch.Tensor) -> torch.Tensor:
    return t.to("meta")


@pytest.mark.parametrize("op, index, change, error, message", [
    ("sparse_attention", 0, lambda t: t[..., :256].contiguous(), DSV4ValueError,
     r"^q: expected last dim 512 \(the rows of fp8_ds_mla\), got shape \(12, 8, 256\)"),
    ("sparse_attention", 7, _meta, DSV4ValueError, r"^sink: expected device cpu \(q's\), got meta"),
    ("indexer_topk", 0, lambda t: t[..., :64].contiguous(), DSV4ValueError,
     r"^q: expected last dim 128 \(the rows of indexer_mxfp4\)"),
    ("indexer_topk", 1, lambda t: t.bfloat16(), DSV4TypeError, r"^w: expected dtype torch.float32"),
    ("indexer_topk", 1, lambda t: t[:, :32].contiguous(), DSV4ValueError,
     r"^w: expected shape \(15, 64\) \(q's tokens and heads\), got shape \(15, 32\)"),
    ("indexer_topk", 5, _meta, DSV4ValueError, r"^key_block_table: expected device cpu \(q's\), got meta"),
    ("compress_insert", 6, lambda t: t.bfloat16(), DSV4TypeError, r"^ape: expected dtype torch.float32"),
    ("compress_insert", 7, lambda t: t.bfloat16(), DSV4TypeError, r"^norm_weight: expected dtype torch.float32"),
    ("compress_insert", 9, _meta, DSV4ValueError, r"^out_cache: expected device cpu \(kv_score's\), got meta"),
    ("qnorm_rope_insert", 0, lambda t: t[..., :256].contiguous(), DSV4ValueError, r"^q: expected last dim 512"),
    ("qnorm_rope_insert", 2, _meta, DSV4ValueError, r"^positions: expected device cpu \(q's\), got meta"),
    ("indexer_q", 1, _meta, DSV4ValueError, r"^weights: expected device cpu \(index_q's\), got meta"),
    ("output_projection", 3, lambda t: t.float(), DSV4TypeError, r"^wo_a: expected dtype torch.bfloat16"),
    ("output_projection", 4, _meta, DSV4ValueError, r"^wo_b: expected device cpu \(o's\), got meta"),
])
def test_the_ops_refuse_what_a_backend_would_misread(op, index, change, error, message):
    args, kwargs = prepare(_CASES[op]).steps[0]
    args = list(args)
    args[index] = change(args[index])
    before = [a.clone() for a in args if isinstance(a, torch.Tensor) and a.device.type != "meta"]
    with pytest.raises(error, match=message):
        getattr(ops, op)(*args, **kwargs, backend="reference")
    after = [a for a in args if isinstance(a, torch.Tensor) and a.device.type != "meta"]
    assert all(torch.equal(_raw(a), _raw(b)) for a, b in zip(before, after, strict=True))  # caches included


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes (NaN-poisoned rows compare too)."""
    return t.contiguous().view(torch.uint8)


def test_compress_insert_head_dim_must_be_the_out_formats_rows():
    """A head_dim consistent with kv_score and the state but not with out_format's rows (512 / 128)."""
    args, kwargs = prepare(_CASES["compress_insert"]).steps[0]
    assert kwargs["out_format"] == "fp8_ds_mla" and kwargs["head_dim"] == 512
    with pytest.raises(DSV4ValueError, match=r"^head_dim: expected 128 \(the rows of indexer_fp8\), got 512"):
        ops.compress_insert(*args, **{**kwargs, "out_format": "indexer_fp8"}, backend="reference")


@pytest.mark.parametrize("op, argument", [("sparse_attention", "kv_format"), ("qnorm_rope_insert", "kv_format"),
                                          ("indexer_topk", "key_format"), ("compress_insert", "out_format")])
def test_an_unknown_cache_format_is_named_by_the_ops_argument(op, argument):
    """Not the codec's internal ``format_name`` from inside the reference."""
    args, kwargs = prepare(_CASES[op]).steps[0]
    with pytest.raises(CacheLayoutError, match=rf"^{argument}: expected one of fp8_ds_mla, .*got 'nope'"):
        getattr(ops, op)(*args, **{**kwargs, argument: "nope"}, backend="reference")


@pytest.mark.parametrize("op, argument, value, message", [
    ("qnorm_rope_insert", "eps", "x", r"^eps: expected a real number, got str 'x'"),
    ("compress_insert", "eps", None, r"^eps: expected a real number, got NoneType None"),
    ("sparse_attention", "softmax_scale", "x", r"^softmax_scale: expected a real number, got str 'x'"),
    ("indexer_topk", "topk", "x", r"^topk: expected an int, got str 'x'"),
    ("indexer_topk", "topk", 8.0, r"^topk: expected an int, got float 8.0"),
])
def test_scalars_that_are_not_numbers_are_named(op, argument, value, message):
    """Not Python's bare ``could not convert string to float`` from inside the wrapper."""
    args, kwargs = prepare(_CASES[op]).steps[0]
    with pytest.raises(DSV4TypeError, match=message):
        getattr(ops, op)(*args, **{**kwargs, argument: value}, backend="reference")
