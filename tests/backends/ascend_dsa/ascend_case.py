"""Realistic sparse-attention batches for the Ascend tests: fresh random data on every call.

Requests get random physical pages; each query token at position ``p`` gets the tables
``dsv4.metadata`` would build (SPEC §10): SWA slots of positions ``max(0, p-127) .. p``, HCA slots
of entries ``0 .. (p+1)//128 - 1``, a CSA top-k subset of the entries ``< (p+1)//4`` in random
order. On top: -1 holes inside the read range (extra columns the reader must skip), stale slots
past ``lens``, empty padding rows, and optionally padded bf16 pages (NaN in the padding).
"""
from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "flashmla"))
from sparse_case import SOFTMAX_SCALE, SparseCase, assert_attention_close, filled_cache

WINDOW = 128
__all__ = ["SOFTMAX_SCALE", "WINDOW", "AscendCase", "assert_close", "make_case", "reference"]


@dataclass
class AscendCase(SparseCase):
    """A :class:`SparseCase` plus the query positions and a contiguous SWA cache for the reference."""

    positions: list[int]
    ref_swa_cache: torch.Tensor          # contiguous copy for the reference (padded pages aside)

    def for_reference(self) -> SparseCase:
        return dataclasses.replace(self, swa_cache=self.ref_swa_cache)


def _tables(lengths: list[int], block: int) -> tuple[list[torch.Tensor], int]:
    """Per request a random block table covering ``lengths[r]`` entries, pages drawn from one pool."""
    pages = [max(-(-n // block), 1) for n in lengths]
    pool = torch.randperm(sum(pages) + 2)
    tables, start = [], 0
    for count in pages:
        tables.append(pool[start: start + count])
        start += count
    return tables, sum(pages) + 2


def _row(slots: list[int], holes: bool) -> list[int]:
    row = []
    for s in slots:
        if holes and torch.rand(()) < 0.08:
            row.append(-1)                    # a hole inside the read range: skipped
        row.append(s)
    return row


def _pack(rows: list[list[int]], width: int | None, stale_pool: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max([len(r) for r in rows] + [width or 0])
    table = torch.randint(0, stale_pool, (len(rows), width), dtype=torch.int32)   # stale past lens
    table[torch.rand(table.shape) < 0.5] = -1
    lens = torch.zeros(len(rows), dtype=torch.int32)
    for t, r in enumerate(rows):
        table[t, : len(r)] = torch.tensor(r, dtype=torch.int32)
        lens[t] = len(r)
    return table, lens


def make_case(*, kind: str, kv_format: str = "ascend_bf16", heads: int = 64, swa_block: int = 64,
              cmp_block: int = 32, topk: int = 512, lengths: tuple[int, ...] = (70, 900, 2200),
              queries: tuple[int, ...] = (3, 2, 1), empty_rows: int = 1, holes: bool = True,
              padded_pages: bool = False) -> AscendCase:
    """One batch; ``kind`` is ``swa``, ``hca`` or ``csa``; request r holds ``lengths[r]`` tokens and
    its last ``queries[r]`` positions are the query tokens (chunked prefill / decode)."""
    ratio = {"swa": 1, "hca": 128, "csa": 4}[kind]
    swa_tables, swa_pages = _tables(list(lengths), swa_block)
    swa_cache = filled_cache(kv_format, swa_pages, swa_block)
    cmp_tables, cmp_pages = _tables([n // ratio for n in lengths], cmp_block)
    extra_cache = filled_cache(kv_format, cmp_pages, cmp_block) if kind != "swa" else None

    swa_rows, cmp_rows, positions = [], [], []
    for r, (length, count) in enumerate(zip(lengths, queries)):
        for p in range(length - count, length):
            window = range(max(0, p - WINDOW + 1), p + 1)
            swa_rows.append(_row([int(swa_tables[r][i // swa_block]) * swa_block + i % swa_block for i in window],
                                 holes))
            visible = (p + 1) // ratio
            if kind == "hca":
                entries = list(range(visible))
            elif kind == "csa":
                entries = torch.randperm(visible)[: min(visible, topk - 8)].tolist()
            else:
                entries = []
            cmp_rows.append(_row([int(cmp_tables[r][c // cmp_block]) * cmp_block + c % cmp_block for c in entries],
                                 holes))
            positions.append(p)
    for _ in range(empty_rows):                    # padding tokens: nothing to attend
        swa_rows.append([])
        cmp_rows.append([])
        positions.append(-1)
    order = torch.randperm(len(swa_rows)).tolist()          # requests interleaved in the batch
    swa_rows, cmp_rows = [swa_rows[i] for i in order], [cmp_rows[i] for i in order]
    positions = [positions[i] for i in order]

    swa_indices, swa_lens = _pack(swa_rows, WINDOW, swa_pages * swa_block)
    extra_indices = extra_lens = None
    if kind == "csa":
        extra_indices, extra_lens = _pack(cmp_rows, topk, cmp_pages * cmp_block)
        extra_indices, extra_lens = extra_indices[:, :topk].contiguous(), extra_lens.clamp(max=topk)
    elif kind == "hca":
        width = max(len(r) for r in cmp_rows)
        extra_indices, extra_lens = _pack(cmp_rows, -(-max(width, 1) // 128) * 128, cmp_pages * cmp_block)
    num_tokens = len(swa_rows)
    q = (torch.randn(num_tokens, heads, 512) * 3).to(torch.bfloat16)
    sink = torch.randn(heads) * 2
    sink[torch.rand(heads) < 0.2] = float("-inf")
    ref_swa = swa_cache
    if padded_pages:
        assert kv_format == "ascend_bf16"
        padded = torch.full((swa_cache.shape[0], swa_block + 16, 1, 512), float("nan"), dtype=torch.bfloat16)
        padded[:, :swa_block] = swa_cache
        swa_cache = padded[:, :swa_block]                   # page stride (B + 16) * 512: NaN would show
    return AscendCase(q, swa_cache, swa_indices, swa_lens, extra_cache, extra_indices, extra_lens,
                      sink.float(), kv_format, positions, ref_swa)


def reference(case: AscendCase) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 ideal reference on the same dequantized caches (SPEC §13)."""
    from sparse_case import reference as sparse_reference

    return sparse_reference(case.for_reference(), "ascend")


def assert_close(out: torch.Tensor, case: AscendCase) -> None:
    """The suite's sparse-attention rule for the ``ascend`` profile against the float64 reference."""
    assert_attention_close(out, None, case.for_reference(), "ascend")
