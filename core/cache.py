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
:class:`~dsv4.metadata.StepMetadata`. A rejected plan changes nothing. Only the latest step of a
request may write, and every layer must run a step before its requests are planned again
(``PagedKVCache``'s docstring). Page pools and block tables: ``dsv4.paging``.
"""
from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

import torch
from dsv4.cache_args import MAX_SLOTS, StepRequest, check_requests, hashable, int_arg, resolve_device
from dsv4.cache_metadata import build_step_metadata, check_pad_to
from dsv4.metadata import StepMetadata, mark_planned
from dsv4.paging import SPEC_GROUPS, BlockPool, pages_per_group
from dsv4.specs.config import ModelConfig
from dsv4.specs.errors import CacheLayoutError, DSV4TypeError, DSV4ValueError
from dsv4.specs.layer_kinds import LayerKind
from dsv4.specs.numerics import get_profile

__all__ = ["LayerCache", "OutOfBlocksError", "PagedKVCache", "StaleStepError", "Step", "StepRequest"]


class OutOfBlocksError(DSV4ValueError):
    """A step needs more pages than a group has free; nothing was allocated."""


class StaleStepError(DSV4ValueError):
    """A :class:`Step` is no longer the latest plan of one of its requests (re-planned or freed since):
    its slots may belong to another request now, so it must not write (SPEC §12)."""


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


@dataclass(frozen=True, eq=False)
class Step:
    """A planned step: the metadata, the cache it refers to and its serial number in that cache
    (``PagedKVCache.check_step`` compares it with the latest plan of each request)."""

    metadata: StepMetadata
    cache: PagedKVCache
    serial: int


def _stale(step: Step, request_id: Hashable, happened: str) -> StaleStepError:
    """The error of a stale ``step``: its request ``request_id`` was ``happened`` (freed, re-planned) since."""
    return StaleStepError.of(
        "step", f"the latest plan of each of its requests (step #{step.serial} is not)",
        f"a stale step: request {request_id!r} was {happened}",
        hint="its slots may belong to another request now; plan a new step (a request of it that some "
             "layer has not run must be freed and prefilled again)")


class PagedKVCache:
    """Paged caches for ``layer_ids`` of a model (SPEC §9), with block allocation per request.

    Args:
        cfg: the model configuration.
        layer_ids: layers this cache serves (their kinds decide which groups exist).
        num_blocks: pages per group; an int for every group or a dict ``{group: pages}`` with a
            key for each group these layers use (``swa``, ``c4``, ``c128``, ``state4``, ``state128``;
            keys of groups they do not use are ignored, other keys refused).
        device: where the storage and the step metadata live.
        profile: numerics profile name (SPEC §6.6); the cache is tagged with it and a layer of
            another profile refuses it.
        kv_format: latent cache format (default: the geometry's own, else the profile's ``kv_format``).
        indexer_key_format: indexer key format (default: the geometry's own, else the profile's).
        geometry: page geometry of ``dsv4.specs.geometry`` (``vllm``, ``ascend``, ``ascend-a5``).
            ``ascend`` brings ``ascend_bf16`` / ``indexer_ascend_int8``, ``ascend-a5`` brings
            ``ascend_a5`` / ``indexer_fp8``; ``vllm`` has none. ``self.kv_format`` and
            ``self.indexer_key_format`` are the resolved formats, the ones allocated.

    Step lifecycle (SPEC §10, §12):

    - ``plan_step`` commits a step (pages, sequence lengths) or raises having changed nothing.
    - Only the LATEST plan of a request may write: every ``plan_step`` that includes a request makes its
      earlier steps stale, and so does ``free`` once another step is planned (its pages may be handed
      out); ``Attention`` refuses a stale step (:class:`StaleStepError`) before writing. Until the next
      plan, a step with freed requests still runs for the others (an engine aborting one request re-runs
      the step); the freed requests' rows then land in free pages, which a later plan hands out as
      unwritten. Running the latest step again is allowed (every layer runs it; a re-run writes the
      same bytes).
    - Every layer of this cache must run a step before its requests are planned again (each successful
      forward calls ``mark_written``; ``plan_step`` names the layers still to run): a model that failed
      after some layers, or a step dropped unrun, would leave pages holding a freed request's rows for
      the next step to attend to. Callers that write rows themselves call ``mark_written(step)``.
    - A forward that raises (a rejected input, a backend that cannot run) may leave the step partly
      written in that layer: the layer reports it (``mark_unwritten``), which marks every layer of this
      cache again for the step's requests. Run the same step again in every layer with a corrected input
      (each success clears its layer) or ``free()`` the request and prefill it again. A request that made
      the input bad (a NaN row) can be freed after the re-run: its rows may be anything finite, e.g.
      zeros, in that re-run.
    - Speculative decoding: once every layer ran a verify step, ``rollback(request, n)`` discards its ``n``
      rejected draft tokens (at most the step's tokens); the next step starts after the accepted ones.
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
        self.device = resolve_device(device)
        self.profile = get_profile(profile).name
        self.layer_ids = tuple(sorted({int_arg("layer_ids[]", i, "int layer ids") for i in layer_ids}))
        if not self.layer_ids:
            raise DSV4ValueError.of("layer_ids", "at least one layer id", "an empty list")
        kinds = {i: cfg.layer_kind(i) for i in self.layer_ids}
        self.window = cfg.sliding_window

        # None stays None: cache_geometry resolves explicit > geometry's own > profile's formats,
        # and the codecs below allocate exactly what it resolved.
        geo = cache_geometry(cfg, profile, geometry, kv_format=kv_format, indexer_key_format=indexer_key_format)
        self.kv_format, self.indexer_key_format = geo.kv_format, geo.indexer_key_format
        wanted = {"swa"}
        for kind in set(kinds.values()):
            if kind.has_compressor:
                wanted |= {f"c{kind.ratio}", f"state{kind.ratio}"}
        sizes = pages_per_group(num_blocks, sorted(wanted))

        self.groups: dict[str, BlockPool] = {}
        for name in sorted(wanted):
            g = geo.group(SPEC_GROUPS[name])
            if sizes[name] * g.entries_per_page > MAX_SLOTS:  # SPEC §10: global slots are int32 in index rows
                raise DSV4ValueError.of(f"num_blocks[{name!r}]",
                                        f"at most {MAX_SLOTS // g.entries_per_page} ({g.entries_per_page} entries a "
                                        "page; int32 global slots, SPEC §10)", sizes[name])
            self.groups[name] = BlockPool(name, g.entries_per_page, sizes[name], g.window)
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
        self._step_starts: dict[Hashable, int] = {}  # request -> its length before its latest step (rollback)
        self._serial = 0  # bumped by every plan_step and free
        self._epochs: dict[Hashable, int] = {}  # request -> serial of the latest step that includes it
        self._pending: dict[int, set[int]] = {}  # step serial -> layers still to run it (O(1) per forward)
        # step serial -> (first request freed, serial then, every request freed while it was their latest step)
        self._freed: dict[int, tuple[Hashable, int, set[Hashable]]] = {}
        self._planned = 0  # serial of the latest plan_step

    # -- lifecycle -------------------------------------------------------------------------------

    def layer(self, layer_id: int) -> LayerCache:
        if layer_id not in self.layers:
            raise DSV4ValueError.of("layer_id", f"one of {self.layer_ids}", layer_id)
        return self.layers[layer_id]

    def free(self, request_id: Hashable) -> None:
        """Release every page of ``request_id`` in every group; its planned steps become stale."""
        self._known(request_id)
        for group in self.groups.values():
            group.release(request_id)
        del self.seq_lens[request_id]
        del self._step_starts[request_id]
        self._serial += 1
        latest = self._epochs.pop(request_id)
        self._freed.setdefault(latest, (request_id, self._serial, set()))[2].add(request_id)  # runs until a plan

    def rollback(self, request_id: Hashable, num_tokens: int) -> int:
        """Discard the last ``num_tokens`` tokens of ``request_id``: the draft tokens a speculative step
        (MTP) verified and rejected. -> the request's new length; its next step starts there.

        At most the tokens its latest step appended (earlier ones may have slid out of a window), after
        every layer ran that step (``mark_written`` after a graph replay). Nothing is erased: the rejected
        rows stay in their pages, where no read reaches them (a token reads its window, the compressed
        entries closed at or before it, and the indexer's picks among those), and the next step writes
        those positions again before any token reads them (a compressed entry is written again by the
        token that closes it, before that token attends). The pages stay with the request, for its next
        tokens. The latest step stays the latest (running it again writes the same rows again).
        """
        self._known(request_id)
        num_tokens = int_arg("num_tokens", num_tokens, "an int >= 0")
        serial, length, start = self._epochs[request_id], self.seq_lens[request_id], self._step_starts[request_id]
        if not 0 <= num_tokens <= length - start:
            raise DSV4ValueError.of(
                "num_tokens", f"0 .. {length - start} (the tokens step #{serial} appended to request "
                f"{request_id!r} and not rolled back)", num_tokens,
                hint="only the latest step's tokens can be discarded")
        self._check_written("request_id", request_id)
        self.seq_lens[request_id] = length - num_tokens
        return self.seq_lens[request_id]

    def _known(self, request_id: Hashable) -> None:
        if not hashable(request_id) or request_id not in self.seq_lens:
            raise DSV4ValueError.of("request_id", "a request known to this cache", repr(request_id))

    def _check_written(self, argument: str, request_id: Hashable) -> None:
        """Raise naming ``argument`` unless every layer ran ``request_id``'s latest step (``plan_step``,
        ``rollback``), saying whether that step can still run."""
        serial = self._epochs.get(request_id)
        pending = self._pending.get(serial)
        if pending and not self._runnable_after_frees(serial):
            raise DSV4ValueError.of(
                argument, "a request whose latest step every layer wrote",
                f"layers {sorted(pending)} still to run step #{serial}, which can no longer run (request "
                f"{self._freed[serial][0]!r} of it was freed and step #{self._planned} planned since)",
                hint="free() this request and prefill it again (its rows of that step are missing in those layers)")
        if pending:
            raise DSV4ValueError.of(
                argument, "a request whose latest step every layer wrote",
                f"layers {sorted(pending)} still to run step #{serial} (never run, or a forward of it raised)",
                hint="run that step in those layers (again, with a corrected input, where one raised: rows of a "
                     "request you free may be zeros; it still runs after its other requests were freed, until "
                     "the next plan), or free() the request and prefill it again; after writing the rows "
                     "yourself or replaying a CUDA graph of the layers: cache.mark_written(step)")

    def free_pages(self) -> dict[str, int]:
        return {name: len(g.free_pages) for name, g in self.groups.items()}

    # -- step validity ---------------------------------------------------------------------------

    def check_step(self, step: Step) -> None:
        """Raise :class:`StaleStepError` unless ``step`` is still the latest plan of each of its requests,
        or of each request not freed since, with no plan since the first free (the freed pages are then
        still free, and the step can run for its other requests: an engine that aborts a request of an
        unfinished step re-runs the step for the rest). A request re-planned by a later step and then freed
        leaves the step stale: its rows of the step may have slid out of its window since, and their pages
        been handed out.

        O(1) when nothing was planned or freed since ``step``; while ``step`` is the latest plan (only frees
        since) up to its first request not freed; O(requests), one walk, otherwise. Never consumes the step:
        every layer runs it, and running it again is allowed."""
        if step.serial == self._serial:
            return
        # no plan since step: none of its requests was re-planned, and any free came after the latest plan
        only_frees = step.serial == self._planned
        freed = None  # its first request freed since
        replanned = None  # its first request re-planned by a later step, then freed
        live = False  # a request of it not freed nor re-planned
        freed_here = () if only_frees else self._freed.get(step.serial, (None, 0, ()))[2]
        for request_id in step.metadata.request_ids:
            epoch = self._epochs.get(request_id)
            if epoch == step.serial:
                if only_frees:
                    return  # a request left to run, and the freed pages still free
                live = True
            elif epoch is not None:
                raise _stale(step, request_id, f"re-planned by step #{epoch}")
            else:
                if replanned is None and not only_frees and request_id not in freed_here:
                    replanned = request_id  # re-planned, then freed from that later step
                if freed is None:
                    freed = request_id
        if freed is None:
            return
        if live and replanned is not None:  # its rows of this step may have slid out, and the pages been handed out
            raise _stale(step, replanned, "re-planned by a later step, then freed")
        runnable = self._runnable_after_frees(step.serial)
        if live and runnable:
            return  # only frees since, none before the latest plan, and requests left to run
        raise _stale(step, freed, "freed" if runnable else f"freed, and step #{self._planned} planned since")

    def _runnable_after_frees(self, serial: int) -> bool:
        """Step ``serial``'s freed requests (if any) were all freed after the latest plan: their pages are
        still free, so the step may still run for its other requests."""
        record = self._freed.get(serial)
        return record is None or record[1] > self._planned

    def mark_unwritten(self, step: Step, layer_id: int) -> None:
        """A layer's forward of ``step`` raised (its pages may be partly written): every layer of this
        cache must run the step again (``mark_written``) before ``plan_step`` takes its requests."""
        if not isinstance(step, Step) or layer_id not in self.layers or step.cache is not self:
            return  # called on a forward's error path: never raise over the forward's own error
        if any(self._epochs.get(r) == step.serial for r in step.metadata.request_ids):
            self._pending[step.serial] = set(self.layers)

    def mark_written(self, step: Step, layer_id: int | None = None) -> None:
        """A layer's forward of ``step`` succeeded (O(1)); ``layer_id=None``: every layer. A caller that
        wrote the step's rows itself (ops, codecs) or replayed a CUDA graph of the forwards (a replay runs
        no Python) calls ``mark_written(step)``: ``plan_step`` waits for every layer."""
        if not isinstance(step, Step):
            raise DSV4TypeError.of("step", "a dsv4.Step returned by plan_step", type(step).__name__)
        if step.cache is not self:
            raise DSV4ValueError.of("step", "a step planned by this cache", "a step of another PagedKVCache")
        if layer_id is not None:
            if layer_id not in self.layers:
                raise DSV4ValueError.of("layer_id", f"None (every layer) or one of {self.layer_ids}", layer_id)
            self._layer_ran(step.serial, layer_id)
            return
        layers = self._pending.get(step.serial)
        if layers is not None:
            self.check_step(step)  # a step that can no longer run cannot have been written
            del self._pending[step.serial]

    def _layer_ran(self, serial: int, layer_id: int) -> None:
        """``mark_written`` of step ``serial`` by layer ``layer_id`` without the argument checks: for
        ``Attention.forward``, which checked both before running (``check_step``, ``check_cache_matches``)."""
        layers = self._pending.get(serial)
        if layers is not None:
            layers.discard(layer_id)
            if not layers:
                del self._pending[serial]

    # -- planning --------------------------------------------------------------------------------

    def _first_needed(self, name: str, start: int) -> int:
        """Oldest logical entry a step starting at ``start`` can still read in group ``name``."""
        if name == "swa":
            return start - self.window + 1
        if name.startswith("state"):
            ratio = int(name[len("state"):])
            return start - LayerKind.from_ratio(ratio).coff * ratio + 1
        return 0

    def plan_step(self, requests: Sequence[StepRequest], *, pad_to: int | None = None) -> Step:
        """Allocate pages for a step and derive its metadata (SPEC §10).

        requests: a list or tuple of :class:`StepRequest`, the batch rows in order; each appends
        ``num_tokens`` >= 1 tokens to its request (a new request id starts at position 0).
        pad_to: None, or a length >= every request's after the step: every table of the metadata is then
        as wide as sequences of ``pad_to`` tokens need, so steps with the same rows (a decode loop) have
        the same shapes and one CUDA graph serves them all (``copy_metadata_``). Wider tables cost
        host-to-device bytes and, in some kernels, loop trips over -1 entries (docs/ARCHITECTURE.md §5).

        All or nothing: raises before changing anything when a request is malformed, a request's
        previous step was not written by every layer (see the class docstring), a group runs out
        of pages (:class:`OutOfBlocksError`; pages that slide out of the window of any request of the
        step count as free), or a table would be wider than ``pad_to`` allows (pages a rollback kept:
        the refusal names the least length that fits). On success, pages that slid out are freed for every request first, then
        new pages are allocated, and the step's earlier plans for these requests become stale.
        """
        check_requests(requests)
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids):
            raise DSV4ValueError.of("requests", "each request id at most once per step", ids)
        starts = [self.seq_lens.get(r, 0) for r in ids]
        ends = [s + r.num_tokens for s, r in zip(starts, requests)]
        limit = self.cfg.max_position_embeddings
        for r, e in zip(requests, ends):
            if e > limit:
                raise DSV4ValueError.of(f"requests[{r.request_id!r}]", f"a sequence of <= {limit} tokens", e)
        if pad_to is not None:
            pad_to = int_arg("pad_to", pad_to, "None or an int")
            if not max(ends) <= pad_to <= limit:
                raise DSV4ValueError.of("pad_to", f"a length in {max(ends)} .. {limit} (the step's longest request "
                                        "after it .. max_position_embeddings)", pad_to)
        for r in ids:
            self._check_written(f"requests[{r!r}]", r)

        plans = {}
        for name, group in self.groups.items():
            plans[name] = [group.plan(r, self._first_needed(name, s), group.entries(e))
                           for r, s, e in zip(ids, starts, ends)]
            freed = sum(f for _, f, _ in plans[name])
            needed = sum(n for _, _, n in plans[name])
            if needed > len(group.free_pages) + freed:
                raise OutOfBlocksError.of(
                    f"cache group {name!r}",
                    f"a step needing at most {len(group.free_pages) + freed} new pages (free, or sliding out)",
                    f"a step needing {needed}", hint="plan fewer tokens (a smaller chunk) or free requests")
        if pad_to is not None:  # every table fits pad_to once the step's pages are appended
            check_pad_to(self.groups, {name: {r: group.logical_pages(r) + needed for r, (_, _, needed)
                                              in zip(ids, plans[name])} for name, group in self.groups.items()}, pad_to)
        # Commit: free what slid out for every request, then allocate. Building the metadata allocates
        # (device tables); if that raises (out of memory), every change is undone in reverse order.
        released = {name: [group.release_front(r, stop) for r, (stop, _, _) in zip(ids, plans[name])]
                    for name, group in self.groups.items()}
        for name, group in self.groups.items():
            for r, (_, _, needed) in zip(ids, plans[name]):
                group.append(r, needed)
        before = (self._serial, *({r: store.get(r) for r in ids} for store in self._per_request()))
        self._serial += 1
        for r, s, e in zip(ids, starts, ends):
            self.seq_lens[r] = e
            self._epochs[r] = self._serial
            self._step_starts[r] = s
        try:
            metadata = self._metadata(ids, starts, [r.num_tokens for r in requests], pad_to)
        except BaseException:
            self._undo_plan(ids, plans, released, before)
            raise
        if len(self._pending) > 64 or len(self._freed) > 64:  # steps none of whose requests is left (or whose
            live = set(self._epochs.values())  # requests were all re-planned since): nothing can run them
            self._pending = {serial: layers for serial, layers in self._pending.items() if serial in live}
            self._freed = {serial: record for serial, record in self._freed.items() if serial in live}
        mark_planned(metadata, self._serial)  # read-only from here (dsv4.metadata.copy_metadata_ refills)
        self._pending[self._serial] = set(self.layers)  # until every layer has run it (mark_written)
        self._planned = self._serial
        return Step(metadata, self, self._serial)

    def _undo_plan(self, ids: list, plans: dict, released: dict, before: tuple) -> None:
        """Reverse a committed plan exactly (pages, tables, lengths, plan numbers): ``plan_step`` is
        all or nothing even when its metadata cannot be built."""
        for name in reversed(list(self.groups)):
            group = self.groups[name]
            for r, (_, _, needed) in reversed(list(zip(ids, plans[name]))):
                group.undo_append(r, needed)
        for name in reversed(list(self.groups)):
            group = self.groups[name]
            for r, first_live in reversed(list(zip(ids, released[name]))):
                group.undo_release(r, first_live)
        self._serial, *values = before
        for store, old in zip(self._per_request(), values):
            for r in ids:
                if old[r] is None:
                    store.pop(r, None)
                else:
                    store[r] = old[r]

    def _per_request(self) -> tuple[dict, ...]:
        """The per-request records a plan sets (and ``_undo_plan`` restores)."""
        return self.seq_lens, self._epochs, self._step_starts

    def _metadata(self, ids: list, starts: list[int], lens: list[int], pad_to: int | None) -> StepMetadata:
        """The step's metadata from the pools' tables (``dsv4.cache_metadata``; a seam for tests)."""
        return build_step_metadata(self.groups, self.window, self.cfg.index_topk, ids, starts, lens, self.device,
                                   pad_to)

    def check_profile(self, profile: str) -> None:
        """Refuse a reader whose numerics profile differs from the writer's (SPEC §6.6, §12)."""
        if get_profile(profile).name != self.profile:
            raise CacheLayoutError.of("profile", f"{self.profile!r} (the profile that wrote this cache)",
                                      repr(profile))
