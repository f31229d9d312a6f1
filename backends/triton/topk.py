"""Top-k selection over indexer logits (SPEC §6.3): one program per row, exact, no full sort of long rows.

Group maxima give a threshold tau with at least k entries >= tau (typically ~k); the entries >= tau
are collected and sorted; rows with more than KC such entries (many ties, or a candidate buffer smaller
than the threshold admits) fall back to a bisection on the row and an ordered compaction, which emits
the entries above its upper bound in index order (SPEC §6.3 leaves the order open). Rows of at most
``REG_MAX`` entries are held in registers whole (``_topk_reg_kernel``: one load, in-register bisection,
one scan places the candidates); longer rows are streamed in chunks (``_topk_kernel``). With per-row
lengths (``row_lens``, e.g. a padded block table's real entries) every kernel reads a row's first entries
only and loops over them alone, and a short row takes the path of its own length (``_short_row``). See
``topk_indices``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from dsv4.backends.triton._common import INTERPRET, next_pow2
from dsv4.backends.triton.layout import unit_stride

__all__ = ["local_to_global", "topk_indices"]


@triton.jit
def _ordered_key(x):
    """fp32 -> int32 whose signed order is x's order; -inf and NaN (invalid entries) -> -2**31."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(x > float("-inf"), tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits), -2147483648)


@triton.jit
def _narrow(keys, n, k, lo, hi, c_lo, c_hi, spread, FLOAT: tl.constexpr, CH: tl.constexpr, WAYS: tl.constexpr):
    """WAYS-way bisection on the order keys of ``keys[0:n]`` (fp32 logits when FLOAT, else int32 keys):
    keeps count(key >= lo) = c_lo >= k > count(key >= hi) = c_hi (c_lo on entry may be an upper bound
    above spread: exact after the first step), stops when c_lo - c_hi <= spread or hi == lo + 1 (lo is
    then the k-th key). One pass over the keys a step."""
    ways = tl.arange(0, WAYS)
    offs = tl.arange(0, CH)
    while (c_lo - c_hi > spread) & (hi - lo > 1):
        step = (hi - lo + WAYS - 1) // WAYS
        thr = tl.minimum(lo + ways.to(tl.int64) * step, hi).to(tl.int32)  # thr[0] = lo
        acc = tl.zeros([CH, WAYS], tl.int32)
        for s in range(0, n, CH):
            j = s + offs
            if FLOAT:
                key = _ordered_key(tl.load(keys + j, mask=j < n, other=float("-inf")))
            else:
                key = tl.load(keys + j, mask=j < n, other=-2147483648)
            acc += (key[:, None] >= thr[None, :]).to(tl.int32)
        counts = tl.sum(acc, 0)  # non-increasing in the way index
        m = tl.sum((counts >= k).to(tl.int32), 0) - 1  # the last threshold still holding >= k keys
        lo = lo + m * step
        c_hi = tl.where(m + 1 < WAYS, tl.sum(tl.where(ways == m + 1, counts, 0), 0), c_hi)
        hi = tl.minimum(lo + step, hi)
        c_lo = tl.sum(tl.where(ways == m, counts, 0), 0)
    return lo, hi, c_lo, c_hi


@triton.jit
def _emit_sorted(crow, out_row, total, k, KC: tl.constexpr, row=None):
    """out_row[:k] int32 = indices of the ``total`` (<= KC) candidates by descending (key, index), then -1.
    Candidates: ``crow[:total]`` int64 (key << 32 | index), or with ``row`` (the fp32 logits) int32 indices
    ``crow[KC:KC + total]`` whose keys are re-read from the row."""
    r = tl.arange(0, KC)
    if row is None:
        c = tl.load(crow + r, mask=r < total, other=-9223372036854775807 - 1)
    else:
        ci = tl.load(crow + KC + r, mask=r < total, other=0)
        ck = _ordered_key(tl.load(row + ci, mask=r < total, other=float("-inf")))
        c = (ck.to(tl.int64) << 32) | ci.to(tl.int64)
    best = tl.sort(c, 0, descending=True)
    tl.store(out_row + r, tl.where(r < total, (best & 0x7FFFFFFF).to(tl.int32), -1), mask=r < k)


