"""Page pool and per-request block tables of one cache group (SPEC §10), used by ``dsv4.cache``.

A request's table maps its logical pages ``0 .. length-1`` to physical pages (``-1`` once freed).
Sliding groups (SWA, compressor state) free pages from the front only, so the table is ``-1`` on
``[0, first_live)`` and allocated on ``[first_live, length)``: planning a step looks at the pages
that slide out and the pages it appends, never at the whole table, and the table is a persistent
int32 array (capacity doubling) whose live pages are scattered into the step's ``[R, max_pages]``
table on the cache's device. A decode step thus costs the same host work at 4K or 1M tokens of
context; what still grows with context is the fill of that table with -1 (the width is the
absolute logical page count, SPEC §10) and, for the compressed groups, their pages themselves.

Planning is split in two so that a step is all-or-nothing (``PagedKVCache.plan_step``):
:meth:`BlockPool.plan` only reads, then every request's sliding pages are freed (:meth:`release_front`)
before any request allocates (:meth:`append`).
"""
from __future__ import annotations

import numbers
from collections.abc import Hashable, Sequence

import torch
from dsv4.specs.errors import DSV4ValueError

__all__ = ["SPEC_GROUPS", "BlockPool", "PageTable", "pages_per_group"]

# the cache's group names -> SPEC §9 geometry group names
SPEC_GROUPS = {"swa": "swa", "c4": "c4_kv", "c128": "c128_kv", "state4": "c4_state", "state128": "c128_state"}


class PageTable:
    """One request's logical -> physical pages in one group.

    pages: ``[capacity]`` int32, the first ``length`` entries valid (-1 where freed).
    first_live: logical pages ``< first_live`` were freed (they slid out of the group's window).
    """

    __slots__ = ("first_live", "length", "pages")

    def __init__(self) -> None:
        self.pages = torch.full((8,), -1, dtype=torch.int32)
        self.length = 0
        self.first_live = 0

    def view(self) -> torch.Tensor:
        """``[length]`` int32, a view (no copy)."""
        return self.pages[: self.length]

    def extend(self, physical: list[int]) -> None:
        end = self.length + len(physical)
        if end > self.pages.numel():
            grown = torch.full((max(end, 2 * self.pages.numel()),), -1, dtype=torch.int32)
            grown[: self.length] = self.pages[: self.length]
            self.pages = grown
        self.pages[self.length:end] = torch.tensor(physical, dtype=torch.int32)
        self.length = end


