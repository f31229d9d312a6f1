"""indexer_q and indexer_topk (SPEC §6) vs dsv4.reference; top-k compared tie-aware (SPEC §13)."""
from __future__ import annotations

import pytest
import torch
from _triton_helpers import assert_close, cos_sin_table
from dsv4 import reference
from dsv4.backends.triton import TritonBackend
from dsv4.codecs import get_codec
from dsv4.reference.indexer import indexer_scores


@pytest.mark.parametrize("profile", ["deepseek", "vllm"])
def test_indexer_q(profile: str) -> None:
    num_tokens, heads = 3, 64
    index_q = (torch.randn(num_tokens, heads, 128) * 3).to(torch.bfloat16)
    weights = torch.randn(num_tokens, heads).to(torch.bfloat16)
    positions = torch.randint(0, 1000, (num_tokens,), dtype=torch.int64)
    cos_sin = cos_sin_table(1024)
    q, w = TritonBackend().indexer_q(index_q, weights, positions, cos_sin, profile=profile)
    q_ref, w_ref = reference.indexer_q(index_q, weights, positions, cos_sin, profile=profile)
    assert q.dtype == torch.bfloat16 and w.dtype == torch.float32
    assert_close("q", q, q_ref, "indexer_q", "q")
    assert_close("w", w, w_ref, "indexer_q", "w")


@pytest.mark.parametrize("profile", ["deepseek", "vllm"])
def test_indexer_q_block_is_the_q_rule(monkeypatch: pytest.MonkeyPatch, profile: str) -> None:
    """The fp4 q block the kernel gets is the profile's q rule (``specs.numerics.INDEXER_Q_SCALE_BLOCK``),
    not the mxfp4 key format's block (equal today; a changed q rule must reach the kernel)."""
    from dsv4.backends.triton import indexer as triton_indexer
    from dsv4.specs.numerics import INDEXER_Q_SCALE_BLOCK, get_profile

    seen: list[int] = []

    def spy(*args, fp4_block: int, **kwargs):
        seen.append(fp4_block)

    monkeypatch.setattr(triton_indexer, "indexer_q", spy)
    monkeypatch.setitem(INDEXER_Q_SCALE_BLOCK, "fp4", 16)
    index_q = torch.randn(2, 4, 128).to(torch.bfloat16)
    TritonBackend().indexer_q(index_q, torch.randn(2, 4), torch.arange(2), cos_sin_table(8), profile=profile)
    assert seen == [16 if get_profile(profile).indexer_quant == "fp4" else 128]


