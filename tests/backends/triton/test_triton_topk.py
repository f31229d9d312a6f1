"""Triton top-k selection (backends/triton/topk.py) vs an exact CPU top-k, under the interpreter."""
from __future__ import annotations

import pytest
import torch


def test_topk_indices_exact() -> None:
    """The Triton select returns an exact top-k of its logits (ties, -inf, short rows, all-equal rows)."""
    from dsv4.backends.triton.topk import topk_indices

    n, k = 600, 40
    logits = torch.randn(8, n)
    logits[1, 100:] = float("-inf")
    logits[2] = torch.randint(0, 3, (n,)).float()  # heavy ties across the k-th value
    logits[3] = 2.0
    logits[4, 30:] = float("-inf")  # fewer valid entries than k
    logits[5] = float("-inf")
    logits[6, ::2] = float("-inf")
    logits[7] = -torch.arange(n).float()  # sorted, negative: keys below zero
    # threshold search (rows longer than the candidate buffer): in registers (default) and chunked
    # (reg_max=0; candidates=64/16 force the many-ties fallback), then one sort of the row (n <= candidates)
    for kwargs in ({"chunk": 64, "candidates": 64, "reg_max": 0},
                   {"chunk": 128, "candidates": 16, "ways": 4, "reg_max": 0},
                   {"candidates": 64}, {"candidates": 16, "ways": 4},
                   {"candidates": 128, "group": 16}, {"candidates": 16, "group": 2, "ways": 32}, {},
                   {"candidates": 1024}):
        out = topk_indices(logits, k, **kwargs)
        assert out.shape == (8, k) and out.dtype == torch.int32
        for t in range(8):
            finite = torch.isfinite(logits[t])
            nv = min(k, int(finite.sum()))
            row = out[t]
            assert torch.all(row[:nv] >= 0) and torch.all(row[nv:] == -1)
            sel = row[:nv].long()
            assert sel.unique().numel() == nv and torch.all(finite[sel])
            if nv:
                kth = logits[t][finite].sort(descending=True).values[nv - 1]
                assert torch.all(logits[t][sel] >= kth)


def test_topk_sort_path_orders_like_the_threshold_path() -> None:
    """Short rows take one sort of the row; the result (order included: score, then the higher index
    among equal scores) equals the threshold-search path's on rows without ties at the cut, and a
    row shorter than k is padded with -1."""
    from dsv4.backends.triton.topk import topk_indices

    n, k = 200, 32
    logits = torch.randn(4, n)
    logits[1, 50:] = float("-inf")
    logits[2, 10:] = float("-inf")  # 10 valid entries < k
    logits[3, :] = torch.arange(n).float() % 7  # ties everywhere
    fast = topk_indices(logits, k)  # default candidate buffer 1024 >= n: the sort path
    slow = topk_indices(logits, k, sort_max=0, chunk=64)
    assert torch.equal(fast[:2], slow[:2])
    assert torch.equal(fast[2, :10].sort().values, torch.arange(10, dtype=torch.int32))
    assert torch.all(fast[2, 10:] == -1)
    scores = logits[0][fast[0].long()]
    assert torch.all(scores[:-1] >= scores[1:])  # by score, descending
    top, idx = logits[3][fast[3].long()], fast[3]
    assert torch.equal(top, torch.tensor([6.0] * 28 + [5.0] * 4))  # 28 entries of 6 (i % 7 == 6), then 5s
    same = top[:-1] == top[1:]
    assert torch.all(idx[:-1][same] > idx[1:][same])  # among equal scores, the higher index first


