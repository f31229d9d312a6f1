"""dsv4.ops: custom ops (schema, fake kernels, mutation) checked by opcheck; validation; dispatch."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from dsv4 import ops
from dsv4.backend import OP_NAMES
from dsv4.conformance.cases import Case, default_cases, prepare, private_copy
from dsv4.ops.library import CUSTOM_OPS
from dsv4.specs.errors import DSV4TypeError, DSV4ValueError
from dsv4.specs.layer_kinds import LayerKind

# one small case per op (cache-writing ops included), inputs fresh from the case seeds
_CASES = {c.op: c for c in reversed(default_cases()) if c.variant != "wide"}


@pytest.mark.parametrize("op", OP_NAMES)
def test_opcheck(op):
    prepared = prepare(_CASES[op])
    args, kwargs = prepared.steps[0]
    # selection-only arguments of the schema: what the case's layer kind makes the extra list
    hints = (LayerKind(_CASES[op].kind).compressed_list,) if op == "sparse_attention" else ()
    torch.library.opcheck(CUSTOM_OPS[op], (*args, *kwargs.values(), *hints, "reference"),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize("op", OP_NAMES)
def test_public_op_matches_reference_and_writes_caches(op):
    from dsv4 import reference

    prepared = prepare(_CASES[op])
    mine, theirs = private_copy(prepared), private_copy(prepared)
    (args, kwargs), (rargs, rkwargs) = mine.steps[0], theirs.steps[0]
    got = getattr(ops, op)(*args, **kwargs, backend="auto")
    want = getattr(reference, op)(*rargs, **rkwargs)
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        if g is not None:
            torch.testing.assert_close(g, w, equal_nan=True, rtol=0, atol=0)
    changed = []
    for index, _fmt in prepared.caches.values():
        assert torch.equal(args[index].view(torch.uint8), rargs[index].view(torch.uint8))
        changed.append(not torch.equal(args[index].view(torch.uint8), prepared.steps[0][0][index].view(torch.uint8)))
    assert not prepared.caches or any(changed)  # the op wrote through the custom op's mutated arguments


def test_rejected_call_writes_nothing():
    prepared = prepare(Case("qnorm_rope_insert", "swa", "-", "fp8_ds_mla", "mixed"))
    (q, kv, positions, cos_sin, cache, slots), kwargs = prepared.steps[0]
    before = cache.clone()
    with pytest.raises(DSV4TypeError, match="positions: expected dtype torch.int64, got torch.int32"):
        ops.qnorm_rope_insert(q, kv, positions.to(torch.int32), cos_sin, cache, slots, **kwargs)
    with pytest.raises(DSV4ValueError, match="kv: expected 9 rows"):
        ops.qnorm_rope_insert(q, kv[:4], positions, cos_sin, cache, slots, **kwargs)
    assert torch.equal(cache, before)


def test_missing_sink_and_partial_extra_are_errors():
    prepared = prepare(Case("sparse_attention", "csa", "vllm", "fp8_ds_mla", "decode"))
    args, kwargs = prepared.steps[0]
    with pytest.raises(DSV4ValueError, match="sink: expected a \\[8\\] fp32 tensor, got None"):
        ops.sparse_attention(*args[:7], None, **kwargs)
    with pytest.raises(DSV4ValueError, match="all three or none"):
        ops.sparse_attention(*args[:6], None, args[7], **kwargs)


def test_explicit_backend_instance_and_unknown_name():
    from dsv4.backends.reference import ReferenceBackend
    from dsv4.specs.errors import NoBackendError

    calls = []

    class Counting(ReferenceBackend):
        name = "counting"

        def output_projection(self, *args, **kwargs):
            calls.append(1)
            return super().output_projection(*args, **kwargs)

    prepared = prepare(_CASES["output_projection"])
    args, kwargs = prepared.steps[0]
    out = ops.output_projection(*args, **kwargs, backend=Counting())
    assert calls == [1] and out.shape == (args[0].shape[0], args[4].shape[0])
    with pytest.raises(NoBackendError, match="expected one of .*reference"):
        ops.output_projection(*args, **kwargs, backend="no-such-backend")


def test_compile_graph_holds_the_opaque_op():
    prepared = prepare(_CASES["output_projection"])
    args, kwargs = prepared.steps[0]
    gm = torch.fx.experimental.proxy_tensor.make_fx(
        lambda *a: ops.output_projection(*a, **kwargs), tracing_mode="fake")(*args)
    assert "dsv4.output_projection" in str(gm.graph)


def test_the_sparse_attention_fake_kernel_takes_the_ops_defaults():
    """The dispatcher drops trailing arguments equal to their defaults before it calls a fake kernel, so
    tracing ``dsv4.ops.sparse_attention(..., backend="auto")`` (both defaults) called the fake without
    extra_kind and backend: a TypeError, under torch.compile too."""
    prepared = prepare(Case("sparse_attention", "csa", "vllm", "fp8_ds_mla", "decode"))
    args, kwargs = prepared.steps[0]
    for call in (lambda *a: torch.ops.dsv4.sparse_attention(*a, **kwargs),
                 lambda *a: ops.sparse_attention(*a, **kwargs, backend="auto")):
        gm = torch.fx.experimental.proxy_tensor.make_fx(call, tracing_mode="fake")(*args)
        assert "dsv4.sparse_attention" in str(gm.graph)


def test_custom_op_extra_kind_defaults_and_is_checked():
    """torch.ops.dsv4.sparse_attention is public too: extra_kind defaults to "unknown" (callers written
    before it existed keep working) and a value outside EXTRA_KINDS is refused, not passed on as a
    selection hint that no backend's rule recognizes."""
    from dsv4.specs.errors import DSV4ValueError

    prepared = prepare(Case("sparse_attention", "csa", "vllm", "fp8_ds_mla", "decode"))
    args, kwargs = prepared.steps[0]
    out, lse = torch.ops.dsv4.sparse_attention(*args, **kwargs)
    assert out.shape == args[0].shape and lse.shape == args[0].shape[:2]
    with pytest.raises(DSV4ValueError, match="extra_kind: expected one of topk, dense, none, unknown, got bogus"):
        torch.ops.dsv4.sparse_attention(*args, **kwargs, extra_kind="bogus", backend="reference")
    with pytest.raises(DSV4ValueError, match="extra_kind: expected 'none' exactly when there is no extra list"):
        torch.ops.dsv4.sparse_attention(*args, **kwargs, extra_kind="none", backend="reference")


