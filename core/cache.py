"""Paged KV caches of DSV4 attention layers and the per-step planner (SPEC §9-§10).

One ``PagedKVCache`` holds, for each layer it serves, the storage of every cache group of SPEC §9:

| group | page holds | kept | layers |
|---|---|---|---|
| ``swa`` | ``B_swa`` raw tokens (latent, cache format) | last ``window`` tokens | all |
| ``c4`` / ``c128`` | compressed entries (latent); for r=4 also the indexer keys | all | CSA / HCA |
| ``state4`` / ``state128`` | compressor-state rows by absolute position (fp32) | last ``coff*r`` | CSA / HCA |

Layers of one group share the group's block tables (one allocation pattern), each layer owning its
own storage tensor. Page sizes come from ``dsv4.specs.geometry``; bytes from ``dsv4.specs.formats``.

``plan_step`` allocates pages for the new tokens of a mixed batch (prefills, chunks, decodes),
frees pages that slid out of every window, and returns a :class:`Step` carrying the
:class:`~dsv4.metadata.StepMetadata`. A rejected plan changes nothing.
"""
from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

import torch
from dsv4.metadata import (
    INDEX_ALIGNMENT,
    GroupTable,
    RatioMetadata,
    StepMetadata,
    round_up,
    slots_from_block_table,
)
from dsv4.specs.config import ModelConfig
from dsv4.specs.errors import CacheLayoutError, DSV4ValueError
from dsv4.specs.layer_kinds import LayerKind
from dsv4.specs.numerics import get_profile

__all__ = ["LayerCache", "OutOfBlocksError", "PagedKVCache", "Step", "StepRequest"]


class OutOfBlocksError(DSV4ValueError):
    """A step needs more pages than a group has free; nothing was allocated."""


@dataclass(frozen=True)
class StepRequest:
    """One request's share of a step: ``num_tokens`` new tokens appended to ``request_id``."""

    request_id: Hashable
    num_tokens: int


