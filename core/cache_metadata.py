"""The :class:`~dsv4.metadata.StepMetadata` of a planned step, built from the cache groups' block tables
(SPEC §10). ``PagedKVCache.plan_step`` calls it after committing the step's pages; it only reads them.
"""
from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

import torch
from dsv4.metadata import (
    GroupTable,
    RatioMetadata,
    StepMetadata,
    dense_compressed_indices,
    slots_from_block_table,
)
from dsv4.paging import BlockPool
from dsv4.specs.errors import DSV4ValueError
from dsv4.specs.layer_kinds import LayerKind

__all__ = ["build_step_metadata", "check_pad_to"]


def build_step_metadata(groups: Mapping[str, BlockPool], window: int, index_topk: int, ids: Sequence[Hashable],
                        starts: Sequence[int], lens: Sequence[int], device: torch.device,
                        pad_to: int | None = None) -> StepMetadata:
    """The metadata of a step whose requests ``ids`` (batch order) append ``lens[i]`` tokens after
    ``starts[i]``, on ``device``, from ``groups`` (``PagedKVCache.groups``: ``swa``, ``c{r}``, ``state{r}``)
    whose tables already hold the step's pages. ``window``: the SWA width; ``index_topk``: the CSA indexer's k.
    ``pad_to``: every table as wide as sequences of ``pad_to`` tokens need (block tables, HCA index rows), so
    that steps of the same rows have the same shapes (a CUDA graph's inputs); the caller has checked that
    every table fits (``check_pad_to``, before the step's pages were committed).

    Per-token vectors are derived on the host (O(T)), then every table is built on ``device`` from them and
    the block tables (no host table of context width is made or copied)."""
    dev = device
    qlens = torch.tensor(lens, dtype=torch.int64)
    token_request = torch.repeat_interleave(torch.arange(len(ids), dtype=torch.int64), qlens)
    first = torch.tensor(starts, dtype=torch.int64)
    offsets = torch.arange(int(qlens.sum())) - torch.repeat_interleave(torch.cumsum(qlens, 0) - qlens, qlens)
    query_start_loc = torch.zeros(len(ids) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(qlens, 0).to(torch.int32)
    seq_lens = (first + qlens).to(torch.int32)
    max_seq_len = max(s + n for s, n in zip(starts, lens))
    positions = (first[token_request] + offsets).to(dev)
    token_request = token_request.to(dev)

    swa_group = groups["swa"]
    swa_bt = _table(swa_group, ids, dev, pad_to)
    W = window
    swa_slot_mapping = slots_from_block_table(positions, token_request, swa_bt, swa_group.block_size)
    window_start = (positions - W + 1).clamp(min=0)
    swa_lens = positions - window_start + 1
    k = torch.arange(W, device=dev)
    local = window_start[:, None] + k[None, :]
    local = torch.where(k[None, :] < swa_lens[:, None], local, torch.full_like(local, -1))
    swa_indices = slots_from_block_table(local, token_request, swa_bt, swa_group.block_size)

    ratios: dict[int, RatioMetadata] = {}
    for name in groups:
        if not name.startswith("c"):
            continue
        r = int(name[1:])
        comp, state = groups[name], groups[f"state{r}"]
        comp_bt = _table(comp, ids, dev, pad_to)
        state_bt = _table(state, ids, dev, pad_to)
        closes = (positions + 1) % r == 0
        entry = torch.where(closes, positions // r, torch.full_like(positions, -1))
        hca_indices = hca_lens = topk_lens = None
        if LayerKind.from_ratio(r) == LayerKind.HCA:  # per-request rows gathered per token (SPEC §10)
            hca_indices, hca_lens = dense_compressed_indices(positions, token_request, comp_bt, comp.block_size,
                                                             r, (pad_to or max_seq_len) // r)
        else:  # CSA: the indexer's picks that can be valid, one tensor for every CSA layer of the step
            topk_lens = ((positions + 1) // r).clamp(max=index_topk).to(torch.int32)
        ratios[r] = RatioMetadata(
            ratio=r,
            compressed_slot_mapping=slots_from_block_table(entry, token_request, comp_bt, comp.block_size),
            state_slot_mapping=slots_from_block_table(positions, token_request, state_bt, state.block_size),
            compressed=GroupTable(comp_bt, comp.block_size),
            state=GroupTable(state_bt, state.block_size),
            hca_indices=hca_indices,
            hca_lens=hca_lens,
            topk_lens=topk_lens,
        )

    return StepMetadata(
        request_ids=tuple(ids),
        positions=positions,
        token_request=token_request.to(torch.int32),
        query_start_loc=query_start_loc.to(dev),
        seq_lens=seq_lens.to(dev),
        query_lens=tuple(lens),
        max_seq_len=max_seq_len,
        swa=GroupTable(swa_bt, swa_group.block_size),
        swa_slot_mapping=swa_slot_mapping,
        swa_indices=swa_indices.to(torch.int32),
        swa_lens=swa_lens.to(torch.int32),
        ratios=ratios,
        context_lens=tuple(starts),
    )


def check_pad_to(groups: Mapping[str, BlockPool], held: Mapping[str, Mapping[Hashable, int]], pad_to: int) -> None:
    """Refuses (naming ``pad_to``) a padding that some group's table would be wider than (pages a rollback
    kept): ``held[name][request]``, the logical pages each request of the step will hold in group ``name``.
    Names the least length that every group's table fits: one group's least is not enough where a group of
    smaller pages holds more (swa 513 < c4 516 < state4 517)."""
    worst = None
    for name, group in groups.items():
        most, request = max(((pages, r) for r, pages in held[name].items()), key=lambda pair: pair[0])
        if most > _width(group, pad_to):
            least = ((most - 1) * group.block_size + 1) * group.tokens_an_entry  # the least length needing them
            if worst is None or least > worst[0]:
                worst = (least, request, most, group)
    if worst is not None:
        least, request, most, group = worst
        raise DSV4ValueError.of("pad_to", f"a length >= {least} (request {request!r} holds {most} {group.name!r} "
                                f"pages of {group.block_size} entries)", pad_to,
                                hint="a rollback leaves its pages with the request: pad to the longest length plus "
                                     "the drafts")


def _width(group: BlockPool, pad_to: int) -> int:
    """Pages of ``group`` that sequences of ``pad_to`` tokens need."""
    return max(1, -(-group.entries(pad_to) // group.block_size))


def _table(group: BlockPool, ids: Sequence[Hashable], device: torch.device, pad_to: int | None) -> torch.Tensor:
    """``group``'s block table of the step: as wide as its longest row, or (``pad_to``, checked by
    ``check_pad_to``) as wide as sequences of ``pad_to`` tokens need."""
    if pad_to is None:
        return group.table_tensor(ids, device)
    return group.table_tensor(ids, device, min_width=_width(group, pad_to))
