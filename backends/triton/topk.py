"""Top-k selection over indexer logits (SPEC §6.3): one program per row, exact, no full sort of long rows.

Group maxima give a threshold tau with at least k entries >= tau (typically ~k); the entries >= tau
are collected through an atomic slot counter and sorted; rows with more than KC such entries (many
ties) fall back to a bisection on the row and an ordered compaction. See ``topk_indices``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from dsv4.backends.triton._common import INTERPRET, next_pow2

__all__ = ["topk_indices"]


@triton.jit
def _ordered_key(x):
    """fp32 -> int32 whose signed order is x's order; -inf and NaN (invalid entries) -> -2**31."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(x > float("-inf"), tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits), -2147483648)


@triton.jit
def _narrow(keys, n, k, lo, hi, c_lo, c_hi, spread, FLOAT: tl.constexpr, CH: tl.constexpr, WAYS: tl.constexpr):
    """WAYS-way bisection on the order keys of ``keys[0:n]`` (fp32 logits when FLOAT, else int32 keys):
    keeps count(key >= lo) = c_lo >= k > count(key >= hi) = c_hi, stops when c_lo - c_hi <= spread or
    hi == lo + 1 (lo is then the k-th key). One pass over the keys a step."""
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
def _topk_kernel(logits, n, out, gkeys, ng_stride, cand, counter, k, G: tl.constexpr, CH: tl.constexpr,
                 WAYS: tl.constexpr, KC: tl.constexpr):
    """One program per row of logits [T, n] fp32: out[t, :k] int32 = indices of the k largest finite logits,
    then -1 (SPEC §6.3: which of tied entries is unspecified; valid entries sorted by score).

    1. Max order key of each group of G entries -> ``gkeys`` [T, ng_stride] int32; tau = a key with at
       least k group maxima >= tau (bisection on the maxima), so at least k entries are >= tau.
    2. Entries >= tau (typically a few times k) -> ``cand`` [T, KC] int64 (key << 32 | index) through
       an atomic slot counter; sorted, the first k are the answer.
    3. More than KC candidates (many ties): bisection on the row itself, then an ordered compaction.
    """
    t = tl.program_id(0).to(tl.int64)
    NCH: tl.constexpr = min(CH, 512)  # bisection chunk ([NCH, WAYS] counters in registers)
    row = logits + t * n
    grow = gkeys + t * ng_stride
    offs = tl.arange(0, CH)
    ng = (n + G - 1) // G
    lowest = -2147483648
    gcount_acc = tl.zeros([CH // G], tl.int32)
    gmin_acc = tl.full([CH // G], 2147483647, tl.int32)
    max_acc = tl.full([CH // G], lowest, tl.int32)
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
    groups = tl.sum(gcount_acc, 0)
    hi = tl.max(max_acc, 0).to(tl.int64) + 1
    tl.store(counter + t, 0)
    tl.debug_barrier()  # gkeys and the counter, written by other threads of this program
    tau = lowest + 1  # fewer than k valid groups: every valid entry is a candidate
    if groups >= k:
        lo = tl.min(gmin_acc, 0).to(tl.int64)
        tau = _narrow(grow, ng, k, lo, hi, groups, groups * 0, k // 4, False, NCH, WAYS)[0].to(tl.int32)
    crow = cand + t * KC
    x_next = tl.load(row + offs, mask=offs < n, other=float("-inf"))
    for s in range(0, n, CH):
        j = s + offs
        key = _ordered_key(x_next)
        x_next = tl.load(row + j + CH, mask=j + CH < n, other=float("-inf"))  # one chunk ahead
        take = key >= tau
        slot = tl.atomic_add(counter + t + offs * 0, 1, mask=take, sem="relaxed", scope="cta")
        tl.store(crow + slot, (key.to(tl.int64) << 32) | j.to(tl.int64), mask=take & (slot < KC))
    tl.debug_barrier()
    total = tl.atomic_add(counter + t, 0, sem="relaxed", scope="cta")
    r = tl.arange(0, KC)
    out_row = out + t * k
    if total <= KC:
        best = tl.sort(tl.load(crow + r, mask=r < total, other=-9223372036854775807 - 1), 0, descending=True)
        tl.store(out_row + r, tl.where(r < total, (best & 0x7FFFFFFF).to(tl.int32), -1), mask=r < k)
    else:
        lo = tau.to(tl.int64)
        if total > k:  # many ties around the k-th value: bisection on the row (count(key >= tau) = total)
            lo, hi, _, c_hi = _narrow(row, n, k, lo, hi, total, total * 0, KC, True, NCH, WAYS)
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
def _topk_sort_kernel(logits, n, out, k, NP: tl.constexpr):
    """Rows of at most NP entries: one sort of the whole row's (order key << 32 | index), descending;
    the first k valid are the answer, as ``_topk_kernel`` orders them (score, then the higher index)."""
    t = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, NP)
    key = _ordered_key(tl.load(logits + t * n + r, mask=r < n, other=float("-inf")))
    best = tl.sort((key.to(tl.int64) << 32) | r.to(tl.int64), 0, descending=True)
    valid = (best >> 32) > -2147483648
    tl.store(out + t * k + r, tl.where(valid, (best & 0x7FFFFFFF).to(tl.int32), -1), mask=r < k)


def topk_indices(logits: torch.Tensor, topk: int, *, chunk: int | None = None, ways: int = 16,
                 candidates: int | None = None, group: int | None = None, num_warps: int | None = None,
                 sort_max: int | None = None) -> torch.Tensor:
    """[T, topk] int32: per row the indices of the ``topk`` largest finite logits (by score), then -1.

    Exact selection (ties broken arbitrarily); ``chunk``, ``ways`` (bisection fan-out), ``candidates``
    (the largest candidate set sorted), ``group`` (entries a group maximum) and ``num_warps`` are tuning
    knobs. Default groups leave >= 2 * topk group maxima a row, so tau keeps typically ~topk candidates.
    Rows no longer than the candidate buffer (``n <= candidates``, e.g. 1024 entries at 4K context) skip
    the threshold search: one sort of the row (``sort_max``: 0 turns that off).
    """
    num_tokens, n = logits.shape
    out = torch.empty((num_tokens, topk), dtype=torch.int32, device=logits.device)
    if num_tokens == 0:
        return out
    if n == 0:
        return out.fill_(-1)
    kc = next_pow2(max(candidates or 1024, 2 * topk if candidates is None else topk))
    if n <= (kc if sort_max is None else sort_max):
        extra = {} if INTERPRET else {"num_warps": num_warps or 8}
        _topk_sort_kernel[(num_tokens,)](logits, n, out, topk, NP=max(next_pow2(n), next_pow2(topk)), **extra)
        return out
    g = group or max(1, min(16, next_pow2(n // (2 * topk) + 1) // 2))
    ch = max(chunk or (64 if INTERPRET else 2048), g)
    ng = -(-n // g)
    gkeys = torch.empty((num_tokens, ng), dtype=torch.int32, device=logits.device)
    cand = torch.empty((num_tokens, kc), dtype=torch.int64, device=logits.device)
    counter = torch.empty((num_tokens,), dtype=torch.int32, device=logits.device)
    extra = {} if INTERPRET else {"num_warps": num_warps or 16}
    _topk_kernel[(num_tokens,)](logits, n, out, gkeys, ng, cand, counter, topk, G=g, CH=ch, WAYS=ways, KC=kc,
                                **extra)
    return out