@triton.jit
def _fallback(row, n, out_row, crow, k, tau, hi, total, CH: tl.constexpr, WAYS: tl.constexpr,
              KC: tl.constexpr):
    """More than KC entries >= tau (count ``total``; ``hi`` = max key + 1, int64): bisection on the row
    ``row[:n]`` fp32, then an ordered compaction into ``out_row`` [k] int32 (ties: lowest indices)."""
    offs = tl.arange(0, CH)
    r = tl.arange(0, KC)
    lo = tau.to(tl.int64)
    if total > k:  # many ties around the k-th value: bisection on the row (count(key >= tau) = total)
        lo, hi, _, c_hi = _narrow(row, n, k, lo, hi, total, total * 0, KC, True, CH, WAYS)
    else:  # fewer valid entries than k: all of them, then -1
        hi = lo
        c_hi = total
    need = k - c_hi
    ties = hi - lo == 1
    base_s = 0
    base_b = 0
    for s in range(0, n, CH):
        j = s + offs
        key = _ordered_key(tl.load(row + j, mask=j < n, other=float("-inf")))
        sure = key >= hi
        bnd = (key >= lo) & (key < hi)
        tl.store(out_row + base_s + tl.cumsum(sure.to(tl.int32), 0) - 1, j.to(tl.int32), mask=sure)
        rank = base_b + tl.cumsum(bnd.to(tl.int32), 0) - 1
        if ties:
            tl.store(out_row + c_hi + rank, j.to(tl.int32), mask=bnd & (rank < need))
        else:
            tl.store(crow + rank, (key.to(tl.int64) << 32) | j.to(tl.int64), mask=bnd & (rank < KC))
        base_s += tl.sum(sure.to(tl.int32), 0)
        base_b += tl.sum(bnd.to(tl.int32), 0)
    if hi - lo != 1:
        tl.debug_barrier()
        best = tl.sort(tl.load(crow + r, mask=r < base_b, other=-9223372036854775807 - 1), 0, descending=True)
        tl.store(out_row + c_hi + r, tl.where(r < base_b, (best & 0x7FFFFFFF).to(tl.int32), -1), mask=r < need)


@triton.jit
def _narrow_reg(gk, k, lo, hi, c_lo, c_hi, spread, WAYS: tl.constexpr):
    """``_narrow`` on the order keys ``gk`` [NG] int32 held in registers (one reduction a step, no loads)."""
    ways = tl.arange(0, WAYS)
    while (c_lo - c_hi > spread) & (hi - lo > 1):
        step = (hi - lo + WAYS - 1) // WAYS
        thr = tl.minimum(lo + ways.to(tl.int64) * step, hi).to(tl.int32)  # thr[0] = lo
        counts = tl.sum((gk[None, :] >= thr[:, None]).to(tl.int32), 1)  # non-increasing in the way index
        above = counts >= k
        m = tl.sum(above.to(tl.int32), 0) - 1  # the last threshold still holding >= k keys
        lo = lo + m * step
        c_hi = tl.where(m + 1 < WAYS, tl.max(tl.where(above, -1, counts), 0), c_hi)  # counts[m + 1]
        hi = tl.minimum(lo + step, hi)
        c_lo = tl.min(tl.where(above, counts, 2147483647), 0)  # counts[m]
    return lo, hi, c_lo, c_hi


