"""Ascend adapters (SPEC §9.2, §10; research: vendor_backends.md §1.4-§1.5). Pure torch, no vendor import.

``npu_sparse_attn_sharedkv`` takes TND queries with per-request ``cu_seqlens_q`` / ``seqused_kv``,
reads the SWA cache through a band mask over positions (``[p - 127, p]`` of a request whose query
sits at ``p = seqused_kv - 1``) and a block table, and the compressed cache through
``cmp_block_table``: densely under the causal rule ``c < (p + 1) // cmp_ratio`` (HCA), or at the
request-local ``cmp_sparse_indices`` the same rule admits (CSA). Our op contract
(ARCHITECTURE §3) passes global slot tables only. :func:`build_tables` maps one onto the other
exactly by making every token its own *virtual request* of one query:

- SWA: the token's valid slots must be consecutive positions of one request (SPEC §10: position
  ``i`` at ``block_table[i // B] * B + i % B``). The virtual request puts them at positions
  ``j0 .. j0 + n - 1`` with ``j0 = s0 % B + lead * B`` (``lead`` dummy pages first) and length
  ``S = j0 + n``; the band then reads exactly those ``n`` positions when ``n == 128``, or when
  ``n < 128`` and ``j0 == 0`` (the window of a request younger than 128 tokens starts at 0).
- HCA (dense): entry ``c`` of the list must be compressed entry ``c`` of one request (slot
  offsets ``c % Bc``, consecutive within a page); the virtual cmp table is its pages and
  ``S // 128 == n`` admits exactly the ``n`` entries.
- CSA (sparse): any slots. Distinct pages become virtual pages, ranked by their largest used
  offset (descending), which minimises the largest virtual index ``v``; ``S >= 4 * (v + 1)`` makes
  every listed entry visible. The leading dummy SWA pages give ``S`` that freedom.

Impossible inputs raise ``DSV4ValueError`` naming the argument: SWA slots that are not
consecutive positions, more than 128 SWA entries, a window of fewer than 128 entries that does not
start at a page boundary, compressed entries for a row with no SWA entry (the band always holds the
query itself), an HCA list that is not entries ``0, 1, ...`` of one request, more valid top-k
entries than the operator's width, and (rows under 128 SWA entries) compressed entries the young
window cannot see (HCA count ``!= n // 128``, CSA index ``>= n // 4``).

A2/A3 scatters take slots as ``[block, offset]`` int32 pairs, A5 takes flat slots; mixing the two
is silent corruption, so that conversion lives here too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from dsv4.backends.ascend_dsa.capabilities import WINDOW
from dsv4.specs.errors import DSV4ValueError
from dsv4.specs.layer_kinds import LayerKind

__all__ = ["PAD_PAGE", "AscendTables", "build_tables", "extra_mode", "slots_to_block_offset"]

ExtraMode = Literal["swa", "dense", "sparse"]
# Block-table columns that are never read (leading dummy pages, row padding) hold page 0: a real
# page, so that a kernel prefetching a whole table row stays in bounds.
PAD_PAGE = 0


def slots_to_block_offset(slots: torch.Tensor, block_size: int) -> torch.Tensor:
    """slots [N] int64 (``block * B + offset``, -1 skip) -> [N, 2] int32 ``[block, offset]`` (-1 rows kept)."""
    pairs = torch.stack([torch.div(slots, block_size, rounding_mode="floor"), slots % block_size], dim=1)
    return torch.where((slots >= 0)[:, None], pairs, torch.full_like(pairs, -1)).to(torch.int32)


@dataclass(frozen=True)
class AscendTables:
    """Operator inputs for ``T`` virtual requests of one query each (all int32, on the target device).

    cu_seqlens_q: ``[T+1]`` ``0..T``. seqused_kv: ``[T]`` virtual lengths ``S``.
    ori_block_table: ``[T, Mo]`` SWA pages. cmp_block_table: ``[T, Mc]`` or None (SWA-only).
    cmp_sparse_indices: ``[T, 1, K]`` virtual request-local indices, valid first, -1 after (sparse
    mode only). cmp_ratio: 1 (SWA-only), 4 (sparse) or 128 (dense). cmp_topk: K or 0.
    max_seqlen_kv: host int, ``max(S)`` (the metadata op sizes its plan with it).
    """

    mode: ExtraMode
    cu_seqlens_q: torch.Tensor
    seqused_kv: torch.Tensor
    ori_block_table: torch.Tensor
    cmp_block_table: torch.Tensor | None
    cmp_sparse_indices: torch.Tensor | None
    cmp_ratio: int
    cmp_topk: int
    max_seqlen_kv: int


def extra_mode(width: int | None, topk_widths: frozenset[int]) -> ExtraMode:
    """``swa`` without a compressed table; ``sparse`` (CSA) when ``width`` is an operator top-k width,
    else ``dense`` (HCA lists have context-dependent widths). An HCA list whose width happens to be a
    top-k width runs sparse: every listed entry is visible there too, the same function."""
    if width is None:
        return "swa"
    return "sparse" if width in topk_widths else "dense"


def _compact(indices: torch.Tensor, lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 ``[T, W]`` + lens ``[T]`` -> (int64 ``[T, W]`` valid entries first in order, -1 after; counts)."""
    idx = indices.long()
    cols = torch.arange(idx.shape[1])
    valid = (cols[None, :] < lens.long()[:, None]) & (idx >= 0)     # ARCHITECTURE §3: only lens[t], -1 skipped
    order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices
    return torch.gather(torch.where(valid, idx, torch.full_like(idx, -1)), 1, order), valid.sum(1)