def _canonical(indices: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Each row's valid indices ordered by (score, index) descending, then the -1 padding: the form two exact
    top-k results share whatever order they emit (SPEC §6.3 leaves the order open)."""
    rows = []
    for idx, row in zip(indices.tolist(), logits):
        valid = sorted((i for i in idx if i >= 0), key=lambda i: (float(row[i]), i), reverse=True)
        rows.append(valid + [-1] * (len(idx) - len(valid)))
    return torch.tensor(rows, dtype=torch.int32)


def test_topk_register_path_matches_chunked_path() -> None:
    """The in-register kernel (rows of <= REG_MAX entries) selects what the chunked kernel selects: bisection
    groups of 1-16 entries, fan-outs 4-32, candidate slots from a scan of per-thread counts or (rows too
    short for one group a thread) of group counts. Both emit valid entries by descending score unless a row
    has more than ``candidates`` entries above the group-maxima threshold; then the fallback's ordered
    compaction emits the entries above its upper bound in index order. Which rows fall back depends on the
    group size, so the outputs are compared in canonical order."""
    from dsv4.backends.triton.topk import topk_indices

    k = 48
    torch.manual_seed(25)  # seed 25: row 1 takes the fallback with groups of 16 (order differs, selection not)
    for n in (1000, 200):  # 200 entries with groups of >= 4: 64 scan groups < 128 threads, the group-count scan
        logits = torch.randn(3, n)
        logits[1, n - 100:] = float("-inf")
        logits[2, ::5] = float("nan")
        ref = topk_indices(logits, k, reg_max=0, candidates=128, chunk=128)
        for kwargs in ({}, {"group": 1}, {"group": 16, "ways": 32}, {"group": 4, "ways": 4}, {"group": 2}):
            got = topk_indices(logits, k, candidates=128, **kwargs)
            assert torch.equal(_canonical(got, logits), _canonical(ref, logits)), (n, kwargs)
            assert torch.equal(got < 0, ref < 0), (n, kwargs)  # valid entries first, the same count


def test_local_to_global_is_the_metadata_conversion(monkeypatch) -> None:
    """One launch gives dsv4.metadata.topk_local_to_global's slots and lens: -1 entries, pages past the
    table and unallocated pages give -1; int32 and int64 request ids; widths that are not powers of two;
    a strided block table. Outputs start poisoned, so an entry the kernel skips shows."""
    from dsv4.backends.triton import topk
    from dsv4.metadata import topk_local_to_global

    real_empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        return real_empty(*args, **kwargs).fill_(0x5A5A5A5A)

    monkeypatch.setattr(topk.torch, "empty", poisoned_empty)
    g = torch.Generator().manual_seed(7)
    for tokens, width, blocks, block_size, request_dtype in ((5, 40, 3, 4, torch.int32), (3, 64, 6, 64, torch.int64),
                                                              (4, 7, 1, 1, torch.int32), (1, 1, 2, 16, torch.int64)):
        wide = torch.randint(-1, 90, (4, blocks + 3), generator=g, dtype=torch.int32)
        table = wide[:, ::2][:, :blocks] if wide[:, ::2].shape[1] >= blocks else wide[:, :blocks]
        local = torch.randint(-1, (blocks + 1) * block_size, (tokens, width), generator=g, dtype=torch.int32)
        local[0, : width // 2] = -1
        request = torch.randint(0, 4, (tokens,), generator=g).to(request_dtype)
        slots, lens = topk.local_to_global(local, request, table, block_size)
        want_slots, want_lens = topk_local_to_global(local, request, table, block_size)
        assert slots.dtype == lens.dtype == torch.int32
        assert torch.equal(slots, want_slots), (tokens, width, blocks, block_size)
        assert torch.equal(lens, want_lens)
    table = torch.randint(0, 90, (4, 3), generator=g, dtype=torch.int32)
    local = torch.randint(0, 3 * 4, (6, 16), generator=g, dtype=torch.int32)
    strided_request = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3], dtype=torch.int32)[::2]  # ids 0, 2, 0, ...
    slots, lens = topk.local_to_global(local, strided_request, table, 4)
    assert torch.equal(slots, topk_local_to_global(local, strided_request, table, 4)[0])
    empty = torch.zeros((0, 8), dtype=torch.int32)
    slots, lens = topk.local_to_global(empty, torch.zeros(0, dtype=torch.int32), table, 4)
    assert slots.shape == (0, 8) and lens.shape == (0,)
    slots, lens = topk.local_to_global(torch.zeros((3, 0), dtype=torch.int32), torch.zeros(3, dtype=torch.int32),
                                       table, 4)
    assert slots.shape == (3, 0) and lens.tolist() == [0, 0, 0]


_VARIANTS = {"sort": {}, "register": {"candidates": 64}, "register_groups": {"candidates": 64, "group": 8},
             "chunked": {"candidates": 64, "reg_max": 0, "chunk": 64},
             "chunked_tier": {"candidates": 64, "reg_max": 512, "chunk": 64, "group": 8}}


@pytest.mark.parametrize("variant", sorted(_VARIANTS))
def test_topk_row_lens_read_only_the_row(variant: str) -> None:
    """``row_lens``: every kernel (one sort of the row; in registers, where a row of at most ``candidates``
    entries takes one sort and one of at most a quarter of the width the in-register select at that width;
    chunked, without and with the in-register tiers at ``reg_max`` and a quarter of it) gives, bit for bit,
    what it gives without lengths on rows whose tails are -inf, and the same again when the tails hold
    garbage (+inf, huge, NaN, ties): nothing past a row's
    length is read. Rows shorter than / as long as / longer than k, empty, past n (clamped), with heavy
    ties at the cut (the fallback of the threshold kernels) and NaNs inside. One exception: a row that
    has fewer than 2k group maxima (groups sized for the width, not the row), whose threshold leaves more
    than ``candidates`` entries, goes to the ordered-compaction fallback without lengths; with them it is
    bisected on its entries and comes out as one sort of the row orders it (as an unpadded row would):
    row 13 (fewer than k maxima) and row 12 (k..2k maxima, every group's entries close to its maximum)."""
    from dsv4.backends.triton.topk import topk_indices

    k, n = 24, 200 if variant == "sort" else 600
    g = torch.Generator().manual_seed(3)
    lens = torch.tensor([n, 0, 5, k, k + 1, 60, 65, 150, n - 1, 3 * n, 400 % n, 17, 300, 180], dtype=torch.int32)
    logits = torch.randn(lens.numel(), n, generator=g)
    logits[5] = torch.randint(0, 3, (n,), generator=g).float()  # heavy ties across the k-th value
    logits[7] = 1.0  # all equal: the fallback's ordered compaction where the row is long
    logits[8, ::7] = float("nan")
    logits[10, 1::3] = float("-inf")
    # 300 entries, 38 groups, each group's entries close to its level: ~24 * 8 entries >= tau; one group far
    # above the rest (the fallback places its 8 entries first, in index order)
    level = torch.randperm(n // 8 + 1, generator=g).float().repeat_interleave(8)[:n]
    logits[12] = torch.where(level == level[:300].max(), 1e6, 1.0) * (level + 1e-3 * torch.rand(n, generator=g))
    in_row = torch.arange(n)[None, :] < lens[:, None]
    clean = torch.where(in_row, logits, float("-inf"))
    kwargs = _VARIANTS[variant]
    want = topk_indices(clean, k, **kwargs)
    one_sort = topk_indices(clean, k, sort_max=n)
    got = topk_indices(clean, k, row_lens=lens, **kwargs)
    coarse = torch.zeros(lens.numel(), dtype=torch.bool)
    if variant != "sort":  # groups of 8 (n = 600, k = 24): rows of 180 / 300 entries have 23 / 38 maxima
        coarse[12:14] = True
        for row in (12, 13):  # without lengths: the fallback's order, not the sort's
            assert not torch.equal(want[row], one_sort[row]), row
    assert not torch.equal(want[7], one_sort[7]) or variant == "sort"  # all ties: the fallback either way
    assert torch.equal(got[~coarse], want[~coarse])
    assert torch.equal(got[coarse], one_sort[coarse])
    for garbage in (float("inf"), 1e30, float("nan"), 1.0):
        dirty = torch.where(in_row, logits, garbage)
        assert torch.equal(topk_indices(dirty, k, row_lens=lens, **kwargs), got), garbage
    assert torch.all(want[1] == -1) and torch.equal(want[2, 5:], torch.full((k - 5,), -1, dtype=torch.int32))
    assert torch.all(want[lens > k][:, -1] >= 0)
    # a strided view of the lengths (a column of packed metadata) reads as the contiguous tensor
    strided = torch.stack([lens, torch.full_like(lens, 7)], 1)[:, 0]
    assert strided.stride(0) == 2 and torch.equal(topk_indices(clean, k, row_lens=strided, **kwargs), got)


def test_topk_row_lens_tiers_group_as_their_own_width() -> None:
    """A ``group`` knob sized for the width (64 entries a maximum) does not reach the in-register tier of a
    quarter of it (32 entries: it would hold no whole group): rows in every path select what one sort does."""
    from dsv4.backends.triton.topk import topk_indices

    k, n = 2, 100
    logits = torch.randn(6, n, generator=torch.Generator().manual_seed(5))
    lens = torch.tensor([0, 10, 17, 30, 64, n], dtype=torch.int32)  # sort, sort, tier (32), tier, width, width
    clean = torch.where(torch.arange(n)[None, :] < lens[:, None], logits, float("-inf"))
    got = topk_indices(logits, k, candidates=16, group=64, row_lens=lens)
    assert torch.equal(got, topk_indices(clean, k, sort_max=n))