@triton.jit
def _topk_kernel(logits, n, lens, out, gkeys, ng_stride, cand, counter, k, G: tl.constexpr, CH: tl.constexpr,
                 WAYS: tl.constexpr, KC: tl.constexpr, HAS_LENS: tl.constexpr, NT: tl.constexpr = 128,
                 TA: tl.constexpr = 0, TA_BG: tl.constexpr = 1, TA_PG: tl.constexpr = 1, TB: tl.constexpr = 0,
                 TB_BG: tl.constexpr = 1, TB_PG: tl.constexpr = 1):
    """One program per row of logits [T, n] fp32: out[t, :k] int32 = indices of the k largest finite logits,
    then -1 (SPEC §6.3: which of tied entries is unspecified; valid entries sorted by score), by
    ``_select_chunked``. HAS_LENS: only the row's first ``lens[t]`` entries (int32 [T]) are read, every loop
    bounded by them, and a short row takes the path of its own length (``_short_row``: one sort, or the
    in-register select at the width TA or TB)."""
    t = tl.program_id(0).to(tl.int64)
    row = logits + t * n
    if HAS_LENS:
        n = _row_len(lens, t, n, HAS_LENS)
        if n <= max(KC, TA, TB):
            _short_row(row, n, out + t * k, gkeys + t * ng_stride, cand + t * KC, k, KC, NT, TA, TA_BG, TA_PG, TB,
                       TB_BG, TB_PG)
        else:
            _select_chunked(row, n, out + t * k, gkeys + t * ng_stride, cand + t * KC, counter + t, k, G, CH, WAYS,
                            KC, True)
    else:
        _select_chunked(row, n, out + t * k, gkeys + t * ng_stride, cand + t * KC, counter + t, k, G, CH, WAYS, KC,
                        False)


@triton.jit
def _short_row(row, n, out_row, grow, crow, k, KC: tl.constexpr, NT: tl.constexpr, TA: tl.constexpr,
               TA_BG: tl.constexpr, TA_PG: tl.constexpr, TB: tl.constexpr, TB_BG: tl.constexpr,
               TB_PG: tl.constexpr):
    """``row[:n]`` fp32, n <= max(KC, TA, TB) -> ``out_row`` [k] int32, by the row's own length: at most KC
    entries one sort (``_sort_row``); else at most TA (0: none) the tier of width TA (``_tier``: groups of
    TA_BG, candidates placed in groups of TA_PG), else at most TB likewise. ``grow``: int32, room for
    TA // TA_BG and TB // TB_BG; ``crow``: int64 [KC]."""
    if n <= KC:
        _sort_row(row, n, out_row, k, KC)
    _tier(row, n, out_row, grow, crow, k, KC, TA, TA_BG, TA_PG, KC, NT)
    _tier(row, n, out_row, grow, crow, k, max(KC, TA), TB, TB_BG, TB_PG, KC, NT)