@pytest.mark.parametrize("op", OP_NAMES)
def test_eager_inference_skips_the_custom_op_with_the_same_bits(op):
    """Under no_grad (nothing traced) a dsv4.ops call runs its backend without the torch.ops.dsv4 custom op
    (no dsv4:: event in the profiler) and returns and writes the same bits as through it (grad mode)."""
    from torch.profiler import profile

    prepared = prepare(_CASES[op])
    extra = {"extra_kind": LayerKind(_CASES[op].kind).compressed_list} if op == "sparse_attention" else {}
    results = {}
    for grad in (True, False):
        run = private_copy(prepared)
        args, kwargs = run.steps[0]
        with torch.set_grad_enabled(grad), profile() as prof:
            out = getattr(ops, op)(*args, **kwargs, **extra, backend="reference")
        assert any(e.name == f"dsv4::{op}" for e in prof.events()) == grad
        outs = out if isinstance(out, tuple) else (out,)
        results[grad] = [t for t in outs if t is not None] + [a for a in args if isinstance(a, torch.Tensor)]
    def raw(t):  # bytes, so that NaN-poisoned bytes compare too
        return t.detach().contiguous().view(torch.uint8)

    assert all(torch.equal(raw(a), raw(b)) for a, b in zip(results[True], results[False], strict=True))


@torch.no_grad()
def test_meta_tensors_in_eager_inference_get_the_fake_kernel():
    """Shape inference on meta tensors under no_grad still goes through the custom op's fake kernel."""
    prepared = prepare(_CASES["output_projection"])
    args, kwargs = prepared.steps[0]
    meta_args = tuple(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args)
    out = ops.output_projection(*meta_args, **kwargs, backend="reference")
    assert out.device.type == "meta" and out.shape == (args[0].shape[0], args[4].shape[0])


@pytest.mark.parametrize("table_change, size, message", [
    (lambda t: t.to(torch.int64), 4, "compressed_block_table: expected dtype torch.int32, got torch.int64"),
    (lambda t: t[0], 4, "compressed_block_table: expected a 2-D"),
    (lambda t: t, 4.0, "compressed_block_size: expected a positive int .*got 4.0"),
    (lambda t: t, 0, "compressed_block_size: expected a positive int .*got 0"),
    (lambda t: t, True, "compressed_block_size: expected a positive int .*got True"),
])
def test_indexer_topk_slots_page_arguments_follow_one_rule_at_every_entry(table_change, size, message):
    """dsv4.ops, the base Backend composition (reference) and the fused Triton method refuse the same
    page arguments with the same message (dsv4.metadata.check_compressed_pages), before any top-k runs."""
    from dsv4.backends.reference import ReferenceBackend
    from dsv4.backends.triton.backend import TritonBackend

    prepared = prepare(Case("indexer_topk", "csa", "deepseek", "indexer_fp8", "mixed"))
    args, kwargs = prepared.steps[0]
    table = table_change(torch.zeros((4, 3), dtype=torch.int32))
    entries = (ops.indexer_topk_slots, ReferenceBackend().indexer_topk_slots, TritonBackend().indexer_topk_slots)
    for call in entries:
        with pytest.raises((DSV4TypeError, DSV4ValueError), match=message):
            call(*args, table, compressed_block_size=size, **kwargs)
    slots, lens = ReferenceBackend().indexer_topk_slots(*args, torch.zeros((4, 3), dtype=torch.int32),
                                                        compressed_block_size=np.int64(4), **kwargs)
    assert slots.dtype == lens.dtype == torch.int32  # an integer with __index__ is taken