@pytest.mark.parametrize("key_format", ["indexer_mxfp4", "indexer_fp8"])
def test_indexer_topk_tie_aware(key_format: str) -> None:
    topk, block, heads = 8, 16, 64
    codec = get_codec(key_format)
    # Request 0: 90 tokens of context (22 entries > topk); request 1: short (shortcut path).
    table = torch.randperm(6)[:4].view(2, 2).to(torch.int32)
    cache = codec.allocate(6, block)
    keys = torch.randn(2 * 2 * block, 128)
    slots = (table.long()[:, :, None] * block + torch.arange(block)).flatten()
    codec.write_rows(cache, slots, keys)
    positions = torch.tensor([89, 60, 30, 20, 3], dtype=torch.int64)
    token_request = torch.tensor([0, 0, 0, 1, 1], dtype=torch.int32)
    q = torch.randn(5, heads, 128).to(torch.bfloat16)
    w = torch.randn(5, heads)
    out = TritonBackend().indexer_topk(q, w, positions, token_request, cache, table, topk=topk,
                                       key_format=key_format)
    assert out.shape == (5, topk) and out.dtype == torch.int32
    for t in range(5):
        visible = int(positions[t] + 1) // 4
        row = out[t]
        valid = row[row >= 0]
        assert torch.all(row[: valid.numel()] >= 0), "valid entries first"
        assert valid.numel() == min(topk, visible)
        assert valid.unique().numel() == valid.numel() and int(valid.max()) < visible
        if visible <= topk:
            continue
        r = int(token_request[t])
        entry_slots = table[r].long()[torch.arange(visible) // block] * block + torch.arange(visible) % block
        scores = indexer_scores(q[t:t + 1], w[t:t + 1], codec.read_rows(cache, entry_slots))[0]
        kth = scores.sort(descending=True).values[topk - 1]
        slack = 1e-3 * (scores.max() - scores.min())
        assert torch.all(scores[valid.long()] >= kth - slack)


@pytest.mark.parametrize("key_format,block_entries,num_splits,served,tma,mx_scaled", [
    ("indexer_mxfp4", 16, 3, False, None, None),  # several programs per token, ranges ending mid-page
    ("indexer_mxfp4", 32, 1, False, None, None),
    ("indexer_fp8", 16, 2, False, None, None),
    ("indexer_mxfp4", 16, 3, True, None, False),  # served q: the e4m3 path (mxfp4: bf16 MMAs on decoded keys)
    ("indexer_mxfp4", 16, 3, True, None, True),  # ... mxfp4 through tl.dot_scaled
    ("indexer_fp8", 16, 2, True, True, None),  # fp8 keys as TMA boxes, two a page
    ("indexer_fp8", 16, 2, True, False, None),  # ... as pointer loads
    ("indexer_fp8", 64, 1, True, True, None),  # one box a page
])
def test_indexer_logits_vs_reference(key_format: str, block_entries: int, num_splits: int, served: bool,
                                     tma: bool | None, mx_scaled: bool | None) -> None:
    """Every logit of the tiled kernel vs float64 reference scores (SPEC §6.3): visible entries scored,
    -inf past (p+1)//4 and on unmapped pages (an out-of-bounds TMA box), 0 / -inf on short-context rows.
    ``served``: q and w from ``indexer_q`` (exact e4m3 codes: the fp8 / mxfp4 tensor-core paths)."""
    from dsv4.backends.triton.indexer import indexer_logits
    from dsv4.backends.triton.indexer_tma import tma_usable
    from dsv4.backends.triton.layout import key_layout

    # served: two 16-entry tiles a page (fp8: TMA boxes at rows 0 and 16); 64-entry tiles: one a page
    block = 64 if block_entries == 64 else 32 if served else 16
    pages, heads, topk = max(96 // block, 2), 64, 8
    codec = get_codec(key_format)
    table = torch.randperm(12)[: 2 * pages].view(2, pages).to(torch.int32)
    table[1, 80 // block - 1] = -1  # an unmapped page inside request 1's visible range
    cache = codec.allocate(12, block)
    mapped = table.clamp_min(0).long()
    slots = (mapped[:, :, None] * block + torch.arange(block)).flatten()
    # Row magnitudes spread over ~2**-10 .. 2**10 so the UE8M0 / fp32 scales differ per block and row.
    keys = torch.randn(slots.numel(), 128) * torch.exp2(torch.randint(-10, 11, (slots.numel(), 4)).float()
                                                        ).repeat_interleave(32, 1)
    codec.write_rows(cache, slots, keys)
    positions = torch.tensor([319, 250, 131, 20, 319, 290], dtype=torch.int64)  # visible 80, 62, 33, 5, 80, 72
    token_request = torch.tensor([0, 0, 1, 1, 1, 1], dtype=torch.int32)
    q = (torch.randn(6, heads, 128) * 2).to(torch.bfloat16)
    w = torch.randn(6, heads)
    if served:
        q, w = reference.indexer_q(q, w.to(torch.bfloat16), positions, cos_sin_table(320),
                                   profile="deepseek" if key_format == "indexer_mxfp4" else "vllm")
    layout = key_layout(key_format, cache)
    assert not tma or tma_usable(cache, layout, block_entries)  # the box path is the one tested
    logits = indexer_logits(q, w, positions, token_request, cache, layout, table, topk=topk, ratio=4,
                            block_entries=block_entries, num_splits=num_splits, tma=tma, mx_scaled=mx_scaled)
    assert logits.shape == (6, pages * block)
    for t in range(6):
        visible = int(positions[t] + 1) // 4
        r = int(token_request[t])
        expected = torch.full((pages * block,), float("-inf"), dtype=torch.float64)
        if visible <= topk:
            expected[:visible] = 0.0
        else:
            e = torch.arange(visible)
            page = table[r].long()[e // block]
            ok = page >= 0
            entry_slots = page[ok] * block + e[ok] % block
            expected[e[ok]] = indexer_scores(q[t:t + 1].double(), w[t:t + 1].double(),
                                             codec.read_rows(cache, entry_slots).double())[0]
        got = logits[t].double()
        finite = torch.isfinite(expected)
        assert torch.equal(torch.isfinite(got), finite) and torch.equal(got[~finite], expected[~finite])
        if finite.any():  # (with 64-entry pages, request 1's short rows lie wholly on the unmapped page)
            scale = expected[finite].abs().max().clamp_min(1e-30)
            assert (got[finite] - expected[finite]).abs().max() <= 1e-5 * scale, f"token {t}"


@pytest.mark.parametrize("key_format", ["indexer_mxfp4", "indexer_fp8"])
def test_indexer_logits_fp8_path(key_format: str) -> None:
    """q as indexer_q leaves it (FP4 / FP8 codes) takes the e4m3 path (both key orders), random bf16 q the
    bf16 path; every path matches the float64 reference and the bf16 path on the same inputs."""
    from dsv4.backends.triton.indexer import indexer_logits, q_codes
    from dsv4.backends.triton.layout import key_layout

    profile = "deepseek" if key_format == "indexer_mxfp4" else "vllm"
    codec = get_codec(key_format)
    cache = codec.allocate(4, 16)
    scale = torch.exp2(torch.randint(-12, 13, (64, 4)).float()).repeat_interleave(32, 1)
    codec.write_rows(cache, torch.arange(64), torch.randn(64, 128) * scale)
    table = torch.randperm(4).view(1, 4).to(torch.int32)
    positions = torch.tensor([255, 130, 200])
    raw_q = (torch.randn(3, 64, 128) * 3).to(torch.bfloat16)
    q, w = reference.indexer_q(raw_q, torch.randn(3, 64).to(torch.bfloat16), positions, cos_sin_table(256),
                               profile=profile)
    q[2, 5] = 0.0  # an all-zero head
    mxfp4 = key_format == "indexer_mxfp4"
    assert q_codes(q, w, mxfp4=mxfp4)[2].tolist() == [1, 1, 1]
    assert q_codes(raw_q, w, mxfp4=mxfp4)[2].tolist() == [0, 0, 0]
    layout = key_layout(key_format, cache)
    args = (positions, torch.zeros(3, dtype=torch.int32), cache, layout, table)
    rows = codec.read_rows(cache, table[0].long().repeat_interleave(16) * 16 + torch.arange(64) % 16).double()
    for qq in (q, raw_q):
        expected = indexer_scores(qq.double(), w.double(), rows)
        expected[1, 32:] = float("-inf")  # (130 + 1) // 4 = 32 visible
        expected[2, 50:] = float("-inf")
        runs = [indexer_logits(qq, w, *args, topk=4, ratio=4, fp8=False, block_entries=32),
                indexer_logits(qq, w, *args, topk=4, ratio=4, fp8=True, block_entries=16, num_splits=3),
                indexer_logits(qq, w, *args, topk=4, ratio=4, fp8=True, block_entries=16, tma=False),
                indexer_logits(qq, w, *args, topk=4, ratio=4, fp8=True, mx_fp16=True, block_entries=32),
                indexer_logits(qq, w, *args, topk=4, ratio=4, fp8=True, prefetch=1, imprecise=128, block_entries=32,
                               num_splits=2),
                indexer_logits(qq, w, *args, topk=4, ratio=4, mx_scaled=True, block_entries=16, num_splits=3)]
        for got in runs:
            assert torch.equal(torch.isfinite(got), torch.isfinite(expected))
            finite = torch.isfinite(expected)
            atol = 1e-5 * float(expected[finite].abs().max())
            torch.testing.assert_close(got[finite].double(), expected[finite], rtol=1e-5, atol=atol)


@pytest.mark.parametrize(("kind", "mx_fp16", "block_entries", "mx_scaled"), [
    ("spread0", False, 32, False), ("spread11", False, 32, False), ("spread12", False, 32, False),
    ("mixed", False, 32, False), ("extreme", False, 32, False), ("spread134", False, 32, False),
    ("spread12", True, 32, False), ("extreme", True, 32, False),
    ("spread134", False, 16, False),  # 16: tiles inside a page (the page-tile addressing)
    ("mixed", False, 32, True), ("extreme", False, 16, True), ("spread134", False, 32, True)])  # tl.dot_scaled
def test_indexer_logits_mxfp4_scales(kind: str, mx_fp16: bool, block_entries: int, mx_scaled: bool) -> None:
    """mxfp4 keys on the tensor-core paths (bf16 operands, fp16 with ``mx_fp16``, ``tl.dot_scaled``) vs the float64 reference
    on adversarial UE8M0 scale bytes written in place (equal, 11 / 12 / 134 binades apart in a row, one
    far row in a tile, anything in 40..199): within 1e-5 of each row's largest score."""
    from dsv4.backends.triton.indexer import indexer_logits
    from dsv4.backends.triton.layout import key_layout
    from dsv4.specs.formats import get_format

    block, pages = 16, 4
    codec = get_codec("indexer_mxfp4")
    cache = codec.allocate(pages, block)
    cache.random_(0, 256, generator=torch.Generator().manual_seed(7))
    n = pages * block
    base = torch.randint(100, 140, (n, 1))
    if kind == "spread0":
        scales = base.expand(n, 4)
    elif kind in ("spread11", "spread12", "spread134"):
        spread = int(kind[6:])
        base = torch.randint(0, 6, (n, 1)) if spread > 100 else base  # low blocks near 2**-127
        scales = base + torch.randint(0, spread + 1, (n, 4))
        scales[:, 0], scales[:, 1] = base[:, 0], base[:, 0] + spread
        scales = scales[:, torch.randperm(4)]
    elif kind == "mixed":
        scales = base + torch.randint(0, 4, (n, 4))
        scales[5, 2] += 30  # one block 30 binades above the rest of its row
    else:
        scales = torch.randint(40, 200, (n, 4))  # keys and scores inside the fp32 range
    offset = get_format("indexer_mxfp4").scale_offset(block)
    cache[:, offset:offset + 4 * block] = scales.reshape(pages, 4 * block).to(torch.uint8)
    table = torch.randperm(pages).view(1, pages).to(torch.int32)
    positions = torch.tensor([255, 200])
    q, w = reference.indexer_q((torch.randn(2, 64, 128) * 3).to(torch.bfloat16), torch.randn(2, 64).to(torch.bfloat16),
                               positions, cos_sin_table(256), profile="deepseek")
    rows = codec.read_rows(cache, table[0].long().repeat_interleave(block) * block + torch.arange(n) % block).double()
    expected = indexer_scores(q.double(), w.double(), rows)
    expected[1, 50:] = float("-inf")
    got = indexer_logits(q, w, positions, torch.zeros(2, dtype=torch.int32), cache, key_layout("indexer_mxfp4", cache),
                         table, topk=4, ratio=4, fp8=True, block_entries=block_entries, mx_fp16=mx_fp16,
                         mx_scaled=mx_scaled).double()
    finite = torch.isfinite(expected)
    assert torch.equal(torch.isfinite(got), finite)
    for t in range(2):
        scale = expected[t][finite[t]].abs().max()
        assert (got[t][finite[t]] - expected[t][finite[t]]).abs().max() <= 1e-5 * scale, f"token {t}"


@pytest.mark.parametrize(("major", "minor", "arch", "mx_mma"), [
    (9, 0, None, False), (10, 0, None, True), (10, 3, None, True), (12, 0, None, False), (8, 9, None, False),
    (9, 5, "gfx950:sramecc+:xnack-", True), (9, 4, "gfx942:sramecc+:xnack-", False)])
def test_mx_mma_devices(major: int, minor: int, arch: str | None, mx_mma: bool) -> None:
    """Microscaling MMAs are claimed for sm_100 / sm_103 and gfx950 only (everything else upcasts)."""
    from types import SimpleNamespace

    from dsv4.backends.triton._common import facts_of

    props = SimpleNamespace(major=major, minor=minor, multi_processor_count=132,
                            **({} if arch is None else {"gcnArchName": arch}))
    facts = facts_of(props, hip=arch is not None)
    assert facts.mx_mma is mx_mma
    assert facts.wgmma is (arch is None and (major, minor) == (9, 0))


def test_mx_scaled_path_selection() -> None:
    """mxfp4 keys take tl.dot_scaled by default only with microscaling MMAs; asked for, on any device; never
    for fp8 keys or a page whose packed rows would not start 16-byte aligned."""
    from dataclasses import replace

    from dsv4.backends.triton._common import DeviceFacts
    from dsv4.backends.triton.indexer import mx_scaled_path
    from dsv4.backends.triton.layout import key_layout

    hopper = DeviceFacts(132, True, True, True, True, True)
    blackwell = replace(hopper, wgmma=False, mx_mma=True)
    mx = key_layout("indexer_mxfp4", get_codec("indexer_mxfp4").allocate(2, 64))
    fp8 = key_layout("indexer_fp8", get_codec("indexer_fp8").allocate(2, 64))
    assert mx_scaled_path(blackwell, mx, 128, None) and not mx_scaled_path(hopper, mx, 128, None)
    assert mx_scaled_path(hopper, mx, 128, True) and not mx_scaled_path(blackwell, mx, 128, False)
    assert not mx_scaled_path(blackwell, fp8, 128, None)
    odd = key_layout("indexer_mxfp4", get_codec("indexer_mxfp4").allocate(2, 3))  # 3 x 68 B pages
    assert odd.page_stride % 16 and not mx_scaled_path(blackwell, odd, 128, True)


@pytest.mark.parametrize("block", [12, 16])  # 12: page slots by division; 16: by shift and mask
def test_indexer_logits_dot_scaled_page_sizes(block: int) -> None:
    """tl.dot_scaled on pages of any size whose rows stay 16-byte aligned, an unmapped page among them: every
    logit vs float64 scores (the unmasked loads of invalid rows read page 0 and end as -inf)."""
    from dsv4.backends.triton._common import device_facts
    from dsv4.backends.triton.indexer import indexer_logits, mx_scaled_path, page_shift
    from dsv4.backends.triton.layout import key_layout

    assert page_shift(block) == (4 if block == 16 else 0) and page_shift(1) == 0 and page_shift(64) == 6
    pages = 6
    codec = get_codec("indexer_mxfp4")
    cache = codec.allocate(pages + 1, block)
    table = (torch.randperm(pages) + 1).view(1, pages).to(torch.int32)  # page 0 is never a request's
    slots = (table.long()[0, :, None] * block + torch.arange(block)).flatten()
    keys = torch.randn(slots.numel(), 128) * torch.exp2(torch.randint(-8, 9, (slots.numel(), 4)).float()
                                                        ).repeat_interleave(32, 1)
    codec.write_rows(cache, slots, keys)
    cache[0].fill_(255)  # NaN scales and codes on the page the invalid rows read
    table[0, 2] = -1
    positions = torch.tensor([4 * pages * block - 1, 4 * 3 * block + 7])
    q, w = reference.indexer_q((torch.randn(2, 64, 128) * 3).to(torch.bfloat16), torch.randn(2, 64).to(torch.bfloat16),
                               positions, cos_sin_table(4 * pages * block), profile="deepseek")
    layout = key_layout("indexer_mxfp4", cache)
    assert mx_scaled_path(device_facts(cache.device), layout, 128, True)  # the path under test is taken
    got = indexer_logits(q, w, positions, torch.zeros(2, dtype=torch.int32), cache, layout, table, topk=4, ratio=4,
                         mx_scaled=True, block_entries=32, num_splits=2).double()
    e = torch.arange(pages * block)
    page = table[0].long()[e // block]
    rows = codec.read_rows(cache, page.clamp_min(0) * block + e % block).double()
    expected = indexer_scores(q.double(), w.double(), rows)
    expected[:, page < 0] = float("-inf")
    expected[1, 3 * block + 2:] = float("-inf")  # (p + 1) // 4 visible
    finite = torch.isfinite(expected)
    assert torch.equal(torch.isfinite(got), finite)
    for t in range(2):
        scale = expected[t][finite[t]].abs().max()
        assert (got[t][finite[t]] - expected[t][finite[t]]).abs().max() <= 1e-5 * scale
