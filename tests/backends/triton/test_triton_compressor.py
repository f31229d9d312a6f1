"""compress_insert (SPEC §5): state rows and compressed cache rows vs dsv4.reference."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from _triton_helpers import assert_cache_equivalent, assert_close, cos_sin_table, poisoned_like
from dsv4 import reference
from dsv4.backends.triton import TritonBackend
from dsv4.backends.triton._common import fp4_code, simulate_fp4
from dsv4.backends.triton.compressor_finish import _e2m1_code, _sylvester
from dsv4.codecs import get_codec
from dsv4.hadamard import hadamard_matrix
from hypothesis import given, settings
from hypothesis import strategies as st

CASES = [  # (ratio, head_dim, out_format, profile)
    (4, 512, "fp8_ds_mla", "deepseek"),
    (4, 512, "bf16", "vllm"),
    (128, 512, "fp8_ds_mla", "vllm"),
    (4, 128, "indexer_mxfp4", "deepseek"),
    (4, 128, "indexer_fp8", "vllm"),
]


def _slots(positions, token_request, table, state_block, out_table, out_block, ratio):
    """(state_slots, out_slots) int64 of a call's tokens: every token's state row, and the compressed-cache
    slot of each token that closes a block (-1 elsewhere), through the requests' page tables."""
    state_slots = table[token_request.long(), positions // state_block].long() * state_block \
        + positions % state_block
    entry = positions // ratio
    out_slots = torch.where((positions + 1) % ratio == 0,
                            out_table[token_request.long(), entry // out_block] * out_block + entry % out_block, -1)
    return state_slots, out_slots.to(torch.int64)


def _run_steps(backend_fn, steps, state, out_cache, common) -> None:
    for step in steps:
        backend_fn(step["kv_score"], step["positions"], step["token_request"], state, common["table"],
                   step["state_slots"], common["ape"], common["norm_weight"], common["cos_sin"], out_cache,
                   step["out_slots"], ratio=common["ratio"], head_dim=common["head_dim"],
                   out_format=common["out_format"], profile=common["profile"], eps=1e-6)


@pytest.mark.parametrize("ratio,head_dim,out_format,profile", CASES)
def test_chunked_prefill_then_decode(ratio: int, head_dim: int, out_format: str, profile: str) -> None:
    coff = 2 if ratio == 4 else 1
    width = 2 * coff * head_dim
    state_block, out_block = 16, 8
    # Two requests: lengths chosen so several blocks close, split into a prefill chunk, a second
    # chunk and single-token decode steps, mixed in one batch (SPEC §5.4).
    lengths = [2 * ratio + 3, ratio + 1] if ratio == 4 else [ratio + 2, ratio - 1]
    pages = max(lengths) // state_block + 2
    table = torch.randperm(2 * pages).view(2, pages).to(torch.int32)
    out_pages = max(lengths) // ratio // out_block + 1
    out_table = torch.randperm(2 * out_pages)[: 2 * out_pages].view(2, out_pages)
    splits = [lengths[0] - 2, 1, 1], [lengths[1] - 1, 1, 0]
    steps, done = [], [0, 0]
    for s in range(3):
        pos, req = [], []
        for r in range(2):
            n = splits[r][s]
            pos += list(range(done[r], done[r] + n))
            req += [r] * n
            done[r] += n
        positions = torch.tensor(pos, dtype=torch.int64)
        token_request = torch.tensor(req, dtype=torch.int32)
        state_slots, out_slots = _slots(positions, token_request, table, state_block, out_table, out_block, ratio)
        steps.append({"kv_score": torch.randn(len(pos), width) * 2, "positions": positions,
                      "token_request": token_request, "state_slots": state_slots, "out_slots": out_slots})
    common = {"table": table, "ape": torch.randn(ratio, coff * head_dim), "ratio": ratio, "head_dim": head_dim,
              "norm_weight": torch.rand(head_dim) + 0.5, "cos_sin": cos_sin_table(512), "out_format": out_format,
              "profile": profile}
    state = torch.randn(2 * pages, state_block, width)
    out_cache = poisoned_like(get_codec(out_format).allocate(2 * out_pages, out_block))
    ref_state, ref_out = state.clone(), out_cache.clone()
    _run_steps(TritonBackend().compress_insert, steps, state, out_cache, common)
    _run_steps(reference.compress_insert, steps, ref_state, ref_out, common)
    assert_close("state_cache", state, ref_state, "compress_insert", "state_cache")
    written = torch.cat([s["out_slots"] for s in steps])
    written = written[written >= 0]
    assert written.numel() >= (2 if ratio == 4 else 1)
    assert_cache_equivalent("out_cache", out_format, out_cache, ref_out, written)


@pytest.mark.parametrize("ratio,head_dim,out_format,profile,order", [
    (4, 512, "fp8_ds_mla", "deepseek", "reversed"),
    (4, 128, "indexer_mxfp4", "deepseek", "padding-inside"),
    (128, 512, "bf16", "vllm", "reversed"),
    (4, 128, "indexer_fp8", "vllm", "padding-tail"),
])
def test_token_order(ratio: int, head_dim: int, out_format: str, profile: str, order: str) -> None:
    """One call whose tokens are not one ascending run per request (reversed, or a padding token inside
    a run) must still pool rows written by this same call (fallback path); a padding token at the
    tail keeps the fused path. Each compared with the reference on fresh random rows."""
    coff = 2 if ratio == 4 else 1
    width = 2 * coff * head_dim
    state_block, out_block = 8, 4
    length = 3 * ratio if ratio == 4 else ratio + 4
    pages = length // state_block + 2
    table = torch.randperm(2 * pages).view(2, pages).to(torch.int32)
    out_pages = length // ratio // out_block + 1
    out_table = torch.randperm(2 * out_pages).view(2, out_pages)
    positions = torch.arange(length).repeat(2)
    token_request = torch.arange(2, dtype=torch.int32).repeat_interleave(length)
    state_slots, out_slots = _slots(positions, token_request, table, state_block, out_table, out_block, ratio)
    perm = torch.arange(2 * length)
    if order == "reversed":
        perm = perm.flip(0)
    pad = torch.tensor([0]), torch.tensor([0], dtype=torch.int32), torch.tensor([-1]), torch.tensor([-1])
    cols = [positions[perm], token_request[perm], state_slots[perm], out_slots[perm]]
    if order != "reversed":
        at = 5 if order == "padding-inside" else 2 * length
        cols = [torch.cat([c[:at], x, c[at:]]) for c, x in zip(cols, pad)]
    positions, token_request, state_slots, out_slots = cols
    kv_score = torch.randn(positions.numel(), width) * 2
    common = (torch.randn(ratio, coff * head_dim), torch.rand(head_dim) + 0.5, cos_sin_table(512))
    state = torch.randn(2 * pages, state_block, width)
    out_cache = poisoned_like(get_codec(out_format).allocate(2 * out_pages, out_block))
    ref_state, ref_out = state.clone(), out_cache.clone()
    kw = {"ratio": ratio, "head_dim": head_dim, "out_format": out_format, "profile": profile, "eps": 1e-6}
    TritonBackend().compress_insert(kv_score, positions, token_request, state, table, state_slots, *common[:1],
                                    common[1], common[2], out_cache, out_slots, **kw)
    reference.compress_insert(kv_score, positions, token_request, ref_state, table, state_slots, *common[:1],
                              common[1], common[2], ref_out, out_slots, **kw)
    assert_close("state_cache", state, ref_state, "compress_insert", "state_cache")
    written = out_slots[out_slots >= 0]
    assert_cache_equivalent("out_cache", out_format, out_cache, ref_out, written)


@pytest.mark.parametrize("ratio,head_dim,out_format,profile,fuse,pool_group,extra", [
    (4, 512, "fp8_ds_mla", "deepseek", True, 4, {}),
    (4, 512, "fp8_ds_mla", "deepseek", True, 16, {"_early": True}),
    (4, 128, "indexer_mxfp4", "deepseek", False, 1, {}),
    (4, 128, "indexer_mxfp4", "deepseek", True, 16, {}),
    (128, 512, "fp8_ds_mla", "deepseek", True, 1, {}),
    (128, 512, "bf16", "vllm", True, 16, {}),
])
def test_fused_and_state_paths(monkeypatch, ratio: int, head_dim: int, out_format: str, profile: str, fuse: bool,
                                pool_group: int, extra: dict) -> None:
    """Three calls of two requests whose chunks start at aligned and unaligned positions and token
    indices, so that blocks are finished by the fused launch (whole window in this call at the
    expected token indices), and by the state-pool launch (window spanning calls, groups not aligned
    with the request), with either launch shape forced; each compared with the reference."""
    import functools

    from dsv4.backends.triton import compressor

    monkeypatch.setattr(compressor, "compress_insert", functools.partial(
        compressor.compress_insert, _fuse=fuse, _pool_group=pool_group, **extra))
    coff = 2 if ratio == 4 else 1
    width = 2 * coff * head_dim
    state_block, out_block = 16, 4
    # request 0: [0, a) [a, b) [b, c); request 1: [0, x) [x, y) [y, z) (token offsets then unaligned)
    cuts = ([0, 13, 24, 33], [0, 3, 17, 22]) if ratio == 4 else ([0, 261, 262, 300], [0, 131, 140, 257])
    length = max(cuts[0][-1], cuts[1][-1])
    pages = length // state_block + 2
    table = torch.randperm(2 * pages).view(2, pages).to(torch.int32)
    out_pages = length // ratio // out_block + 1
    out_table = torch.randperm(2 * out_pages).view(2, out_pages)
    common = (torch.randn(ratio, coff * head_dim), torch.rand(head_dim) + 0.5, cos_sin_table(512))
    state = torch.randn(2 * pages, state_block, width)
    out_cache = poisoned_like(get_codec(out_format).allocate(2 * out_pages, out_block))
    ref_state, ref_out = state.clone(), out_cache.clone()
    kw = {"ratio": ratio, "head_dim": head_dim, "out_format": out_format, "profile": profile, "eps": 1e-6}
    written = []
    for step in range(3):
        positions = torch.cat([torch.arange(cuts[r][step], cuts[r][step + 1]) for r in range(2)])
        token_request = torch.cat([torch.full((cuts[r][step + 1] - cuts[r][step],), r, dtype=torch.int32)
                                   for r in range(2)])
        state_slots, out_slots = _slots(positions, token_request, table, state_block, out_table, out_block, ratio)
        written.append(out_slots[out_slots >= 0])
        kv_score = torch.randn(positions.numel(), width) * 2
        args = (kv_score, positions, token_request)
        TritonBackend().compress_insert(*args, state, table, state_slots, common[0], common[1], common[2],
                                        out_cache, out_slots, **kw)
        reference.compress_insert(*args, ref_state, table, state_slots, common[0], common[1], common[2], ref_out,
                                  out_slots, **kw)
    assert_close("state_cache", state, ref_state, "compress_insert", "state_cache")
    assert_cache_equivalent("out_cache", out_format, out_cache, ref_out, torch.cat(written))



class _NoLaunch:
    """Stands in for a kernel that must not be launched."""

    def __getitem__(self, grid):
        raise AssertionError("the state-pool kernel was launched")


@pytest.mark.parametrize("mode", ["second_off", "promise"])
@pytest.mark.parametrize("ratio,head_dim,out_format,profile,lengths", [
    (4, 512, "fp8_ds_mla", "deepseek", [13, 22, 9, 30]),  # token offsets 0, 13, 35, 44
    (4, 128, "indexer_mxfp4", "deepseek", [13, 22, 9, 30]),
    (128, 512, "fp8_ds_mla", "vllm", [300, 270, 141]),  # token offsets 0, 300, 570
])
def test_first_launch_finishes_unaligned_requests(monkeypatch, ratio: int, head_dim: int, out_format: str,
                                                  profile: str, lengths: list[int], mode: str) -> None:
    """Several requests prefilled from position 0 in one call, packed back to back, so most start at token
    indices that are not multiples of r: every block's window is in the call, so the first launch alone
    (fused; second launch switched off, or skipped on the caller's ``windows_in_call`` promise, with the
    state-pool kernel replaced by one that fails if launched) must write every compressed row, equal to
    the reference's."""
    import functools

    from dsv4.backends.triton import compressor

    if mode == "second_off":
        ours = functools.partial(compressor.compress_insert, _fuse=True, _second=False)
    else:
        ours = functools.partial(compressor.compress_insert, _fuse=True)
        monkeypatch.setattr(compressor, "_state_pool_kernel", _NoLaunch())
    monkeypatch.setattr(compressor, "compress_insert", ours)
    coff = 2 if ratio == 4 else 1
    width = 2 * coff * head_dim
    state_block, out_block = 16, 4
    pages = max(lengths) // state_block + 2
    table = torch.randperm(len(lengths) * pages).view(len(lengths), pages).to(torch.int32)
    out_pages = max(lengths) // ratio // out_block + 1
    out_table = torch.randperm(len(lengths) * out_pages).view(len(lengths), out_pages)
    positions = torch.cat([torch.arange(n) for n in lengths])
    token_request = torch.cat([torch.full((n,), r, dtype=torch.int32) for r, n in enumerate(lengths)])
    state_slots, out_slots = _slots(positions, token_request, table, state_block, out_table, out_block, ratio)
    kv_score = torch.randn(positions.numel(), width) * 2
    ape, weight, cos_sin = torch.randn(ratio, coff * head_dim), torch.rand(head_dim) + 0.5, cos_sin_table(1024)
    state = torch.randn(len(lengths) * pages, state_block, width)
    out_cache = poisoned_like(get_codec(out_format).allocate(len(lengths) * out_pages, out_block))
    ref_state, ref_out = state.clone(), out_cache.clone()
    kw = {"ratio": ratio, "head_dim": head_dim, "out_format": out_format, "profile": profile, "eps": 1e-6}
    args = (kv_score, positions, token_request)
    TritonBackend().compress_insert(*args, state, table, state_slots, ape, weight, cos_sin, out_cache, out_slots, **kw,
                                    windows_in_call=mode == "promise")
    reference.compress_insert(*args, ref_state, table, state_slots, ape, weight, cos_sin, ref_out, out_slots, **kw)
    assert_close("state_cache", state, ref_state, "compress_insert", "state_cache")
    written = out_slots[out_slots >= 0]
    assert written.numel() == sum(n // ratio for n in lengths)
    assert_cache_equivalent("out_cache", out_format, out_cache, ref_out, written)


def test_promise_keeps_the_second_launch_where_the_first_does_not_pool(monkeypatch) -> None:
    """r = 128 below 8192 tokens does not fuse: the first launch only saves, so the state-pool launch must
    run even under the ``windows_in_call`` promise (a fresh two-request prefill; every block checked)."""
    from dsv4.backends.triton import compressor

    launched = []
    real = compressor._state_pool_kernel

    class _Spy:
        def __getitem__(self, grid):
            launched.append(grid)
            return real[grid]

    monkeypatch.setattr(compressor, "_state_pool_kernel", _Spy())
    lengths, ratio, head_dim, out_format = [260, 131], 128, 512, "bf16"
    state_block, out_block = 16, 4
    pages = max(lengths) // state_block + 2
    table = torch.randperm(len(lengths) * pages).view(len(lengths), pages).to(torch.int32)
    out_table = torch.randperm(len(lengths) * 2).view(len(lengths), 2)
    positions = torch.cat([torch.arange(n) for n in lengths])
    token_request = torch.cat([torch.full((n,), r, dtype=torch.int32) for r, n in enumerate(lengths)])
    state_slots, out_slots = _slots(positions, token_request, table, state_block, out_table, out_block, ratio)
    args = (torch.randn(positions.numel(), 2 * head_dim) * 2, positions, token_request)
    common = (torch.randn(ratio, head_dim), torch.rand(head_dim) + 0.5, cos_sin_table(512))
    state = torch.randn(len(lengths) * pages, state_block, 2 * head_dim)
    out_cache = poisoned_like(get_codec(out_format).allocate(len(lengths) * 2, out_block))
    ref_state, ref_out = state.clone(), out_cache.clone()
    kw = {"ratio": ratio, "head_dim": head_dim, "out_format": out_format, "profile": "vllm", "eps": 1e-6}
    TritonBackend().compress_insert(*args, state, table, state_slots, *common, out_cache, out_slots, **kw,
                                    windows_in_call=True)
    reference.compress_insert(*args, ref_state, table, state_slots, *common, ref_out, out_slots, **kw)
    assert len(launched) == 1
    written = out_slots[out_slots >= 0]
    assert written.numel() == 3
    assert_cache_equivalent("out_cache", out_format, out_cache, ref_out, written)


@settings(max_examples=8, deadline=None)
@given(data=st.data(), ratio=st.sampled_from([4, 128]), pool_group=st.sampled_from([1, 4, 16]))
def test_packed_chunked_batches_match_reference(data, ratio: int, pool_group: int) -> None:
    """Random packed batches: 2-3 requests, each prefilled over two calls cut at a random position (so chunks
    start at unaligned positions and token indices), then one decode call; the fused first launch forced
    on and a random second-launch group size, so blocks split between the launches in every way the group
    flags must carry; each call carries the ``windows_in_call`` promise where it holds (the first). r=4: indexer fp8 keys (d=128), r=128: bf16 rows (d=512), the fastest formats under
    the interpreter; against the reference: state exact, cache within one e4m3 ULP."""
    import functools

    from dsv4.backends.triton import compressor

    n_req = data.draw(st.integers(2, 3), label="requests")
    low, high = (5, 30) if ratio == 4 else (130, 300)
    lengths = [data.draw(st.integers(low, high), label=f"length {r}") for r in range(n_req)]
    cuts = [data.draw(st.integers(1, n - 1), label=f"cut {r}") for r, n in enumerate(lengths)]
    head_dim, out_format, profile = (128, "indexer_fp8", "vllm") if ratio == 4 else (512, "bf16", "vllm")
    coff = 2 if ratio == 4 else 1
    width = 2 * coff * head_dim
    state_block, out_block = 16, 4
    pages = (max(lengths) + 1) // state_block + 2
    table = torch.randperm(n_req * pages).view(n_req, pages).to(torch.int32)
    out_pages = (max(lengths) + 1) // ratio // out_block + 1
    out_table = torch.randperm(n_req * out_pages).view(n_req, out_pages)
    ape, weight, cos_sin = torch.randn(ratio, coff * head_dim), torch.rand(head_dim) + 0.5, cos_sin_table(512)
    state = torch.randn(n_req * pages, state_block, width)
    out_cache = poisoned_like(get_codec(out_format).allocate(n_req * out_pages, out_block))
    ref_state, ref_out = state.clone(), out_cache.clone()
    kw = {"ratio": ratio, "head_dim": head_dim, "out_format": out_format, "profile": profile, "eps": 1e-6}
    ours = functools.partial(compressor.compress_insert, _fuse=True, _pool_group=pool_group)
    spans = [[(0, c) for c in cuts], [(c, n) for c, n in zip(cuts, lengths)], [(n, n + 1) for n in lengths]]
    written = []
    for call in spans:
        positions = torch.cat([torch.arange(a, b) for a, b in call])
        token_request = torch.cat([torch.full((b - a,), r, dtype=torch.int32) for r, (a, b) in enumerate(call)])
        state_slots, out_slots = _slots(positions, token_request, table, state_block, out_table, out_block, ratio)
        written.append(out_slots[out_slots >= 0])
        args = (torch.randn(positions.numel(), width) * 2, positions, token_request)
        # the promise StepMetadata.windows_in_step makes: each request with a closing position starts at 0
        in_call = all(a == 0 or b // ratio == a // ratio for a, b in call)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(compressor, "compress_insert", ours)
            TritonBackend().compress_insert(*args, state, table, state_slots, ape, weight, cos_sin, out_cache,
                                            out_slots, **kw, windows_in_call=in_call)
        reference.compress_insert(*args, ref_state, table, state_slots, ape, weight, cos_sin, ref_out, out_slots,
                                  **kw)
    assert_close("state_cache", state, ref_state, "compress_insert", "state_cache")
    assert_cache_equivalent("out_cache", out_format, out_cache, ref_out, torch.cat(written))


@triton.jit
def _codes_kernel(x_ptr, want_ptr, got_ptr, h_ptr, N: tl.constexpr, H: tl.constexpr):
    i = tl.arange(0, N)
    x = tl.load(x_ptr + i)
    q = simulate_fp4(x)
    tl.store(want_ptr + i, fp4_code(tl.abs(q)) | ((q < 0) | ((q == 0) & (x < 0))).to(tl.int32) * 8)
    tl.store(got_ptr + i, _e2m1_code(x))
    j = tl.arange(0, H)
    tl.store(h_ptr + j[:, None] * H + j[None, :], _sylvester(H))


def test_e2m1_code_and_sylvester() -> None:
    """The bit-level e2m1 encoder equals ``simulate_fp4`` + ``fp4_code`` (ties, saturation, signed zeros),
    and the in-register Sylvester factors equal ``hadamard_matrix``."""
    n = 4096
    grid = torch.arange(-64, 65, dtype=torch.float32) / 8  # every multiple of 1/8 in [-8, 8]: all ties
    special = torch.tensor([0.0, -0.0, 5.0, -5.0, 6.5, 100.0, 1e-30, -1e-30, 1e-45, 0.2500001, 0.7499999])
    x = torch.cat([grid, special, torch.randn(n - grid.numel() - special.numel()) * 3])
    want, got = torch.zeros(n, dtype=torch.int32), torch.zeros(n, dtype=torch.int32)
    h = torch.zeros(16, 16)
    _codes_kernel[(1,)](x, want, got, h, N=n, H=16)
    assert torch.equal(want, got)
    assert torch.equal(h, hadamard_matrix(16))
