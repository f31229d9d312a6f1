"""TritonBackend's wrappers (backends/triton/backend.py): what the kernels are given.

Kernels read a [T] index tensor as ``ptr + t`` and a block-table row as ``ptr + row * stride(0) + page``,
so a strided view must reach them copied. Each test runs one op twice, on strided views and on
contiguous copies of the same values, and wants the same bytes out (outputs and caches). Then
head-major q / o (read in place), and cos_sin tables of another width than the rope dims (refused, nothing written).
"""
from __future__ import annotations

import pytest
import torch
from _spies import first_args
from _triton_helpers import cos_sin_table, poisoned_like
from dsv4.backends.triton import TritonBackend
from dsv4.codecs import get_codec
from dsv4.specs.errors import DSV4TypeError, DSV4ValueError


def _column(values: torch.Tensor, junk: int) -> torch.Tensor:
    """``values`` [T] as column 0 of a [T, 2] tensor whose column 1 holds ``junk`` (stride (2,)): a kernel
    that reads it as contiguous reads ``junk`` at every odd t. ``junk`` is a legal value (a position in the
    table, a -1 slot, request 0, a zero length), so the wrong read stays inside every buffer."""
    assert values.dim() == 1
    strided = torch.stack([values, torch.full_like(values, junk)], 1)[:, 0]
    assert strided.stride() == (2,) and torch.equal(strided, values)
    return strided


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def test_qnorm_rope_insert_strided_positions_and_slots() -> None:
    torch.manual_seed(0)
    num_tokens, heads = 4, 4
    q = torch.randn(num_tokens, heads, 512).to(torch.bfloat16)
    kv = torch.randn(num_tokens, 512).to(torch.bfloat16)
    positions = torch.tensor([5, 6, 7, 8])
    slots = torch.tensor([3, 0, 2, 1])
    cos_sin = cos_sin_table(16)
    cache = poisoned_like(get_codec("fp8_ds_mla").allocate(1, 16))
    expected_cache = cache.clone()
    kw = {"kv_format": "fp8_ds_mla", "eps": 1e-6, "profile": "vllm"}
    got = TritonBackend().qnorm_rope_insert(q, kv, _column(positions, 0), cos_sin, cache, _column(slots, -1), **kw)
    want = TritonBackend().qnorm_rope_insert(q, kv, positions, cos_sin, expected_cache, slots, **kw)
    assert torch.equal(got, want)
    assert torch.equal(_bytes(cache), _bytes(expected_cache))