@dataclass
class LayerCache:
    """Storage of one layer. Tensors are the codecs' storage (see dsv4.codecs)."""

    layer_id: int
    kind: LayerKind
    swa: torch.Tensor
    compressed: torch.Tensor | None = None
    state: torch.Tensor | None = None
    indexer_keys: torch.Tensor | None = None
    indexer_state: torch.Tensor | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every storage tensor by group name (for snapshots in tests and byte checks)."""
        names = ("swa", "compressed", "state", "indexer_keys", "indexer_state")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}


@dataclass(frozen=True)
class Step:
    """A planned step: the metadata plus the cache it refers to."""

    metadata: StepMetadata
    cache: PagedKVCache


class _Group:
    """Page pool + per-request logical->physical tables of one cache group."""

    def __init__(self, name: str, block_size: int, num_blocks: int, window: int | None):
        self.name, self.block_size, self.num_blocks, self.window = name, block_size, num_blocks, window
        self.free_pages: list[int] = list(range(num_blocks - 1, -1, -1))
        self.tables: dict[Hashable, list[int]] = {}

    def plan(self, request_id: Hashable, first_needed: int, end: int) -> tuple[list[int], int]:
        """Logical pages to free (all entries < first_needed) and how many new pages ``[.., end)`` needs."""
        table = self.tables.get(request_id, [])
        B = self.block_size
        to_free = []
        if self.window is not None:
            for logical, phys in enumerate(table):
                if phys >= 0 and (logical + 1) * B <= first_needed:
                    to_free.append(logical)
        needed = max(0, -(-end // B) - len(table))
        return to_free, needed

    def commit(self, request_id: Hashable, to_free: list[int], needed: int) -> None:
        table = self.tables.setdefault(request_id, [])
        for logical in to_free:
            self.free_pages.append(table[logical])
            table[logical] = -1
        for _ in range(needed):
            table.append(self.free_pages.pop())

    def release(self, request_id: Hashable) -> None:
        for phys in self.tables.pop(request_id, []):
            if phys >= 0:
                self.free_pages.append(phys)

    def table_tensor(self, request_ids: Sequence[Hashable]) -> torch.Tensor:
        width = max(1, max(len(self.tables.get(r, [])) for r in request_ids))
        out = torch.full((len(request_ids), width), -1, dtype=torch.int32)
        for row, r in enumerate(request_ids):
            t = self.tables.get(r, [])
            if t:
                out[row, : len(t)] = torch.tensor(t, dtype=torch.int32)
        return out


class PagedKVCache:
    """Paged caches for ``layer_ids`` of a model (SPEC §9), with block allocation per request.

    Args:
        cfg: the model configuration.
        layer_ids: layers this cache serves (their kinds decide which groups exist).
        num_blocks: pages per group; an int for every group or a dict ``{group: pages}``.
        device: where the storage and the step metadata live.
        profile: numerics profile name (SPEC §6.6); the cache is tagged with it and a layer of
            another profile refuses it.
        kv_format: latent cache format (default: the geometry's own, else the profile's ``kv_format``).
        indexer_key_format: indexer key format (default: the geometry's own, else the profile's).
        geometry: page geometry of ``dsv4.specs.geometry`` (``vllm``, ``ascend``, ``ascend-a5``).
            ``ascend`` brings ``ascend_bf16`` / ``indexer_ascend_int8``, ``ascend-a5`` brings
            ``ascend_a5`` / ``indexer_fp8``; ``vllm`` has none. ``self.kv_format`` and
            ``self.indexer_key_format`` are the resolved formats, the ones allocated.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        layer_ids: Iterable[int],
        num_blocks: int | dict[str, int],
        device: str | torch.device = "cpu",
        profile: str = "deepseek",
        kv_format: str | None = None,
        indexer_key_format: str | None = None,
        geometry: str = "vllm",
    ):
        from dsv4.codecs import get_codec
        from dsv4.specs.geometry import cache_geometry

        self.cfg = cfg
        self.device = torch.empty(0, device=device).device  # "cuda" -> "cuda:<current>"
        self.profile = get_profile(profile).name
        self.layer_ids = tuple(sorted({int(i) for i in layer_ids}))
        if not self.layer_ids:
            raise DSV4ValueError.of("layer_ids", "at least one layer id", "an empty list")
        kinds = {i: cfg.layer_kind(i) for i in self.layer_ids}
        self.window = cfg.sliding_window

        # None stays None: cache_geometry resolves explicit > geometry's own > profile's formats,
        # and the codecs below allocate exactly what it resolved.
        geo = cache_geometry(cfg, profile, geometry, kv_format=kv_format, indexer_key_format=indexer_key_format)
        self.kv_format, self.indexer_key_format = geo.kv_format, geo.indexer_key_format
        spec_names = {"swa": "swa", "c4": "c4_kv", "c128": "c128_kv", "state4": "c4_state", "state128": "c128_state"}
        wanted = {"swa"}
        for kind in set(kinds.values()):
            if kind.has_compressor:
                wanted |= {f"c{kind.ratio}", f"state{kind.ratio}"}

        def pages(name: str) -> int:
            n = num_blocks.get(name) if isinstance(num_blocks, dict) else num_blocks
            if not isinstance(n, int) or n < 1:
                raise DSV4ValueError.of(f"num_blocks[{name!r}]", "a positive int", n)
            return n

        self.groups: dict[str, _Group] = {}
        for name in sorted(wanted):
            g = geo.group(spec_names[name])
            self.groups[name] = _Group(name, g.entries_per_page, pages(name), g.window)
        if "c4" in self.groups:  # the indexer keys and state share the c4 tables (same page geometry)
            for shared, own in (("c4_indexer_keys", "c4"), ("c4_indexer_state", "state4")):
                if geo.group(shared).entries_per_page != self.groups[own].block_size:
                    raise CacheLayoutError.of(f"geometry {geometry!r} group {shared!r}",
                                              f"{self.groups[own].block_size} entries a page (as {own!r})",
                                              geo.group(shared).entries_per_page)

        kv_codec = get_codec(self.kv_format)
        self.layers: dict[int, LayerCache] = {}
        for layer_id, kind in kinds.items():
            swa = self.groups["swa"]
            lc = LayerCache(layer_id, kind, kv_codec.allocate(swa.num_blocks, swa.block_size, self.device))
            if kind.has_compressor:
                comp, state = self.groups[f"c{kind.ratio}"], self.groups[f"state{kind.ratio}"]
                lc.compressed = kv_codec.allocate(comp.num_blocks, comp.block_size, self.device)
                state_dim = 2 * kind.coff * cfg.head_dim  # SPEC §9.4: [kv | score+ape]
                lc.state = torch.zeros(state.num_blocks, state.block_size, state_dim, dtype=torch.float32,
                                       device=self.device)
            if kind.has_indexer:
                key_codec = get_codec(self.indexer_key_format)
                lc.indexer_keys = key_codec.allocate(comp.num_blocks, comp.block_size, self.device)
                lc.indexer_state = torch.zeros(state.num_blocks, state.block_size, 2 * 2 * cfg.index_head_dim,
                                               dtype=torch.float32, device=self.device)
            self.layers[layer_id] = lc
        self.seq_lens: dict[Hashable, int] = {}

    # -- lifecycle -------------------------------------------------------------------------------

    def layer(self, layer_id: int) -> LayerCache:
        if layer_id not in self.layers:
            raise DSV4ValueError.of("layer_id", f"one of {self.layer_ids}", layer_id)
        return self.layers[layer_id]

    def free(self, request_id: Hashable) -> None:
        """Release every page of ``request_id`` in every group."""
        if request_id not in self.seq_lens:
            raise DSV4ValueError.of("request_id", "a request known to this cache", request_id)
        for group in self.groups.values():
            group.release(request_id)
        del self.seq_lens[request_id]

    def free_pages(self) -> dict[str, int]:
        return {name: len(g.free_pages) for name, g in self.groups.items()}

    # -- planning --------------------------------------------------------------------------------

    def _first_needed(self, name: str, start: int) -> int:
        """Oldest logical entry a step starting at ``start`` can still read in group ``name``."""
        if name == "swa":
            return start - self.window + 1
        if name.startswith("state"):
            ratio = int(name[len("state"):])
            return start - LayerKind.from_ratio(ratio).coff * ratio + 1
        return 0

    def _end(self, name: str, end_pos: int) -> int:
        """Logical entries group ``name`` holds once ``end_pos`` raw tokens exist."""
        if name.startswith("c"):
            return end_pos // int(name[1:])
        return end_pos

    def plan_step(self, requests: Sequence[StepRequest]) -> Step:
        """Allocate pages for a step and derive its metadata (SPEC §10).

        requests: the batch rows in order; each appends ``num_tokens`` >= 1 tokens to its request
        (a new request id starts at position 0). Raises before changing anything when a request is
        malformed or a group runs out of pages.
        """
        if not requests:
            raise DSV4ValueError.of("requests", "at least one StepRequest", "an empty list")
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids):
            raise DSV4ValueError.of("requests", "each request id at most once per step", ids)
        for r in requests:
            if not isinstance(r.num_tokens, int) or r.num_tokens < 1:
                raise DSV4ValueError.of(f"requests[{r.request_id!r}].num_tokens", "an int >= 1", r.num_tokens)
        starts = [self.seq_lens.get(r.request_id, 0) for r in requests]
        ends = [s + r.num_tokens for s, r in zip(starts, requests)]
        limit = self.cfg.max_position_embeddings
        for r, e in zip(requests, ends):
            if e > limit:
                raise DSV4ValueError.of(f"requests[{r.request_id!r}]", f"a sequence of <= {limit} tokens", e)

        plans = {}
        for name, group in self.groups.items():
            plans[name] = [group.plan(r.request_id, self._first_needed(name, s), self._end(name, e))
                           for r, s, e in zip(requests, starts, ends)]
            freed = sum(len(f) for f, _ in plans[name])
            needed = sum(n for _, n in plans[name])
            if needed > len(group.free_pages) + freed:
                raise OutOfBlocksError.of(f"cache group {name!r}", f"<= {len(group.free_pages) + freed} free pages",
                                          f"a step needing {needed}")
        for name, group in self.groups.items():
            for r, (to_free, needed) in zip(requests, plans[name]):
                group.commit(r.request_id, to_free, needed)
        for r, e in zip(requests, ends):
            self.seq_lens[r.request_id] = e
        return Step(self._metadata(ids, starts, [r.num_tokens for r in requests]), self)

    def _metadata(self, ids: list, starts: list[int], lens: list[int]) -> StepMetadata:
        qlens = torch.tensor(lens, dtype=torch.int64)
        token_request = torch.repeat_interleave(torch.arange(len(ids), dtype=torch.int64), qlens)
        first = torch.tensor(starts, dtype=torch.int64)
        offsets = torch.arange(int(qlens.sum())) - torch.repeat_interleave(torch.cumsum(qlens, 0) - qlens, qlens)
        positions = first[token_request] + offsets
        query_start_loc = torch.zeros(len(ids) + 1, dtype=torch.int32)
        query_start_loc[1:] = torch.cumsum(qlens, 0).to(torch.int32)
        seq_lens = (first + qlens).to(torch.int32)

        swa_group = self.groups["swa"]
        swa_bt = swa_group.table_tensor(ids)
        W = self.window
        swa_slot_mapping = slots_from_block_table(positions, token_request, swa_bt, swa_group.block_size)
        window_start = (positions - W + 1).clamp(min=0)
        swa_lens = positions - window_start + 1
        k = torch.arange(W)
        local = window_start[:, None] + k[None, :]
        local = torch.where(k[None, :] < swa_lens[:, None], local, torch.full_like(local, -1))
        swa_indices = slots_from_block_table(local, token_request, swa_bt, swa_group.block_size)

        ratios: dict[int, RatioMetadata] = {}
        for name in self.groups:
            if not name.startswith("c"):
                continue
            r = int(name[1:])
            comp, state = self.groups[name], self.groups[f"state{r}"]
            comp_bt, state_bt = comp.table_tensor(ids), state.table_tensor(ids)
            closes = (positions + 1) % r == 0
            entry = torch.where(closes, positions // r, torch.full_like(positions, -1))
            hca_indices = hca_lens = None
            if LayerKind.from_ratio(r) == LayerKind.HCA:
                visible = (positions + 1) // r
                width = max(INDEX_ALIGNMENT, round_up(int(visible.max()), INDEX_ALIGNMENT))
                cols = torch.arange(width)
                hca_local = torch.where(cols[None, :] < visible[:, None], cols[None, :].expand(len(positions), -1),
                                        torch.full((len(positions), width), -1, dtype=torch.int64))
                hca_indices = slots_from_block_table(hca_local, token_request, comp_bt, comp.block_size)
                hca_lens = (hca_indices >= 0).sum(-1)
            ratios[r] = RatioMetadata(
                ratio=r,
                compressed_slot_mapping=slots_from_block_table(entry, token_request, comp_bt, comp.block_size),
                state_slot_mapping=slots_from_block_table(positions, token_request, state_bt, state.block_size),
                compressed=GroupTable(comp_bt, comp.block_size),
                state=GroupTable(state_bt, state.block_size),
                hca_indices=hca_indices,
                hca_lens=hca_lens,
            )

        dev = self.device

        def to_dev(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
            return None if t is None else t.to(device=dev, dtype=dtype)

        ratios = {
            r: RatioMetadata(
                ratio=r,
                compressed_slot_mapping=to_dev(m.compressed_slot_mapping, torch.int64),
                state_slot_mapping=to_dev(m.state_slot_mapping, torch.int64),
                compressed=GroupTable(to_dev(m.compressed.block_table, torch.int32), m.compressed.block_size),
                state=GroupTable(to_dev(m.state.block_table, torch.int32), m.state.block_size),
                hca_indices=to_dev(m.hca_indices, torch.int32),
                hca_lens=to_dev(m.hca_lens, torch.int32),
            )
            for r, m in ratios.items()
        }
        return StepMetadata(
            request_ids=tuple(ids),
            positions=to_dev(positions, torch.int64),
            token_request=to_dev(token_request, torch.int32),
            query_start_loc=to_dev(query_start_loc, torch.int32),
            seq_lens=to_dev(seq_lens, torch.int32),
            query_lens=tuple(lens),
            max_seq_len=max(s + n for s, n in zip(starts, lens)),
            swa=GroupTable(to_dev(swa_bt, torch.int32), swa_group.block_size),
            swa_slot_mapping=to_dev(swa_slot_mapping, torch.int64),
            swa_indices=to_dev(swa_indices, torch.int32),
            swa_lens=to_dev(swa_lens, torch.int32),
            ratios=ratios,
            context_lens=tuple(starts),
        )

    def check_profile(self, profile: str) -> None:
        """Refuse a reader whose numerics profile differs from the writer's (SPEC §6.6, §12)."""
        if get_profile(profile).name != self.profile:
            raise CacheLayoutError.of("profile", f"{self.profile!r} (the profile that wrote this cache)",
                                      repr(profile))