@triton.jit
def _tier(row, n, out_row, grow, crow, k, BELOW: tl.constexpr, W: tl.constexpr, BG: tl.constexpr,
          PG: tl.constexpr, KC: tl.constexpr, NT: tl.constexpr):
    """A row of BELOW < n <= W entries: ``_select_in_registers`` at NP = W as an unpadded row that wide (groups
    of BG, candidates placed in groups of PG, NT threads, 8 ways); W <= BELOW: no tier (compiles to nothing)."""
    if W > BELOW:  # noqa: SIM102 - a compile-time guard
        if (n > BELOW) & (n <= W):
            _select_in_registers(row, n, out_row, grow, crow.to(tl.pointer_type(tl.int32)), k, W, PG, BG, 8, KC, NT,
                                 (W // PG) % NT == 0, True)


@triton.jit
def _select_chunked(row, n, out_row, grow, crow, count, k, G: tl.constexpr, CH: tl.constexpr, WAYS: tl.constexpr,
                    KC: tl.constexpr, BISECT_ROW: tl.constexpr):
    """The top k of ``row[:n]`` fp32 -> ``out_row`` [k] int32, streamed in chunks of CH entries.

    1. Max order key of each group of G entries -> ``grow`` [ceil(n / G)] int32; tau = a key with at
       least k group maxima >= tau (bisection on the maxima), so at least k entries are >= tau.
    2. Entries >= tau (typically a few times k) -> ``crow`` [KC] int64 (key << 32 | index) through
       the atomic slot counter ``count`` [1] int32; sorted, the first k are the answer.
    3. More than KC candidates (many ties): bisection on the row itself, then an ordered compaction.
    BISECT_ROW: the first pass also counts the valid entries and finds the least; fewer than 2k group
    maxima and more than KC valid entries go to ``_bisect_row`` before the one collect pass. (Collecting
    first and bisecting only where more than KC were collected was slower on the H200: k=2048, 40000
    entries in 131072, 222 against 173 us; docs/triton.md, "Twenty-fourth round".)
    """
    NCH: tl.constexpr = min(CH, 512)  # bisection chunk ([NCH, WAYS] counters in registers)
    offs = tl.arange(0, CH)
    ng = (n + G - 1) // G
    lowest = -2147483648
    gcount_acc = tl.zeros([CH // G], tl.int32)
    gmin_acc = tl.full([CH // G], 2147483647, tl.int32)
    max_acc = tl.full([CH // G], lowest, tl.int32)
    valid_acc = tl.zeros([CH], tl.int32)
    kmin_acc = tl.full([CH], 2147483647, tl.int32)
    x_next = tl.load(row + offs, mask=offs < n, other=float("-inf"))
    for s in range(0, n, CH):
        key = _ordered_key(x_next)
        x_next = tl.load(row + s + CH + offs, mask=s + CH + offs < n, other=float("-inf"))  # one chunk ahead
        gmax = tl.max(tl.reshape(key, (CH // G, G)), 1)
        gi = s // G + tl.arange(0, CH // G)
        tl.store(grow + gi, gmax, mask=gi < ng)
        gcount_acc += (gmax > lowest).to(tl.int32)
        gmin_acc = tl.minimum(gmin_acc, tl.where(gmax > lowest, gmax, 2147483647))
        max_acc = tl.maximum(max_acc, gmax)
        if BISECT_ROW:
            valid_acc += (key > lowest).to(tl.int32)
            kmin_acc = tl.minimum(kmin_acc, tl.where(key > lowest, key, 2147483647))
    groups = tl.sum(gcount_acc, 0)
    hi = tl.max(max_acc, 0).to(tl.int64) + 1
    tl.store(count, 0)
    tl.debug_barrier()  # grow and the counter, written by other threads of this program
    tau = lowest + 1  # fewer than k valid groups: every valid entry is a candidate
    if groups >= k:
        lo = tl.min(gmin_acc, 0).to(tl.int64)
        tau = _narrow(grow, ng, k, lo, hi, groups, groups * 0, k // 4, False, NCH, WAYS)[0].to(tl.int32)
    if BISECT_ROW:
        valid = tl.sum(valid_acc, 0)
        if (valid > KC) & (groups < 2 * k):  # from tau (count <= valid) or, fewer than k groups, the least key
            tau = _bisect_row(row, n, k, tl.where(groups >= k, tau, tl.min(kmin_acc, 0)), valid, hi, KC, WAYS)
    total = _collect(row, n, crow, count, tau, CH, KC)
    if total <= KC:
        _emit_sorted(crow, out_row, total, k, KC)
    else:
        _fallback(row, n, out_row, crow, k, tau, hi, total, NCH, WAYS, KC)


@triton.jit
def _topk_reg_kernel(logits, n, lens, out, gkeys, ng_stride, cand, k, NP: tl.constexpr, G: tl.constexpr,
                     BG: tl.constexpr, WAYS: tl.constexpr, KC: tl.constexpr, NT: tl.constexpr,
                     THREAD_SCAN: tl.constexpr, HAS_LENS: tl.constexpr, TA: tl.constexpr = 0,
                     TA_BG: tl.constexpr = 1, TA_PG: tl.constexpr = 1):
    """Program t: row t of logits [T, n] fp32 by ``_select_in_registers``; HAS_LENS: its first ``lens[t]``
    entries only (int32 [T]), and a short row takes the path of its own length (``_short_row``: at most KC
    entries one sort, the same result; at most TA the in-register select at that width)."""
    t = tl.program_id(0).to(tl.int64)
    row = logits + t * n
    grow = gkeys + t * ng_stride
    if HAS_LENS:
        n = _row_len(lens, t, n, HAS_LENS)
        if n <= max(KC, TA):
            _short_row(row, n, out + t * k, grow, (cand + t * (2 * KC)).to(tl.pointer_type(tl.int64)), k, KC, NT, TA,
                       TA_BG, TA_PG, 0, 1, 1)
        else:
            _select_in_registers(row, n, out + t * k, grow, cand + t * (2 * KC), k, NP, G, BG, WAYS, KC, NT,
                                 THREAD_SCAN, True)
    else:
        _select_in_registers(row, n, out + t * k, grow, cand + t * (2 * KC), k, NP, G, BG, WAYS, KC, NT,
                             THREAD_SCAN, False)


@triton.jit
def _collect(row, n, crow, count, tau, CH: tl.constexpr, KC: tl.constexpr):
    """Entries of ``row[:n]`` fp32 with order key >= tau -> ``crow`` [KC] int64 (key << 32 | index) at slots of
    the atomic counter ``count`` (0 on entry): returns their count (all of them, stored or not)."""
    offs = tl.arange(0, CH)
    x_next = tl.load(row + offs, mask=offs < n, other=float("-inf"))
    for s in range(0, n, CH):
        j = s + offs
        key = _ordered_key(x_next)
        x_next = tl.load(row + j + CH, mask=j + CH < n, other=float("-inf"))  # one chunk ahead
        take = key >= tau
        slot = tl.atomic_add(count + offs * 0, 1, mask=take, sem="relaxed", scope="cta")
        tl.store(crow + slot, (key.to(tl.int64) << 32) | j.to(tl.int64), mask=take & (slot < KC))
    tl.debug_barrier()
    return tl.atomic_add(count, 0, sem="relaxed", scope="cta")


@triton.jit
def _bisect_row(row, n, k, lo, c_lo, hi, KC: tl.constexpr, WAYS: tl.constexpr):
    """A threshold with k..KC-1 entries of ``row[:n]`` at or above it (more where ties at the k-th key outnumber
    KC - k + 1), by bisection on the entries from ``lo``
    (int32, count(key >= lo) = ``c_lo`` >= k, or an upper bound of it above KC) to ``hi`` (max key + 1,
    int64): with ``row_lens``, for a row far shorter than the width, whose groups (sized for the width)
    number fewer than 2k and leave a weak threshold: one sorted candidate set instead of the many-ties
    fallback (the result the row's own grouping gives)."""
    return _narrow(row, n, k, lo.to(tl.int64), hi, c_lo, c_lo * 0, KC - k, True, 512, WAYS)[0].to(tl.int32)


@triton.jit
def _select_in_registers(row, n, out_row, grow, crow, k, NP: tl.constexpr, G: tl.constexpr, BG: tl.constexpr,
                         WAYS: tl.constexpr, KC: tl.constexpr, NT: tl.constexpr, THREAD_SCAN: tl.constexpr,
                         BISECT_ROW: tl.constexpr):
    """``_topk_kernel`` for a row ``row[:n]`` fp32 of n <= NP entries held in registers whole ([NP // G, G]
    order keys) -> ``out_row`` [k] int32.

    One load of the row (every load in flight at once); the maxima of groups of BG entries [NP // BG] go
    through ``grow`` [NP // BG] int32 into a compact layout and are bisected in registers
    (``_narrow_reg``); the indices of the entries >= tau go to ``crow`` [2 * KC] int32 (second half) at
    slots from one scan of per-thread counts (THREAD_SCAN, NT threads) or of the counts of groups of G
    entries, both in index order; their keys are re-read from the row for the sort (``_emit_sorted``).
    BISECT_ROW: see ``_bisect_row``.
    """
    NG: tl.constexpr = NP // G
    lowest = -2147483648
    e = tl.arange(0, NG)[:, None] * G + tl.arange(0, G)[None, :]  # [NG, G] entry index
    key = _ordered_key(tl.load(row + e, mask=e < n, other=float("-inf")))
    gmax = tl.max(key, 1)
    if BG > G:  # bisection on the maxima of BG entries (fewer values a bisection step)
        gmax = tl.max(tl.reshape(gmax, (NP // BG, BG // G)), 1)
    groups = tl.sum((gmax > lowest).to(tl.int32), 0)
    hi = tl.max(gmax, 0).to(tl.int64) + 1  # max key + 1, kept for the fallback
    tau = lowest + 1  # fewer than k valid groups: every valid entry is a candidate
    gi = tl.arange(0, NP // BG)
    tl.store(grow + gi, gmax)
    tl.debug_barrier()
    gk = tl.load(grow + gi)  # the maxima again, a few a thread instead of replicated
    if groups >= k:
        lo = tl.min(tl.where(gk > lowest, gk, 2147483647), 0).to(tl.int64)
        tau = _narrow_reg(gk, k, lo, hi, groups, groups * 0, k // 4, WAYS)[0].to(tl.int32)
    take = key >= tau
    cnt = tl.sum(take.to(tl.int32), 1)  # [NG] candidates a group
    total = tl.sum(cnt, 0)
    if BISECT_ROW:  # noqa: SIM102 - a compile-time guard
        if (total > KC) & (groups < 2 * k):  # from the least candidate key: count(key >= it) = total
            tau = _bisect_row(row, n, k, tl.min(tl.min(tl.where(take, key, 2147483647), 1), 0), total, hi, KC, WAYS)
            take = key >= tau
            cnt = tl.sum(take.to(tl.int32), 1)
            total = tl.sum(cnt, 0)
    if THREAD_SCAN:  # [NG // NT, NT, G]: the groups of one thread (NT threads) scanned in-thread
        tk3 = tl.reshape(take.to(tl.int32), (NG // NT, NT, G))
        c2 = tl.sum(tk3, 2)  # [NG // NT, NT]
        c1 = tl.sum(c2, 0)  # [NT]
        b2 = (tl.cumsum(c1, 0) - c1)[None, :] + tl.cumsum(c2, 0) - c2
        slot = tl.reshape(b2[:, :, None] + tl.cumsum(tk3, 2) - 1, (NG, G))
    else:
        slot = (tl.cumsum(cnt, 0) - cnt)[:, None] + tl.cumsum(take.to(tl.int32), 1) - 1
    # crow: int32 [2 * KC], indices in the second half
    tl.store(crow + KC + slot, e, mask=take & (slot < KC))
    tl.debug_barrier()
    if total <= KC:
        _emit_sorted(crow, out_row, total, k, KC, row)
    else:  # the same KC * 8 bytes as int64 (key << 32 | index)
        _fallback(row, n, out_row, crow.to(tl.pointer_type(tl.int64)), k, tau, hi, total, 512, WAYS, KC)


@triton.jit
def _topk_sort_kernel(logits, n, lens, out, k, NP: tl.constexpr, HAS_LENS: tl.constexpr):
    """Rows of at most NP entries (HAS_LENS: row t's first ``lens[t]``, int32 [T]): ``_sort_row``."""
    t = tl.program_id(0).to(tl.int64)
    _sort_row(logits + t * n, _row_len(lens, t, n, HAS_LENS), out + t * k, k, NP)


@triton.jit
def _sort_row(row, n, out_row, k, NP: tl.constexpr):
    """``row[:n]`` fp32 (n <= NP): one sort of the (order key << 32 | index), descending; the first k valid are
    ``out_row`` [k] int32, as ``_topk_kernel`` orders them (score, then the higher index), then -1."""
    r = tl.arange(0, NP)
    key = _ordered_key(tl.load(row + r, mask=r < n, other=float("-inf")))
    best = tl.sort((key.to(tl.int64) << 32) | r.to(tl.int64), 0, descending=True)
    valid = (best >> 32) > -2147483648
    tl.store(out_row + r, tl.where(valid, (best & 0x7FFFFFFF).to(tl.int32), -1), mask=r < k)


@triton.jit
def _row_len(lens, t, n, HAS_LENS: tl.constexpr):
    """The entries of row t read: ``lens[t]`` clamped to [0, n] (HAS_LENS; the rest are invalid), else n."""
    if HAS_LENS:
        return tl.minimum(tl.maximum(tl.load(lens + t), 0), n)
    else:
        return n


REG_MAX = 32768  # longest row held in registers whole (64 order keys a thread at 16 warps)
_PLACE_GROUP = 4  # entries a group of the in-register candidate scan


def topk_indices(logits: torch.Tensor, topk: int, *, chunk: int | None = None, ways: int | None = None,
                 candidates: int | None = None, group: int | None = None, num_warps: int | None = None,
                 sort_max: int | None = None, reg_max: int | None = None,
                 row_lens: torch.Tensor | None = None) -> torch.Tensor:
    """[T, topk] int32: per row the indices of the ``topk`` largest finite logits (by score), then -1.

    ``logits`` [T, n] fp32 (-inf / NaN: invalid entries). Exact selection; valid entries by descending
    score, then the higher index among equal scores (rows with more than ``candidates`` entries at the
    threshold, i.e. many ties, take an ordered-compaction fallback instead). Rows no longer than the
    candidate buffer (``n <= candidates``, e.g. 1024 entries at 4K context) take one sort of the row
    (``sort_max``: 0 turns that off); rows of at most ``reg_max`` entries (default ``REG_MAX``; 0: off)
    the in-register kernel, longer rows the chunked one (``chunk`` entries a step).

    ``row_lens`` int32 [T]: row t holds entries ``[0, row_lens[t])`` (clamped to [0, n]); the rest count as
    invalid and are never read (whatever they hold). Each row then takes its own path: at most
    ``candidates`` entries one sort; at most a tier's width (wider than ``candidates``) the in-register
    select at that width, grouped as an unpadded row that wide (8 ways, whatever ``group`` / ``ways``
    say): a quarter of the width in the in-register kernel; ``reg_max`` (its widest power of two) and a
    quarter of it in the chunked one. A row with fewer than 2 * topk group maxima whose threshold admits
    more than ``candidates`` entries is bisected on its entries (the fallback only where ties at the k-th
    value outnumber ``candidates``). The set the row unpadded gives (and its order, short of many ties);
    what a padded row still costs: ``tools/topk_padded.py``.

    Knobs: ``ways`` (bisection fan-out; default 8 in registers, 16 chunked), ``candidates`` (the largest
    candidate set sorted), ``group`` (entries a group maximum; the default leaves >= 2 * topk group
    maxima a row, so tau keeps typically ~topk candidates), ``num_warps``. Defaults: the fastest on the
    H200 (CUDA-graph replay, k=512: 128 rows of 32768 48.3 -> 24.9 us, of 8192 27.1 -> 14.8 us; the
    variants measured and not kept are in docs/triton.md, "Sixth round").
    """
    num_tokens, n = logits.shape
    out = torch.empty((num_tokens, topk), dtype=torch.int32, device=logits.device)
    if num_tokens == 0:
        return out
    if n == 0:
        return out.fill_(-1)
    kc = next_pow2(max(candidates or 1024, 2 * topk if candidates is None else topk))
    # row_lens by the backend's rule for [T] index vectors (layout.unit_stride: a strided view is copied once)
    lens = {"lens": out if row_lens is None else unit_stride(row_lens), "HAS_LENS": row_lens is not None}
    if n <= (kc if sort_max is None else sort_max):
        extra = {} if INTERPRET else {"num_warps": num_warps or 8}
        _topk_sort_kernel[(num_tokens,)](logits, n, out=out, k=topk, NP=max(next_pow2(n), next_pow2(topk)), **lens,
                                         **extra)
        return out
    g = group or _group(n, topk)
    extra = {} if INTERPRET else {"num_warps": num_warps or 16}
    nt = 32 * extra.get("num_warps", 4)
    cand = torch.empty((num_tokens, kc), dtype=torch.int64, device=logits.device)
    np_ = max(next_pow2(n), g)
    reg = REG_MAX if reg_max is None else reg_max
    # with row_lens, short rows in registers at a quarter of the width (in registers) or at `reg` and a quarter
    # of it (chunked): the widest powers of two, each grouped as a row that wide
    widest = 1 << (reg.bit_length() - 1) if reg else 0
    widths = () if row_lens is None else (np_ // 4,) if np_ <= reg else (widest // 4, widest)
    tier, stride = {}, 0
    for name, width in zip(("TA", "TB"), [w for w in widths if w > kc]):
        bg = _group(width, topk)  # as a row that wide (not the knob)
        tier.update({name: width, f"{name}_BG": bg, f"{name}_PG": min(_PLACE_GROUP, bg)})
        stride = max(stride, width // bg)  # gkeys a row: room for the tier's maxima too
    if np_ <= reg:
        pg = min(_PLACE_GROUP, g)
        ng = max(np_ // g, stride)
        gkeys = torch.empty((num_tokens, ng), dtype=torch.int32, device=logits.device)
        _topk_reg_kernel[(num_tokens,)](logits, n, out=out, gkeys=gkeys, ng_stride=ng, cand=cand.view(torch.int32),
                                        k=topk, NP=np_, G=pg, BG=g, WAYS=ways or 8, KC=kc, NT=nt,
                                        THREAD_SCAN=(np_ // pg) % nt == 0, **tier, **lens, **extra)
        return out
    ch = max(chunk or (64 if INTERPRET else 2048), g)
    ng = max(-(-n // g), stride)
    gkeys = torch.empty((num_tokens, ng), dtype=torch.int32, device=logits.device)
    counter = torch.empty((num_tokens,), dtype=torch.int32, device=logits.device)
    _topk_kernel[(num_tokens,)](logits, n, out=out, gkeys=gkeys, ng_stride=ng, cand=cand, counter=counter, k=topk,
                                G=g, CH=ch, WAYS=ways or 16, KC=kc, NT=nt, **tier, **lens, **extra)
    return out


def _group(n: int, topk: int) -> int:
    """Entries a group maximum for rows of n: at least 2 * topk maxima a full row, at most 16 entries."""
    return max(1, min(16, next_pow2(n // (2 * topk) + 1) // 2))


@triton.jit
def _local_to_global_kernel(local, token_request, block_table, bt_stride, max_blocks, block_size, slots, lens, k,
                            KP: tl.constexpr):
    """Program t: row t of ``local`` [T, k] int32 -> global slots (SPEC §10) and the row's count of them."""
    t = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, KP)
    inside = r < k
    idx = tl.load(local + t * k + r, mask=inside, other=-1)
    request = tl.load(token_request + t).to(tl.int64)
    ok = inside & (idx >= 0)
    page = tl.where(ok, idx, 0) // block_size
    ok = ok & (page < max_blocks)
    phys = tl.load(block_table + request * bt_stride + page, mask=ok, other=-1)
    ok = ok & (phys >= 0)
    # < 2**31: PagedKVCache refuses a group of more slots (global slots are int32, SPEC §10)
    slot = phys.to(tl.int64) * block_size + tl.where(ok, idx, 0) % block_size
    tl.store(slots + t * k + r, tl.where(ok, slot, -1).to(tl.int32), mask=inside)
    tl.store(lens + t, tl.sum(ok.to(tl.int32), 0))


def local_to_global(local: torch.Tensor, token_request: torch.Tensor, block_table: torch.Tensor,
                    block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``dsv4.metadata.topk_local_to_global`` in one launch: local [T, K] int32 request-local indices (-1
    padded), token_request [T] int32/int64, block_table [R, mb] int32 -> (slots [T, K] int32, -1 where the
    index is negative or its page is past the table or unallocated; lens [T] int32, the slots >= 0 a row).
    Request ids must lie in ``[0, R)`` (the ops' value checks, or ``plan_step``, guarantee it)."""
    num_tokens, k = local.shape
    slots = torch.empty((num_tokens, k), dtype=torch.int32, device=local.device)
    lens = torch.empty((num_tokens,), dtype=torch.int32, device=local.device)
    if num_tokens == 0:
        return slots, lens
    if k == 0:
        return slots, lens.zero_()
    table, token_request = unit_stride(block_table), unit_stride(token_request)  # the backend's one rule
    extra = {} if INTERPRET else {"num_warps": 4}
    _local_to_global_kernel[(num_tokens,)](local.contiguous(), token_request, table, table.stride(0),
                                           table.shape[1], block_size, slots, lens, k, KP=next_pow2(k), **extra)
    return slots, lens