def _compressor_call(positions, token_request, table, ratio, state_block, out_block):
    """Slot mappings of ``positions`` through ``table`` (state) and a fixed compressed-page table."""
    out_table = torch.arange(4).view(2, 2)
    state_slots = table[token_request.long(), positions // state_block].long() * state_block \
        + positions % state_block
    entry = positions // ratio
    out_slots = torch.where((positions + 1) % ratio == 0,
                            out_table[token_request.long(), entry // out_block] * out_block + entry % out_block, -1)
    return state_slots, out_slots.long()


def _compress_twice(strided_vectors: bool, strided_table: bool) -> None:
    """Two requests: a 15-token prefill each, then one decode token each that closes a block whose window
    is read back from the state rows (the state-pool launch, which reads the block table). Run once on
    strided arguments, once on contiguous copies; state and compressed cache bytes must be equal."""
    torch.manual_seed(0)
    ratio, head_dim, out_format = 4, 128, "indexer_fp8"
    width, state_block, out_block, pages = 4 * head_dim, 8, 4, 4
    wide = torch.randperm(4 * pages).view(2, 2 * pages).to(torch.int32)
    table = wide[:, ::2] if strided_table else wide[:, ::2].contiguous()
    ape, weight, cos_sin = torch.randn(ratio, 2 * head_dim), torch.rand(head_dim) + 0.5, cos_sin_table(64)
    state = torch.randn(4 * pages, state_block, width)
    out_cache = poisoned_like(get_codec(out_format).allocate(4, out_block))
    expected_state, expected_out, initial_out = state.clone(), out_cache.clone(), out_cache.clone()
    kw = {"ratio": ratio, "head_dim": head_dim, "out_format": out_format, "profile": "vllm", "eps": 1e-6}
    steps = [(torch.arange(15).repeat(2), torch.arange(2, dtype=torch.int32).repeat_interleave(15)),
             (torch.tensor([15, 15]), torch.tensor([0, 1], dtype=torch.int32))]
    for positions, token_request in steps:
        state_slots, out_slots = _compressor_call(positions, token_request, table, ratio, state_block, out_block)
        kv_score = torch.randn(positions.numel(), width)
        if strided_vectors:
            args = (_column(positions, 0), _column(token_request, 0), _column(state_slots, -1),
                    _column(out_slots, -1))
        else:
            args = (positions, token_request, state_slots, out_slots)
        TritonBackend().compress_insert(kv_score, *args[:2], state, table, args[2], ape, weight, cos_sin,
                                        out_cache, args[3], **kw)
        TritonBackend().compress_insert(kv_score, positions, token_request, expected_state, table.contiguous(),
                                        state_slots, ape, weight, cos_sin, expected_out, out_slots, **kw)
    assert torch.equal(state, expected_state)
    assert torch.equal(_bytes(out_cache), _bytes(expected_out))
    assert not torch.equal(_bytes(out_cache), _bytes(initial_out))  # blocks were written


def test_compress_insert_strided_vectors() -> None:
    _compress_twice(strided_vectors=True, strided_table=False)


def test_compress_insert_strided_block_table() -> None:
    """A column slice ``wide[:, ::2]`` (stride (8, 2)) as state_block_table: the state-pool launch reads the
    decode block's window through it."""
    _compress_twice(strided_vectors=False, strided_table=True)


def test_indexer_q_strided_positions() -> None:
    torch.manual_seed(0)
    index_q = (torch.randn(3, 16, 128) * 3).to(torch.bfloat16)
    weights = torch.randn(3, 16).to(torch.bfloat16)
    positions = torch.tensor([9, 30, 17])
    cos_sin = cos_sin_table(32)
    got = TritonBackend().indexer_q(index_q, weights, _column(positions, 0), cos_sin, profile="vllm")
    want = TritonBackend().indexer_q(index_q, weights, positions, cos_sin, profile="vllm")
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def _indexer_keys(block: int):
    codec = get_codec("indexer_fp8")
    wide = torch.randperm(8).view(2, 4).to(torch.int32)
    cache = codec.allocate(8, block)
    codec.write_rows(cache, torch.arange(8 * block), torch.randn(8 * block, 128))
    return cache, wide


def test_indexer_topk_strided_positions_requests_and_table() -> None:
    torch.manual_seed(0)
    cache, wide = _indexer_keys(block=8)
    positions = torch.tensor([60, 45, 50, 33])
    token_request = torch.tensor([1, 0, 1, 0], dtype=torch.int32)
    q = torch.randn(4, 16, 128).to(torch.bfloat16)
    w = torch.randn(4, 16)
    kw = {"topk": 4, "key_format": "indexer_fp8"}
    got = TritonBackend().indexer_topk(q, w, _column(positions, 0), _column(token_request, 0), cache,
                                       wide[:, ::2], **kw)
    want = TritonBackend().indexer_topk(q, w, positions, token_request, cache, wide[:, ::2].contiguous(), **kw)
    assert torch.equal(got, want) and bool((want >= 0).all())


def test_sparse_attention_strided_lens() -> None:
    torch.manual_seed(0)
    codec = get_codec("fp8_ds_mla")
    swa, extra = codec.allocate(2, 16), codec.allocate(2, 16)
    codec.write_rows(swa, torch.arange(32), torch.randn(32, 512))
    codec.write_rows(extra, torch.arange(32), torch.randn(32, 512))
    num_tokens, heads = 3, 4
    q = torch.randn(num_tokens, heads, 512).to(torch.bfloat16)
    swa_idx = torch.randint(0, 32, (num_tokens, 16), dtype=torch.int32)
    extra_idx = torch.randint(0, 32, (num_tokens, 16), dtype=torch.int32)
    swa_lens = torch.tensor([16, 3, 9], dtype=torch.int32)
    extra_lens = torch.tensor([5, 16, 11], dtype=torch.int32)
    sink = torch.randn(heads)
    kw = {"kv_format": "fp8_ds_mla", "softmax_scale": 512 ** -0.5, "profile": "deepseek"}
    got = TritonBackend().sparse_attention(q, swa, swa_idx, _column(swa_lens, 0), extra, extra_idx,
                                           _column(extra_lens, 0), sink, **kw)
    want = TritonBackend().sparse_attention(q, swa, swa_idx, swa_lens, extra, extra_idx, extra_lens, sink, **kw)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_output_projection_strided_positions() -> None:
    torch.manual_seed(0)
    o = torch.randn(3, 4, 512).to(torch.bfloat16)
    positions = torch.tensor([7, 12, 3])
    wo_a = (torch.randn(32, 4 * 512) * 0.02).to(torch.bfloat16)
    wo_b = (torch.randn(48, 32) * 0.2).to(torch.bfloat16)
    cos_sin = cos_sin_table(16)
    got = TritonBackend().output_projection(o, _column(positions, 0), cos_sin, wo_a, wo_b, fp8_activations=False)
    want = TritonBackend().output_projection(o, positions, cos_sin, wo_a, wo_b, fp8_activations=False)
    assert torch.equal(got, want)


def test_sparse_attention_strided_index_rows() -> None:
    """The stride policy's integer rule: [T, W] index rows whose last dim is not unit-stride (every other
    column of a [T, 2W] tensor, junk in between) are copied in the wrapper, as [T] vectors are (they were
    refused)."""
    torch.manual_seed(0)
    codec = get_codec("fp8_ds_mla")
    swa, extra = codec.allocate(2, 16), codec.allocate(2, 16)
    codec.write_rows(swa, torch.arange(32), torch.randn(32, 512))
    codec.write_rows(extra, torch.arange(32), torch.randn(32, 512))
    q = torch.randn(3, 4, 512).to(torch.bfloat16)
    swa_idx = torch.randint(0, 32, (3, 16), dtype=torch.int32)
    extra_idx = torch.randint(0, 32, (3, 16), dtype=torch.int32)

    def every_other(idx: torch.Tensor) -> torch.Tensor:
        wide = torch.stack([idx, torch.full_like(idx, -1)], 2).flatten(1)[:, ::2]
        assert wide.stride() == (32, 2) and torch.equal(wide, idx)
        return wide

    lens, sink = torch.tensor([16, 3, 9], dtype=torch.int32), torch.randn(4)
    kw = {"kv_format": "fp8_ds_mla", "softmax_scale": 512 ** -0.5, "profile": "deepseek"}
    got = TritonBackend().sparse_attention(q, swa, every_other(swa_idx), lens, extra, every_other(extra_idx), lens,
                                           sink, **kw)
    want = TritonBackend().sparse_attention(q, swa, swa_idx, lens, extra, extra_idx, lens, sink, **kw)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_float_arguments_with_a_strided_last_dim_are_refused() -> None:
    """The stride policy's float rule, for the arguments the wrappers used to copy silently (sink,
    norm_weight, wo_a) or pass to a packing launcher (index_q, the indexer's q and w): a DSV4ValueError
    naming the argument, before any launch."""
    backend = TritonBackend()
    positions = torch.tensor([3, 7])

    def strided(t: torch.Tensor) -> torch.Tensor:  # same values, last-dim stride 2
        wide = torch.stack([t, t], -1).flatten(-2)[..., ::2]
        assert wide.stride(-1) == 2 and torch.equal(wide, t)
        return wide

    def refused(name: str, call) -> None:
        with pytest.raises(DSV4ValueError, match=rf"^{name}: expected unit stride along the last dim"):
            call()

    bf16 = torch.bfloat16
    index_q, weights, cos_sin = torch.randn(2, 16, 128).to(bf16), torch.randn(2, 16), cos_sin_table(16)
    refused("index_q", lambda: backend.indexer_q(strided(index_q), weights, positions, cos_sin, profile="vllm"))
    cache, table = _indexer_keys(block=8)
    kw = {"topk": 4, "key_format": "indexer_fp8"}
    request = torch.tensor([0, 1], dtype=torch.int32)
    refused("q", lambda: backend.indexer_topk(strided(index_q), weights, positions, request, cache, table, **kw))
    refused("w", lambda: backend.indexer_topk(index_q, strided(weights), positions, request, cache, table, **kw))
    swa = get_codec("fp8_ds_mla").allocate(1, 16)
    q, idx, lens = torch.randn(2, 4, 512).to(bf16), torch.zeros(2, 4, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    refused("sink", lambda: backend.sparse_attention(q, swa, idx, lens, None, None, None, strided(torch.randn(4)),
                                                     kv_format="fp8_ds_mla", softmax_scale=0.1, profile="vllm"))
    wo_a, wo_b = torch.randn(32, 4 * 512).to(bf16), torch.randn(48, 32).to(bf16)
    refused("wo_a", lambda: backend.output_projection(q, positions, cos_sin, strided(wo_a), wo_b,
                                                      fp8_activations=False))
    state, out_cache = torch.randn(2, 8, 512), get_codec("indexer_fp8").allocate(1, 4)
    refused("norm_weight", lambda: backend.compress_insert(
        torch.randn(2, 512), positions, torch.zeros(2, dtype=torch.int32), state, torch.tensor([[0]], dtype=torch.int32),
        positions, torch.randn(4, 256), strided(torch.rand(128) + 0.5), cos_sin_table(64), out_cache,
        torch.tensor([-1, 1]), ratio=4, head_dim=128, out_format="indexer_fp8", profile="vllm", eps=1e-6))


def test_fused_topk_slots_normalize_token_request_once(monkeypatch) -> None:
    """indexer_topk_slots copies a strided token_request once and gives both launches that copy (before,
    indexer_topk and local_to_global each copied it); results equal the contiguous call's."""
    from dsv4.backends.triton import topk

    torch.manual_seed(0)
    cache, wide = _indexer_keys(block=8)
    positions = torch.tensor([60, 45, 50, 33])
    token_request = torch.tensor([1, 0, 1, 0], dtype=torch.int32)
    q, w = torch.randn(4, 16, 128).to(torch.bfloat16), torch.randn(4, 16)
    real, seen = topk.local_to_global, []
    monkeypatch.setattr(topk, "local_to_global", lambda local, request, *a: seen.append(request) or real(local, request, *a))
    kw = {"topk": 4, "key_format": "indexer_fp8", "compressed_block_size": 8}
    table = wide.contiguous()
    got = TritonBackend().indexer_topk_slots(q, w, positions, _column(token_request, 0), cache, table, table, **kw)
    want = TritonBackend().indexer_topk_slots(q, w, positions, token_request, cache, table, table, **kw)
    assert seen[0].stride() == (1,) and torch.equal(seen[0], token_request)  # already the unit-stride copy
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and bool((want[1] > 0).all())
    for wrong in ([1, 0, 1, 0], 3):  # not a tensor: indexer_topk's check names it (no AttributeError first)
        with pytest.raises(DSV4TypeError, match="token_request: expected a torch.Tensor"):
            TritonBackend().indexer_topk_slots(q, w, positions, wrong, cache, table, table, **kw)


# -- head-major q / o: x[H, T, 512].transpose(0, 1), stride(1) = T * 512 ------------------------------------
# Kernels address a head as head * stride(1) in int64, so the launcher gets such a view as it is (no copy),
# outputs come out contiguous, and the values are those of the contiguous call. The last tests place the
# heads 2**31 - 2**20 elements apart: an int32 head offset wraps onto NaN-poisoned memory there.
def _head_major(x: torch.Tensor) -> torch.Tensor:
    num_tokens, _, dim = x.shape
    y = x.transpose(0, 1).contiguous().transpose(0, 1)
    assert y.stride() == (dim, num_tokens * dim, 1) and torch.equal(y, x)
    return y


def test_qnorm_rope_insert_head_major_q(monkeypatch) -> None:
    from dsv4.backends.triton import qnorm_rope_insert as kernels

    torch.manual_seed(0)
    num_tokens, heads = 3, 4
    q = torch.randn(num_tokens, heads, 512).to(torch.bfloat16)
    kv = torch.randn(num_tokens, 512).to(torch.bfloat16)
    positions, slots, cos_sin = torch.tensor([5, 6, 7]), torch.tensor([2, 0, 1]), cos_sin_table(16)
    cache = get_codec("fp8_ds_mla").allocate(1, 16)
    expected_cache = cache.clone()
    kw = {"kv_format": "fp8_ds_mla", "eps": 1e-6, "profile": "vllm"}
    seen = first_args(monkeypatch, kernels, "qnorm_rope_insert")
    head_major = _head_major(q)
    got = TritonBackend().qnorm_rope_insert(head_major, kv, positions, cos_sin, cache, slots, **kw)
    want = TritonBackend().qnorm_rope_insert(q, kv, positions, cos_sin, expected_cache, slots, **kw)
    assert seen[0] is head_major  # read in place: no packed copy
    assert got.is_contiguous() and torch.equal(got, want)
    assert torch.equal(_bytes(cache), _bytes(expected_cache))


def test_sparse_attention_head_major_q(monkeypatch) -> None:
    """One split (the kernel's own epilogue) and three (partials merged by the combine kernel)."""
    from dsv4.backends.triton import sparse_attention as kernels

    torch.manual_seed(0)
    codec = get_codec("fp8_ds_mla")
    swa = codec.allocate(2, 16)
    codec.write_rows(swa, torch.arange(32), torch.randn(32, 512))
    num_tokens, heads = 3, 4
    q = torch.randn(num_tokens, heads, 512).to(torch.bfloat16)
    swa_idx = torch.randint(0, 32, (num_tokens, 32), dtype=torch.int32)
    swa_lens = torch.tensor([32, 3, 20], dtype=torch.int32)
    sink = torch.randn(heads)
    seen = first_args(monkeypatch, kernels, "sparse_attention")
    head_major = _head_major(q)
    for splits in (1, 3):
        kw = {"kv_format": "fp8_ds_mla", "softmax_scale": 512 ** -0.5, "profile": "deepseek", "num_splits": splits}
        got = TritonBackend().sparse_attention(head_major, swa, swa_idx, swa_lens, None, None, None, sink, **kw)
        want = TritonBackend().sparse_attention(q, swa, swa_idx, swa_lens, None, None, None, sink, **kw)
        assert seen[-2] is head_major  # read in place: no packed copy
        assert got[0].is_contiguous() and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_output_projection_head_major_o(monkeypatch) -> None:
    from dsv4.backends.triton import output_projection as kernels

    torch.manual_seed(0)
    o = torch.randn(3, 4, 512).to(torch.bfloat16)
    positions, cos_sin = torch.tensor([7, 12, 3]), cos_sin_table(16)
    wo_a = (torch.randn(64, 2 * 512) * 0.02).to(torch.bfloat16)
    wo_b = (torch.randn(48, 64) * 0.2).to(torch.bfloat16)
    seen = first_args(monkeypatch, kernels, "output_projection")
    head_major = _head_major(o)
    got = TritonBackend().output_projection(head_major, positions, cos_sin, wo_a, wo_b, fp8_activations=True)
    want = TritonBackend().output_projection(o, positions, cos_sin, wo_a, wo_b, fp8_activations=True)
    assert seen[0] is head_major  # read in place: no packed copy
    assert torch.equal(got, want)


_FAR_HEAD_STRIDE = 2**31 - 2**20  # < 2**31, so Triton passes it as an int32 argument
_POISON = 2**22  # elements before the view: head 2's int32 offset 2 * stride wraps to -2**21


def _far_heads(x: torch.Tensor) -> torch.Tensor:
    """[T, 3, D] ``x`` as a view whose heads lie ``_FAR_HEAD_STRIDE`` elements apart (8 GiB of address
    space, untouched but for the rows and the poison), the ``_POISON`` elements before it NaN: head 2 at
    ``2 * stride`` in int32 reads NaN."""
    num_tokens, heads, dim = x.shape
    assert heads == 3 and 2 * _FAR_HEAD_STRIDE >= 2**31 > _FAR_HEAD_STRIDE
    storage = torch.empty(_POISON + (heads - 1) * _FAR_HEAD_STRIDE + num_tokens * dim, dtype=x.dtype)
    storage[:_POISON].fill_(float("nan"))
    far = storage.as_strided(x.shape, (dim, _FAR_HEAD_STRIDE, 1), _POISON)
    far.copy_(x)
    return far


@pytest.mark.parametrize("kernel", ["qnorm_rope_insert", "sparse_attention", "inverse_rope"])
def test_head_offsets_are_int64(kernel: str) -> None:
    """The launchers themselves (no wrapper copy to hide behind), sparse attention with one split and three
    (the combine kernel): on a far-heads view and on a contiguous copy, bit-equal and finite."""
    from dsv4.backends.triton import output_projection, qnorm_rope_insert, sparse_attention
    from dsv4.backends.triton.layout import latent_layout

    torch.manual_seed(0)
    q = torch.randn(2, 3, 512).to(torch.bfloat16)
    far = _far_heads(q)
    positions, cos_sin = torch.tensor([3, 5]), cos_sin_table(16)
    cache = get_codec("fp8_ds_mla").allocate(2, 16)
    get_codec("fp8_ds_mla").write_rows(cache, torch.arange(32), torch.randn(32, 512))
    layout = latent_layout("fp8_ds_mla", cache)
    if kernel == "qnorm_rope_insert":
        kv, slots = torch.randn(2, 512).to(torch.bfloat16), torch.tensor([-1, -1])
        kw = {"eps": 1e-6, "deepseek_qnorm": True}
        got = qnorm_rope_insert.qnorm_rope_insert(far, kv, positions, cos_sin, cache, layout, slots, **kw)
        want = qnorm_rope_insert.qnorm_rope_insert(q, kv, positions, cos_sin, cache, layout, slots, **kw)
        assert bool(want.isfinite().all()) and torch.equal(got, want)
    elif kernel == "sparse_attention":
        indices = torch.randint(0, 32, (2, 32), dtype=torch.int32)
        lens, sink = torch.tensor([32, 7], dtype=torch.int32), torch.randn(3)
        for splits in (1, 3):
            kw = {"softmax_scale": 512 ** -0.5, "probs_bf16": True, "num_splits": splits}
            args = (cache, layout, indices, lens, None, None, None, None, sink)
            got = sparse_attention.sparse_attention(far, *args, **kw)
            want = sparse_attention.sparse_attention(q, *args, **kw)
            assert bool(want[0].isfinite().all()) and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    else:
        kw = {"rope_dim": 64, "fp8_activations": True, "fp8_block": 128}
        got = output_projection.inverse_rope(far, positions, cos_sin, **kw)
        want = output_projection.inverse_rope(q, positions, cos_sin, **kw)
        assert bool(want.isfinite().all()) and torch.equal(got, want)


# -- cos_sin of another width than SPEC §1's 64 rope dims ---------------------------------------------------
@pytest.mark.parametrize("width", [32, 128])
def test_cos_sin_of_another_width_is_refused(width: int) -> None:
    """Every op that rotates refuses a [P, 32] or [P, 128] table before launching: before, indexer_q,
    output_projection and the indexer-key compress_insert took the table's width as the rope width."""
    torch.manual_seed(0)
    wrong = cos_sin_table(64).repeat(1, 2) if width == 128 else cos_sin_table(64)[:, :32].contiguous()
    positions = torch.tensor([3, 7])
    backend = TritonBackend()
    match = r"cos_sin: expected shape \[\*, 64\]"
    with pytest.raises(DSV4ValueError, match=match):
        backend.indexer_q(torch.randn(2, 16, 128).to(torch.bfloat16), torch.randn(2, 16), positions, wrong,
                          profile="vllm")
    with pytest.raises(DSV4ValueError, match=match):
        backend.output_projection(torch.randn(2, 4, 512).to(torch.bfloat16), positions, wrong,
                                  torch.randn(32, 4 * 512).to(torch.bfloat16), torch.randn(48, 32).to(torch.bfloat16),
                                  fp8_activations=False)
    cache = get_codec("fp8_ds_mla").allocate(1, 16)
    with pytest.raises(DSV4ValueError, match=match):
        backend.qnorm_rope_insert(torch.randn(2, 4, 512).to(torch.bfloat16), torch.randn(2, 512).to(torch.bfloat16),
                                  positions, wrong, cache, torch.tensor([0, 1]), kv_format="fp8_ds_mla", eps=1e-6)
    state = torch.randn(2, 8, 512)
    out_cache = poisoned_like(get_codec("indexer_fp8").allocate(1, 4))
    state_before, out_before = state.clone(), out_cache.clone()
    with pytest.raises(DSV4ValueError, match=match):
        backend.compress_insert(torch.randn(2, 512), positions, torch.zeros(2, dtype=torch.int32), state,
                                torch.tensor([[0]], dtype=torch.int32), positions, torch.randn(4, 256),
                                torch.rand(128) + 0.5, wrong, out_cache, torch.tensor([-1, 1]), ratio=4,
                                head_dim=128, out_format="indexer_fp8", profile="vllm", eps=1e-6)
    assert torch.equal(state, state_before) and torch.equal(_bytes(out_cache), _bytes(out_before))


def test_probe_refuses_a_triton_older_than_its_kernels(monkeypatch) -> None:
    """Triton 3.5 cannot compile the kernels (tools/target_compile.py: no gl.num_warps, the chunked top-k's
    arange): the backend says so in one line instead of failing at its first launch; 3.6 and later pass."""
    import triton
    from dsv4.backends.triton.capabilities import MIN_TRITON, probe_reasons

    assert MIN_TRITON == (3, 6)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for old in ("3.5.1", "3.2.0", "2.3.1"):
        monkeypatch.setattr(triton, "__version__", old)
        assert probe_reasons() == [f"triton {old} is older than 3.6, the oldest its kernels compile with"]
    for new in ("3.6.0", "3.7.0+git1a2b", "3.10.0", "4.0.0"):
        monkeypatch.setattr(triton, "__version__", new)
        assert probe_reasons() == []