@pytest.mark.parametrize("table, size, message", [
    (torch.full((4, 3), -5, dtype=torch.int32), 64, (r"compressed_block_table: expected -1 or page ids in "
     r"\[0, 33554432\) \(global slots below 2\*\*31 at 64 entries a page\), got range \[-5, -5\]")),
    (torch.full((4, 3), 1 << 25, dtype=torch.int32), 64, r"got range \[33554432, 33554432\]"),
    (torch.zeros((1, 3), dtype=torch.int32), 64, r"token_request: expected values in \[0, 1\)"),
])
def test_indexer_topk_slots_range_checks_the_compressed_table(table, size, message):
    """Negative page ids other than -1 (all slots silently -1: the compressed context dropped), pages whose
    slots overflow int32, and token rows past the table are refused where values are checked (the op has no
    compressed cache to bound the pages by; sparse_attention bounds the slots by it)."""
    prepared = prepare(Case("indexer_topk", "csa", "deepseek", "indexer_fp8", "mixed"))
    args, kwargs = prepared.steps[0]
    assert int(args[3].max()) >= 1  # token_request reaches a second request row
    with pytest.raises(DSV4ValueError, match=message):
        ops.indexer_topk_slots(*args, table, compressed_block_size=size, **kwargs)


def test_output_projection_names_wo_a_when_its_rows_do_not_split_into_groups():
    prepared = prepare(_CASES["output_projection"])
    (o, positions, cos_sin, wo_a, wo_b), kwargs = prepared.steps[0]
    width = o.shape[1] * o.shape[2]
    bad_a = torch.zeros(3, width // 2, dtype=wo_a.dtype)  # two groups of (H/2)*D columns, 3 rows
    bad_b = torch.zeros(wo_b.shape[0], 3, dtype=wo_b.dtype)
    with pytest.raises(DSV4ValueError, match=r"wo_a: expected 2 groups of rows .*got shape \(3, "):
        ops.output_projection(o, positions, cos_sin, bad_a, bad_b, **kwargs)


_COS_SIN_ARG = {"qnorm_rope_insert": 3, "compress_insert": 8, "indexer_q": 3, "output_projection": 2}


@pytest.mark.parametrize("op", sorted(_COS_SIN_ARG))
@pytest.mark.parametrize("width", [32, 128])
def test_cos_sin_of_another_width_is_refused_at_every_entry(monkeypatch, op, width):
    """Every rotation is over the last ROPE_DIM (64) dims (SPEC §1): a [P, 32] or [P, 128] table is refused
    by dsv4.ops before any backend runs, and by the reference backend called directly; nothing is written."""
    from dsv4.backends.reference import ReferenceBackend
    from dsv4.ops import library

    prepared = prepare(_CASES[op])
    args, kwargs = prepared.steps[0]
    table = args[_COS_SIN_ARG[op]]
    wrong = torch.cat([table, table], 1) if width == 128 else table[:, :32]
    args = args[:_COS_SIN_ARG[op]] + (wrong,) + args[_COS_SIN_ARG[op] + 1:]
    before = [args[index].clone() for index, _fmt in prepared.caches.values()]

    def reached(*_args, **_kwargs):
        raise AssertionError(f"{op} reached a backend with cos_sin {tuple(wrong.shape)}")

    with monkeypatch.context() as patch:
        patch.setattr(library, "run_backend", reached)
        with pytest.raises(DSV4ValueError, match=r"cos_sin: expected shape \[P, 64\]"):
            getattr(ops, op)(*args, **kwargs, backend="reference")
    with pytest.raises(DSV4ValueError, match=r"cos_sin: expected shape \[P, 64\]"):
        getattr(ReferenceBackend(), op)(*args, **kwargs)
    for (index, _fmt), cache in zip(prepared.caches.values(), before):
        assert torch.equal(args[index].view(torch.uint8), cache.view(torch.uint8))