class BlockPool:
    """Physical pages of one cache group (``num_blocks`` pages of ``block_size`` entries) and the
    request tables that own them. ``window`` is None for groups that keep every entry.

    tokens_an_entry: raw tokens one entry stands for, from the name: ``r`` for a compressed group ``c{r}``
    (an entry closes every ``r`` tokens, SPEC §5), 1 for ``swa`` and ``state{r}`` (a row a position)."""

    def __init__(self, name: str, block_size: int, num_blocks: int, window: int | None):
        self.name, self.block_size, self.num_blocks, self.window = name, block_size, num_blocks, window
        self.tokens_an_entry = int(name[1:]) if name.startswith("c") else 1
        self.free_pages: list[int] = list(range(num_blocks - 1, -1, -1))  # popped from the end
        self._tables: dict[Hashable, PageTable] = {}

    @property
    def tables(self) -> dict[Hashable, list[int]]:
        """``{request: [physical page of each logical page, -1 where freed]}``: a snapshot (tests, debugging)."""
        return {r: t.view().tolist() for r, t in self._tables.items()}

    def logical_pages(self, request_id: Hashable) -> int:
        """Length of ``request_id``'s table in pages (freed ones included; 0 for a request it has none of)."""
        table = self._tables.get(request_id)
        return 0 if table is None else table.length

    def owned_pages(self) -> int:
        """Pages held by requests (``owned_pages() + len(free_pages) == num_blocks`` always)."""
        return sum(t.length - t.first_live for t in self._tables.values())

    # -- planning (read only) --------------------------------------------------------------------

    def entries(self, num_tokens: int) -> int:
        """Logical entries the group holds once a request has ``num_tokens`` raw tokens."""
        return num_tokens // self.tokens_an_entry

    def plan(self, request_id: Hashable, first_needed: int, end: int) -> tuple[int, int, int]:
        """``(free_stop, freed, needed)``: logical pages ``[first_live, free_stop)`` (``freed`` of them)
        slid out (every entry ``< first_needed``), and how many pages ``[0, end)`` entries need beyond
        the table. O(1)."""
        table = self._tables.get(request_id)
        length, first_live = (table.length, table.first_live) if table is not None else (0, 0)
        stop = first_live
        if self.window is not None:
            # page i is out when all its entries are: (i + 1) * B <= first_needed
            stop = max(first_live, min(length, first_needed // self.block_size))
        needed = max(0, -(-end // self.block_size) - length)
        return stop, stop - first_live, needed

    # -- commit (after every check passed) ---------------------------------------------------------

    def release_front(self, request_id: Hashable, free_stop: int) -> int:
        """Return logical pages ``[first_live, free_stop)`` of ``request_id`` to the pool (to the end of
        ``free_pages``, in order); -> the ``first_live`` before, for :meth:`undo_release`."""
        table = self._tables.get(request_id)
        if table is None or free_stop <= table.first_live:
            return -1
        before = table.first_live
        self.free_pages.extend(table.pages[before:free_stop].tolist())
        table.pages[before:free_stop] = -1
        table.first_live = free_stop
        return before

    def append(self, request_id: Hashable, needed: int) -> None:
        """Give ``request_id`` ``needed`` more pages (the caller checked there are enough)."""
        if needed <= 0:
            return
        if needed > len(self.free_pages):  # a caller bug, never a user error: plan_step checks first
            raise AssertionError(f"{self.name}: {needed} pages asked, {len(self.free_pages)} free")
        taken = self.free_pages[-needed:][::-1]  # the order pop() would give
        del self.free_pages[-needed:]
        self._tables.setdefault(request_id, PageTable()).extend(taken)

    # -- undo (a plan whose metadata could not be built: PagedKVCache.plan_step) -------------------

    def undo_append(self, request_id: Hashable, needed: int) -> None:
        """Exactly reverse the latest ``append(request_id, needed)``: the pages go back to the end of
        ``free_pages`` in the order they were taken from, and a table it created is dropped."""
        table = self._tables.get(request_id)
        if needed <= 0 or table is None:
            return
        start = table.length - needed
        self.free_pages.extend(table.pages[start:table.length].flip(0).tolist())
        table.pages[start:table.length] = -1
        table.length = start
        if table.length == 0:
            del self._tables[request_id]

    def undo_release(self, request_id: Hashable, first_live: int) -> None:
        """Exactly reverse the latest ``release_front`` (whose return value was ``first_live``), after
        every later append was undone: its pages are the last ones of ``free_pages``."""
        table = self._tables.get(request_id)
        if first_live < 0 or table is None:
            return
        count = table.first_live - first_live
        pages = self.free_pages[-count:]
        del self.free_pages[-count:]
        table.pages[first_live:table.first_live] = torch.tensor(pages, dtype=torch.int32)
        table.first_live = first_live

    def release(self, request_id: Hashable) -> None:
        """Return every page of ``request_id``."""
        table = self._tables.pop(request_id, None)
        if table is not None:
            self.free_pages.extend(table.pages[table.first_live:table.length].tolist())

    # -- step tables -------------------------------------------------------------------------------

    def table_tensor(self, request_ids: Sequence[Hashable], device: torch.device, min_width: int = 1) -> torch.Tensor:
        """``[R, max(min_width, longest table)]`` int32 on ``device``, -1 padded: the step's block table.

        Built as a fill of -1 on the device plus one scatter of the live pages ``[first_live, length)``
        of each request: host work and the host->device copy are O(live pages), not O(context)."""
        tables = [self._tables.get(r) for r in request_ids]
        width = max([min_width] + [t.length for t in tables if t is not None])
        out = torch.full((len(request_ids), width), -1, dtype=torch.int32, device=device)
        live = [(row, t) for row, t in enumerate(tables) if t is not None and t.length > t.first_live]
        if live:
            counts = torch.tensor([t.length - t.first_live for _, t in live])
            rows = torch.repeat_interleave(torch.tensor([row for row, _ in live]), counts)
            segment_start = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
            cols = torch.repeat_interleave(torch.tensor([t.first_live for _, t in live]), counts) + \
                torch.arange(int(counts.sum())) - segment_start
            pages = torch.cat([t.pages[t.first_live:t.length] for _, t in live])
            out[rows.to(device), cols.to(device)] = pages.to(device)
        return out


def pages_per_group(num_blocks: int | dict[str, int], wanted: list[str]) -> dict[str, int]:
    """``{group: pages}`` for the ``wanted`` groups from an int or a dict (unknown keys refused)."""
    if isinstance(num_blocks, dict):
        unknown = sorted(set(num_blocks) - set(SPEC_GROUPS), key=str)
        if unknown:
            raise DSV4ValueError.of("num_blocks", f"keys among {sorted(SPEC_GROUPS)}", unknown)
        sizes = {name: num_blocks.get(name) for name in wanted}
    else:
        sizes = dict.fromkeys(wanted, num_blocks)
    for name, n in sizes.items():
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
            what = "missing" if n is None else f"{type(n).__name__} {n!r}"
            raise DSV4ValueError.of(f"num_blocks[{name!r}]", "a positive int", what)
        sizes[name] = int(n)
    return sizes