def _first_bad(bad: torch.Tensor) -> tuple[int, int]:
    t, k = bad.nonzero()[0].tolist()
    return t, k


def _check_run(compact: torch.Tensor, count: torch.Tensor, block: int, start_offset: torch.Tensor,
               argument: str, what: str) -> None:
    """Every entry k < count sits at offset ``(start_offset + k) % block``, and in its predecessor's page
    unless it opens a page: the slots of consecutive positions through one block table (SPEC §10)."""
    k = torch.arange(compact.shape[1])
    offset = compact % block
    prev = torch.cat([compact[:, :1], compact[:, :-1]], dim=1)
    ok = (offset == (start_offset[:, None] + k[None, :]) % block) & (
        (k[None, :] == 0) | (offset == 0) | (compact == prev + 1))
    bad = (k[None, :] < count[:, None]) & ~ok
    if bool(bad.any()):
        t, j = _first_bad(bad)
        got = f"row {t}: entry {j} is slot {int(compact[t, j])}" + (
            f" after slot {int(prev[t, j])}" if j else f" (offset {int(offset[t, j])})")
        raise DSV4ValueError.of(argument, f"{what} (block size {block}; -1 entries aside)", got)


def _sparse_virtual(compact: torch.Tensor, count: torch.Tensor, block: int,
                    topk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CSA: valid slots -> (indices ``[T, topk]`` int64 -1 padded, cmp table ``[T, G]``, largest index ``[T]``)."""
    num_tokens = compact.shape[0]
    keys = torch.where(compact >= 0, compact, torch.full_like(compact, torch.iinfo(torch.int64).max))
    slots = keys.sort(dim=1).values[:, :topk]                         # pages grouped; duplicates kept
    k = torch.arange(slots.shape[1])
    valid = k[None, :] < count[:, None]
    page, offset = slots // block, slots % block
    prev_page = torch.cat([page[:, :1], page[:, :-1]], dim=1)
    opens = valid & ((k[None, :] == 0) | (page != prev_page))
    groups = max(int(opens.sum(1).max()), 1) if num_tokens else 1
    gid = torch.where(valid, opens.long().cumsum(1) - 1, torch.full_like(page, groups))  # invalid -> dump col
    gmax = torch.full((num_tokens, groups + 1), -1, dtype=torch.int64)
    gmax.scatter_reduce_(1, gid, torch.where(valid, offset, torch.full_like(offset, -1)), "amax")
    gpage = torch.full((num_tokens, groups + 1), PAD_PAGE, dtype=torch.int64)
    gpage.scatter_(1, torch.where(opens, gid, torch.full_like(gid, groups)),
                   torch.where(opens, page, torch.full_like(page, PAD_PAGE)))
    gmax, gpage = gmax[:, :groups], gpage[:, :groups]
    # Largest used offset first: the last virtual page then holds the smallest one, which
    # minimises the largest virtual index (it always lies in the last page).
    order = torch.sort(-gmax, dim=1, stable=True).indices             # order[t, rank] = group
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(groups).expand(num_tokens, -1).contiguous())
    gid_safe = gid.clamp(max=groups - 1)
    virtual = torch.where(valid, rank.gather(1, gid_safe) * block + offset, torch.full_like(offset, -1))
    table = torch.where(gmax.gather(1, order) >= 0, gpage.gather(1, order), torch.full_like(order, PAD_PAGE))
    if virtual.shape[1] < topk:
        virtual = torch.cat([virtual, virtual.new_full((num_tokens, topk - virtual.shape[1]), -1)], dim=1)
    return virtual, table, virtual.amax(1) if topk else torch.full((num_tokens,), -1, dtype=torch.int64)


def _dense_virtual(compact: torch.Tensor, count: torch.Tensor, block: int) -> torch.Tensor:
    """HCA: entries 0..n-1 of one request -> cmp table ``[T, ceil(max n / block)]`` (pages of entries k*block)."""
    _check_run(compact, count, block, torch.zeros_like(count), "extra_indices",
               "an HCA list: the slots of compressed entries 0, 1, 2, ... of one request, or a CSA top-k "
               "of the operator's width")
    columns = max(-(-int(count.max()) // block), 1) if compact.shape[0] else 1
    heads = compact[:, ::block][:, :columns]
    if heads.shape[1] < columns:
        heads = torch.cat([heads, heads.new_full((heads.shape[0], columns - heads.shape[1]), -1)], dim=1)
    used = torch.arange(columns)[None, :] * block < count[:, None]
    return torch.where(used, heads // block, torch.full_like(heads, PAD_PAGE))


def build_tables(swa_indices: torch.Tensor, swa_lens: torch.Tensor, swa_block_size: int,
                 extra_indices: torch.Tensor | None, extra_lens: torch.Tensor | None,
                 extra_block_size: int | None, *, mode: ExtraMode, topk: int = 0,
                 device: torch.device | str | None = None) -> AscendTables:
    """Virtual-request operator inputs reproducing our tables exactly (module docstring).

    Args:
        swa_indices: ``[T, Wi]`` int32 global SWA slots; swa_lens ``[T]`` int32 (ARCHITECTURE §3).
        swa_block_size: SWA page size ``B``.
        extra_indices / extra_lens / extra_block_size: the compressed table and page size ``Bc``,
            None for SWA-only.
        mode: ``swa``, ``dense`` (HCA, ``cmp_ratio`` 128) or ``sparse`` (CSA, ``cmp_ratio`` 4).
        topk: the operator's ``cmp_sparse_indices`` width ``K`` (sparse mode).
        device: where the tables go (default: ``swa_indices.device``).

    Reads the tables on the host (one device sync): the lengths it derives size the operator's
    tiling plan, which is host-built too. Raises ``DSV4ValueError`` for the inputs the operator
    cannot express (module docstring).
    """
    device = swa_indices.device if device is None else torch.device(device)
    swa_compact, n = _compact(swa_indices.cpu(), swa_lens.cpu())
    num_tokens = swa_compact.shape[0]
    block = swa_block_size
    if num_tokens and int(n.max()) > WINDOW:
        t = int(n.argmax())
        raise DSV4ValueError.of("swa_indices", f"at most {WINDOW} valid entries a row (the operator's band, "
                                f"ori_win_left {WINDOW - 1})", f"row {t}: {int(n[t])}")
    s0 = swa_compact[:, 0].clamp(min=0) if swa_compact.shape[1] else torch.zeros(num_tokens, dtype=torch.int64)
    off0 = s0 % block
    _check_run(swa_compact, n, block, off0, "swa_indices",
               "the slots of consecutive positions of one request (SPEC §10: block_table[i // B] * B + i % B)")
    full, young = n == WINDOW, (n > 0) & (n < WINDOW)
    bad = young & (off0 != 0)
    if bool(bad.any()):
        t = int(bad.nonzero()[0])
        raise DSV4ValueError.of("swa_indices", f"a window of fewer than {WINDOW} entries to start at position 0 "
                                "of its request (a slot at offset 0 of a page)",
                                f"row {t}: {int(n[t])} entries from slot {int(s0[t])} (offset {int(off0[t])})")

    base = torch.where(full, off0 + WINDOW, n)           # S with no leading dummy page
    lead = torch.zeros_like(n)
    cmp_table = cmp_indices = None
    cmp_ratio, cmp_topk = 1, 0
    if mode != "swa":
        if extra_indices is None or extra_lens is None or extra_block_size is None:
            raise DSV4ValueError.of("extra_indices", f"a compressed table for mode {mode!r}", None)
        extra_compact, m = _compact(extra_indices.cpu(), extra_lens.cpu())
        cblock = extra_block_size
        orphan = (n == 0) & (m > 0)
        if bool(orphan.any()):
            t = int(orphan.nonzero()[0])
            raise DSV4ValueError.of("swa_lens", "at least one SWA entry in a row with compressed entries (the "
                                    "operator's band always holds the query's own position)",
                                    f"row {t}: 0 SWA entries, {int(m[t])} compressed")
        if mode == "sparse":
            cmp_ratio, cmp_topk = LayerKind.CSA.ratio, topk
            if num_tokens and int(m.max()) > topk:
                t = int(m.argmax())
                raise DSV4ValueError.of("extra_lens", f"at most {topk} valid entries a row (the operator's "
                                        "cmp_sparse_indices width)", f"row {t}: {int(m[t])}")
            cmp_indices, cmp_table, largest = _sparse_virtual(extra_compact, m, cblock, topk)
            low = torch.where(m > 0, cmp_ratio * (largest + 1), torch.zeros_like(m))   # S // 4 > every index
            high = torch.full_like(m, torch.iinfo(torch.int32).max)
            need = f"indices below n // {cmp_ratio}"
        else:
            cmp_ratio = LayerKind.HCA.ratio
            cmp_table = _dense_virtual(extra_compact, m, cblock)
            low, high = cmp_ratio * m, cmp_ratio * m + cmp_ratio - 1                  # S // 128 == m
            need = f"exactly n // {cmp_ratio} entries"
        # Rows under WINDOW SWA entries have S = n fixed; full rows may add dummy pages.
        lead = torch.where(full, (low - base).clamp(min=0).add(block - 1).div(block, rounding_mode="floor"), lead)
        seq = base + lead * block
        bad = (seq < low) | (seq > high)
        if bool(bad.any()):
            t = int(bad.nonzero()[0])
            raise DSV4ValueError.of("extra_indices", f"compressed entries that the row's SWA window admits "
                                    f"(a request of n tokens sees {need})",
                                    f"row {t}: n = {int(n[t])} SWA entries (from slot offset {int(off0[t])}), "
                                    f"{int(m[t])} compressed entries needing n in [{int(low[t])}, {int(high[t])}]")
    seq = base + lead * block

    # SWA table: positions j0 + k (k < n) at column (j0 + k) // B, with j0 = off0 + lead * B.
    columns = max(int(seq.add(block - 1).div(block, rounding_mode="floor").max()), 1) if num_tokens else 1
    ori = torch.full((num_tokens, columns + 1), PAD_PAGE, dtype=torch.int64)
    if swa_compact.shape[1]:
        k = torch.arange(swa_compact.shape[1])
        col = lead[:, None] + (off0[:, None] + k[None, :]) // block
        col = torch.where(k[None, :] < n[:, None], col, torch.full_like(col, columns))   # dump column
        ori.scatter_(1, col, torch.where(swa_compact >= 0, swa_compact // block, torch.full_like(col, PAD_PAGE)))
    ori[:, columns] = PAD_PAGE

    def put(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x.to(device=device, dtype=torch.int32)

    return AscendTables(
        mode=mode,
        cu_seqlens_q=torch.arange(num_tokens + 1, dtype=torch.int32, device=device),
        seqused_kv=put(seq),
        ori_block_table=put(ori[:, :columns]),
        cmp_block_table=put(cmp_table),
        cmp_sparse_indices=None if cmp_indices is None else put(cmp_indices).unsqueeze(1),
        cmp_ratio=cmp_ratio,
        cmp_topk=cmp_topk,
        max_seqlen_kv=int(seq.max()) if num_tokens else 0,
    )
