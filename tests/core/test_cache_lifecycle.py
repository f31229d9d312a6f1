"""Step planning as a transaction (SPEC §10, §12): all-or-nothing plans, page accounting under a random
schedule, stale steps, argument errors, and tables built from live pages only."""
import random

import numpy as np
import pytest
import torch
from _cache_helpers import PlannedOnly
from dsv4.cache import OutOfBlocksError, PagedKVCache, StaleStepError, StepRequest
from dsv4.metadata import dense_compressed_indices, slots_from_block_table
from dsv4.specs.config import ModelConfig
from dsv4.specs.errors import DSV4Error, DSV4TypeError, DSV4ValueError

CFG = ModelConfig.preset("tiny")  # layers: 0 SWA, 1 CSA, 2 HCA


def _state(cache: PagedKVCache) -> tuple:
    return ({n: g.tables for n, g in cache.groups.items()}, {n: list(g.free_pages) for n, g in cache.groups.items()},
            dict(cache.seq_lens))


def _check_accounting(cache: PagedKVCache) -> dict:
    """Every page is free or owned by exactly one request: returns {(group, page): request}."""
    owner = {}
    for name, group in cache.groups.items():
        for request, table in group.tables.items():
            for page in table:
                if page >= 0:
                    assert (name, page) not in owner, f"page {name}:{page} owned twice"
                    owner[(name, page)] = request
        owned = sum(1 for g, _ in owner if g == name)
        assert owned == group.owned_pages()
        assert owned + len(group.free_pages) == group.num_blocks, name
        assert len(set(group.free_pages)) == len(group.free_pages), name
        assert not set(group.free_pages) & {p for g, p in owner if g == name}, name
    return owner


def test_pages_that_a_later_request_frees_can_serve_an_earlier_one():
    """B's decode frees two SWA pages that A (earlier in the batch) needs: commit frees first, then allocates."""
    cache = PlannedOnly(CFG, [0, 2], num_blocks={"swa": 4, "c128": 64, "state128": 64})
    cache.plan_step([StepRequest("B", 256)])
    assert cache.free_pages()["swa"] == 0
    step = cache.plan_step([StepRequest("A", 1), StepRequest("B", 1)])
    assert cache.seq_lens == {"A": 1, "B": 257}
    owner = _check_accounting(cache)
    assert owner[("swa", step.metadata.swa_slot_mapping[0].item() // 64)] == "A"
    cache.free("A")
    cache.free("B")
    assert cache.free_pages() == {"c128": 64, "state128": 64, "swa": 4}


def test_out_of_pages_plan_changes_nothing_even_when_other_requests_free_pages():
    cache = PlannedOnly(CFG, [0, 2], num_blocks={"swa": 4, "c128": 64, "state128": 64})
    cache.plan_step([StepRequest("B", 256)])
    before = _state(cache)
    with pytest.raises(OutOfBlocksError, match="swa"):  # B frees 2 pages, A needs 3
        cache.plan_step([StepRequest("A", 130), StepRequest("B", 1)])
    assert _state(cache) == before


@pytest.mark.parametrize("seed", [0, 1])
def test_random_schedule_keeps_page_accounting_and_slot_ownership(seed):
    rng = random.Random(seed)
    cache = PlannedOnly(CFG, [0, 1, 2], num_blocks={"swa": 40, "c4": 30, "c128": 30, "state4": 60, "state128": 200})
    live: dict = {}
    planned = 0
    for it in range(150):
        requests = [StepRequest(r, rng.choice([1, 1, 2, 3, 5, 64, 127, 129])) for r in live if rng.random() < 0.6]
        if rng.random() < 0.5:
            requests.append(StepRequest(f"n{it}", rng.choice([1, 3, 4, 127, 128, 200, 300])))
        rng.shuffle(requests)
        if not requests:
            continue
        before = _state(cache)
        try:
            step = cache.plan_step(requests)
        except OutOfBlocksError:
            assert _state(cache) == before
            if live:  # preempt one
                victim = rng.choice(sorted(live))
                cache.free(victim)
                del live[victim]
            _check_accounting(cache)
            continue
        planned += 1
        for r in requests:
            live[r.request_id] = live.get(r.request_id, 0) + r.num_tokens
        assert cache.seq_lens == live
        owner = _check_accounting(cache)
        md = step.metadata
        rows, positions = md.token_request.tolist(), md.positions.tolist()
        slots = md.swa_slot_mapping.tolist()
        assert len(set(slots)) == len(slots)
        for t, (row, p) in enumerate(zip(rows, positions)):
            request = md.request_ids[row]
            n = md.swa_lens[t].item()
            assert n == min(p + 1, CFG.sliding_window)
            assert all(owner[("swa", s // 64)] == request for s in md.swa_indices[t, :n].tolist() + [slots[t]])
            for ratio, rm in md.ratios.items():
                state_slot = rm.state_slot_mapping[t].item()
                assert owner[(f"state{ratio}", state_slot // rm.state.block_size)] == request
                entry_slot = rm.compressed_slot_mapping[t].item()
                assert (entry_slot >= 0) == ((p + 1) % ratio == 0)
                if entry_slot >= 0:
                    assert owner[(f"c{ratio}", entry_slot // rm.compressed.block_size)] == request
                if rm.hca_indices is not None:
                    visible = (p + 1) // ratio
                    assert rm.hca_lens[t].item() == visible
                    got = rm.hca_indices[t].tolist()
                    assert all(owner[("c128", s // 2)] == request for s in got[:visible])
                    assert set(got[visible:]) <= {-1}
    assert planned > 50


def test_step_tables_equal_the_request_tables():
    """Tables are scattered from live pages only; the result is the full [R, pages] table, -1 where freed."""
    cache = PlannedOnly(CFG, [0, 1, 2], num_blocks=600)
    cache.plan_step([StepRequest("a", 1000), StepRequest("b", 3)])
    step = cache.plan_step([StepRequest("b", 1), StepRequest("a", 1), StepRequest("c", 7)]).metadata
    tables = {"swa": step.swa, "c4": step.ratios[4].compressed, "state4": step.ratios[4].state,
              "c128": step.ratios[128].compressed, "state128": step.ratios[128].state}
    for name, table in tables.items():
        rows = [cache.groups[name].tables.get(r, []) for r in ("b", "a", "c")]
        width = max(1, *map(len, rows))
        want = torch.tensor([row + [-1] * (width - len(row)) for row in rows], dtype=torch.int32)
        assert torch.equal(table.block_table, want), name
    assert cache.groups["state4"].tables["a"][:240] == [-1] * 240  # slid out (freed), decode at 1000


def test_dense_compressed_indices_match_the_formula():
    bt = torch.tensor([[5, 2, -1], [7, 1, 3]], dtype=torch.int32)
    positions = torch.tensor([0, 127, 255, 639, 383])
    token_request = torch.tensor([0, 0, 0, 1, 1])
    got, lens = dense_compressed_indices(positions, token_request, bt, 2, 128, max_visible=5)
    assert got.dtype == torch.int32 and got.shape == (5, 128)
    assert lens.tolist() == [0, 1, 2, 5, 3]
    for t in range(5):
        local = torch.arange(128)
        local = torch.where(local < lens[t], local, -1)
        want = slots_from_block_table(local, token_request[t].expand(128), bt, 2)
        assert torch.equal(got[t].long(), want), t


def test_free_and_replan_make_earlier_steps_stale_but_not_the_latest():
    cache = PlannedOnly(CFG, [0], num_blocks=8)
    old = cache.plan_step([StepRequest("victim", 10)])
    cache.free("victim")
    with pytest.raises(StaleStepError, match="'victim' was freed"):
        cache.check_step(old)
    first = cache.plan_step([StepRequest("a", 5)])
    other = cache.plan_step([StepRequest("b", 5)])
    cache.check_step(first)  # b's plan does not touch a's latest step
    cache.check_step(other)
    cache.check_step(other)  # checking never consumes a step
    cache.plan_step([StepRequest("a", 1)])
    with pytest.raises(StaleStepError, match="'a' was re-planned"):
        cache.check_step(first)


@pytest.mark.parametrize("call, error, message", [
    (lambda c: c.plan_step([StepRequest("r", True)]), DSV4TypeError, "num_tokens: expected an int >= 1, got bool"),
    (lambda c: c.plan_step([StepRequest("r", 0)]), DSV4ValueError, "num_tokens: expected an int >= 1, got 0"),
    (lambda c: c.plan_step([StepRequest(["r"], 3)]), DSV4TypeError, "request_id: expected a hashable id"),
    (lambda c: c.plan_step([("r", 3)]), DSV4TypeError, r"requests\[0\]: expected a dsv4.StepRequest"),
    (lambda c: c.plan_step(StepRequest(f"r{i}", 1) for i in range(2)), DSV4TypeError,
     "requests: expected a list or tuple of StepRequest, got generator"),
    (lambda c: c.plan_step(None), DSV4TypeError, "requests: expected a list or tuple of StepRequest, got None"),
    (lambda c: c.plan_step([]), DSV4ValueError, "requests: expected at least one StepRequest"),
    (lambda c: c.free(["r"]), DSV4ValueError, "request_id: expected a request known to this cache"),
    (lambda c: PlannedOnly(CFG, [0], num_blocks=True), DSV4ValueError, r"num_blocks\['swa'\]: expected a positive"),
    (lambda c: PlannedOnly(CFG, [0], num_blocks={"swa": 4, "bogus": 3}), DSV4ValueError,
     r"num_blocks: expected keys among .*got \['bogus'\]"),
    (lambda c: PlannedOnly(CFG, [0, 2], num_blocks={"swa": 4}), DSV4ValueError,
     r"num_blocks\['c128'\]: expected a positive int, got missing"),
    (lambda c: PlannedOnly(CFG, [0, 1.5], num_blocks=4), DSV4TypeError,
     r"layer_ids\[\]: expected int layer ids, got float 1.5"),
    (lambda c: PlannedOnly(CFG, ["a"], num_blocks=4), DSV4TypeError, r"layer_ids\[\]: expected int layer ids, got str"),
])
def test_plan_and_cache_arguments_raise_named_errors(call, error, message):
    cache = PlannedOnly(CFG, [0, 1, 2], num_blocks=16)
    before = _state(cache)
    with pytest.raises(error, match=message) as info:
        call(cache)
    assert isinstance(info.value, DSV4Error)
    assert _state(cache) == before


def test_numpy_token_counts_and_unused_group_keys_are_accepted():
    cache = PlannedOnly(CFG, [0], num_blocks={"swa": 4, "c4": 9})  # c4: a group these layers do not use
    step = cache.plan_step([StepRequest("r", np.int64(5))])
    assert step.metadata.query_lens == (5,) and type(step.metadata.query_lens[0]) is int


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_unavailable_device_is_a_named_error():
    with pytest.raises(DSV4ValueError, match="device: expected a device available on this machine, got 'cuda'"):
        PlannedOnly(CFG, [0], num_blocks=4, device="cuda")


@pytest.mark.parametrize("seed", [0, 1])
def test_a_plan_whose_metadata_cannot_be_built_changes_nothing(monkeypatch, seed):
    """plan_step builds its metadata (device tables) after committing pages; if that raises (out of
    memory), the plan is undone exactly: tables, free lists (in order), lengths and plan numbers. Pages
    that slide out of the window in the failed plan come back too, so the next plan sees the old state."""
    import dsv4.cache as cache_module

    rng = random.Random(seed)
    cache = PlannedOnly(CFG, [0, 1, 2], num_blocks=96)
    for _ in range(30):  # a history with slid-out pages, so releases are undone as well
        ids = rng.sample(["a", "b", "c"], rng.randint(1, 3))
        cache.plan_step([StepRequest(r, rng.choice([1, 5, 64, 70])) for r in ids])
    before = (_state(cache), cache._serial, dict(cache._epochs))
    latest = cache.plan_step([StepRequest("a", 1)])
    cache.check_step(latest)
    state, serial = _state(cache), cache._serial

    def boom(*args, **kwargs):
        raise MemoryError("out of device memory building the step tables")

    monkeypatch.setattr(cache_module.PagedKVCache, "_metadata", boom)
    with pytest.raises(MemoryError):
        cache.plan_step([StepRequest("a", 130), StepRequest("b", 1), StepRequest("new", 70)])
    assert (_state(cache), cache._serial) == (state, serial)
    cache.check_step(latest)  # still the latest plan of "a"
    _check_accounting(cache)
    assert before[1] < serial


def test_step_is_hashable_and_compared_by_identity():
    cache = PlannedOnly(CFG, [0], num_blocks=16)
    first = cache.plan_step([StepRequest("r", 3)])
    second = cache.plan_step([StepRequest("s", 3)])
    assert len({first, second, first}) == 2 and first != second and first in [first]


@torch.no_grad()
def test_a_step_some_layer_has_not_run_blocks_the_next_plan_of_its_requests():
    """A model that failed after layer 0 (outside attention) or dropped the step: layers 1 and 2 never
    wrote request a's new pages, which hold a freed request's rows. The next plan of a is refused naming
    them; running the other layers (or mark_written for a caller that wrote the rows itself) releases it."""
    from _layer_helpers import tiny_layer, tiny_x

    cache = PagedKVCache(CFG, [0, 1, 2], num_blocks=64)
    layers = [tiny_layer(layer_id, seed=layer_id) for layer_id in (0, 1, 2)]
    x = tiny_x(64, seed=0)
    first = cache.plan_step([StepRequest("x", 64)])
    for attn in layers:
        attn(x, first)
    cache.free("x")
    reused = cache.plan_step([StepRequest("a", 64)])  # x's pages
    layers[0](x, reused)
    with pytest.raises(DSV4ValueError, match=r"requests\['a'\]: .*got layers \[1, 2\] still to run step"):
        cache.plan_step([StepRequest("a", 1)])
    for attn in layers[1:]:
        attn(x, reused)
    cache.plan_step([StepRequest("a", 1)])
    dropped = cache.plan_step([StepRequest("b", 3)])  # planned, never run
    with pytest.raises(DSV4ValueError, match=r"requests\['b'\]: .*got layers \[0, 1, 2\]"):
        cache.plan_step([StepRequest("b", 1)])
    cache.mark_written(dropped)
    cache.plan_step([StepRequest("b", 1)])


def test_a_step_whose_other_request_was_freed_can_still_run_for_the_rest():
    """An engine aborts request a of an unfinished step: the step still runs for b (a's pages are free,
    nothing planned since), which releases b. After another plan it can no longer run, and
    mark_written on it is refused rather than declaring unwritten rows written."""
    from _layer_helpers import tiny_layer, tiny_x

    cache = PagedKVCache(CFG, [0], num_blocks=64)
    attn = tiny_layer(0)
    step = cache.plan_step([StepRequest("a", 5), StepRequest("b", 5)])
    cache.free("a")
    with pytest.raises(DSV4ValueError, match=r"requests\['b'\]: .*still to run step"):
        cache.plan_step([StepRequest("b", 1)])
    attn(tiny_x(10), step)
    cache.plan_step([StepRequest("b", 1)])
    other = cache.plan_step([StepRequest("c", 5), StepRequest("d", 5)])
    cache.free("c")
    cache.plan_step([StepRequest("e", 3)])
    with pytest.raises(StaleStepError):
        cache.mark_written(other)
    # d is stuck: its step can no longer run, and its plan says so (not "run that step")
    with pytest.raises(DSV4ValueError, match=r"requests\['d'\]: .*step #\d+, which can no longer run \(request 'c' "
                                             r"of it was freed and step #\d+ planned since\); free\(\) this request"):
        cache.plan_step([StepRequest("d", 1)])
    cache.free("d")
    cache.plan_step([StepRequest("d", 6)])


def test_a_request_freed_after_the_latest_plan_leaves_its_step_runnable():
    """Only a plan after the free can hand the freed pages out: a step planned before another step, whose
    request is freed after that other plan, still runs for the rest; a plan after the free makes it stale."""
    cache = PagedKVCache(CFG, [0], num_blocks=16)
    s1 = cache.plan_step([StepRequest("a", 5), StepRequest("b", 5)])
    cache.mark_written(cache.plan_step([StepRequest("c", 5)]))
    cache.free("b")
    cache.check_step(s1)  # b's pages are still free
    cache.mark_written(s1)
    s3 = cache.plan_step([StepRequest("d", 5), StepRequest("e", 5)])
    cache.free("d")
    cache.mark_written(cache.plan_step([StepRequest("f", 5)]))
    with pytest.raises(StaleStepError, match=r"request 'd' was freed, and step #\d+ planned since"):
        cache.check_step(s3)
    alone = cache.plan_step([StepRequest("g", 5)])
    cache.free("g")
    with pytest.raises(StaleStepError, match=r"request 'g' was freed; "):  # no request left: nothing to run
        cache.check_step(alone)


def test_a_request_re_planned_then_freed_leaves_its_older_steps_stale():
    """A free files the request under its latest step only: an older step of it, whose other requests are left,
    stays stale (its rows there may have slid out of the window and its pages been handed out since): the layer
    refuses it before writing another request's page."""
    from _layer_helpers import tiny_layer, tiny_x

    attn = tiny_layer(0)  # SWA only: a request's first page slides out of its window after 128 more tokens
    cache = PagedKVCache(CFG, [0], num_blocks=8)
    s1 = cache.plan_step([StepRequest("a", 200), StepRequest("b", 1)])
    attn(tiny_x(201, seed=1), s1)
    s2 = cache.plan_step([StepRequest("a", 1), StepRequest("c", 60)])  # a's page 0 slides out, c takes it
    attn(tiny_x(61, seed=2), s2)
    assert cache.groups["swa"].tables["c"][0] not in cache.groups["swa"].tables["a"]
    page = cache.groups["swa"].tables["c"][0]
    cache.free("a")
    before = cache.layer(0).swa[page].clone()
    for call in (cache.check_step, lambda step: attn(tiny_x(201, seed=1), step)):
        with pytest.raises(StaleStepError, match=r"request 'a' was re-planned by a later step, then freed"):
            call(s1)
    assert torch.equal(cache.layer(0).swa[page], before)
    cache.check_step(s2)  # freed from s2 itself, after the latest plan: s2 still runs for c


class _CountingEpochs(dict):
    """A cache's request -> latest-plan map that counts ``get`` calls (check_step's walk)."""

    gets = 0

    def get(self, key, default=None):
        type(self).gets += 1
        return super().get(key, default)


def test_check_step_after_a_free_reads_up_to_the_first_request_left(monkeypatch):
    """Between a free and the next plan every layer's forward checks the step: while it is the latest plan, the
    walk stops at its first request not freed (it built and filtered a list of all 64). After a plan of other
    requests it walks them once; a re-planned request is named before a freed one that comes earlier."""
    cache = PlannedOnly(CFG, [0], num_blocks=256)
    step = cache.plan_step([StepRequest(f"r{i}", 2) for i in range(64)])
    cache._epochs = _CountingEpochs(cache._epochs)
    cache.free("r0")
    monkeypatch.setattr(_CountingEpochs, "gets", 0)
    cache.check_step(step)
    assert _CountingEpochs.gets == 2  # r0 (freed), r1 (left to run)
    later = cache.plan_step([StepRequest(f"s{i}", 2) for i in range(64)])
    cache.plan_step([StepRequest("other", 2)])
    cache.free("s63")
    monkeypatch.setattr(_CountingEpochs, "gets", 0)
    cache.check_step(later)  # s63 freed after the latest plan: still runnable, found in one walk
    assert _CountingEpochs.gets == 64
    with pytest.raises(StaleStepError, match=r"request 'r0' was freed, and step #\d+ planned since"):
        cache.check_step(step)  # r0's pages may be another request's now
    assert _CountingEpochs.gets == 64 + 64
    two = cache.plan_step([StepRequest("a", 2), StepRequest("b", 2)])
    cache.free("a")
    cache.plan_step([StepRequest("b", 1)])
    with pytest.raises(StaleStepError, match=r"request 'b' was re-planned by step #\d+"):
        cache.check_step(two)


def _stale_by_rule(cache: PagedKVCache, step) -> str | None:
    """check_step's rule written out (its two-walk form): None when ``step`` may run, else the request the
    error names and what happened to it."""
    epochs = [(r, cache._epochs.get(r)) for r in step.metadata.request_ids]
    stale = [(r, e) for r, e in epochs if e != step.serial]
    record = cache._freed.get(step.serial)
    runnable = record is None or record[1] > cache._planned
    if not stale:
        return None
    replanned = next(((r, e) for r, e in stale if e is not None), None)
    if replanned is not None:
        return f"{replanned[0]!r} was re-planned by step #{replanned[1]}"
    later = [r for r, _ in stale if step.serial not in cache._freed_from_steps[r]]  # freed from later steps only
    if later and len(stale) < len(epochs) and step.serial != cache._planned:
        return f"{later[0]!r} was re-planned by a later step, then freed"
    if len(stale) < len(epochs) and runnable:
        return None
    return f"{stale[0][0]!r} was freed" + ("" if runnable else f", and step #{cache._planned} planned since")


@pytest.mark.parametrize("seed", [0, 1])
def test_check_step_follows_the_rule_under_random_plans_and_frees(seed):
    rng = random.Random(seed)
    cache = PlannedOnly(CFG, [0], num_blocks=512)
    cache._freed_from_steps = {}  # the test's own record: request -> the steps it was freed from
    steps, names = [], [f"q{i}" for i in range(12)]
    for _ in range(200):
        known = sorted(cache.seq_lens)
        if known and rng.random() < 0.35:
            victim = rng.choice(known)
            cache._freed_from_steps.setdefault(victim, set()).add(cache._epochs[victim])  # its latest step then
            cache.free(victim)
        else:
            ids = rng.sample(names, rng.randint(1, 6))
            steps.append(cache.plan_step([StepRequest(r, 1) for r in ids]))
        for step in steps[-6:]:
            expected = _stale_by_rule(cache, step)
            if expected is None:
                cache.check_step(step)
            else:
                with pytest.raises(StaleStepError) as info:
                    cache.check_step(step)
                assert f"request {expected};" in str(info.value), (str(info.value), expected)


def test_mark_written_refuses_what_it_cannot_mark():
    """A step of another cache, a layer the cache lacks or a non-Step would otherwise be a silent no-op (the
    engine then meets a "still to run" refusal later) or a bare AttributeError."""
    cache, other = PagedKVCache(CFG, [0], num_blocks=8), PagedKVCache(CFG, [0], num_blocks=8)
    step, foreign = cache.plan_step([StepRequest("a", 3)]), other.plan_step([StepRequest("a", 3)])
    with pytest.raises(DSV4ValueError, match="^step: expected a step planned by this cache"):
        cache.mark_written(foreign)
    with pytest.raises(DSV4ValueError, match=r"^layer_id: expected None \(every layer\) or one of \(0,\), got 99"):
        cache.mark_written(step, layer_id=99)
    with pytest.raises(DSV4TypeError, match="^step: expected a dsv4.Step returned by plan_step, got StepMetadata"):
        cache.mark_written(step.metadata)
    with pytest.raises(DSV4ValueError, match="still to run"):
        cache.plan_step([StepRequest("a", 1)])  # none of the refused calls marked anything
    cache.mark_written(step, layer_id=0)
    cache.plan_step([StepRequest("a", 1)])


@pytest.mark.parametrize("chunk", [400, 64, 16, 1])
def test_a_cache_sized_by_the_planner_plans_every_chunk(chunk):
    """docs/memory.md §3: a window group holds the pages of the window plus the latest step until the next
    plan; a pool sized by ``pages_for(N, step_tokens=chunk)`` takes the request in chunks of ``chunk`` after a
    first step of any size, and one page less in any window group does not, for some first step (tight)."""
    from dsv4.paging import SPEC_GROUPS
    from dsv4.specs.geometry import cache_geometry

    geo, total = cache_geometry(CFG, "deepseek", "vllm"), 400
    need = {name: geo.group(g).pages_for(total, step_tokens=chunk) for name, g in SPEC_GROUPS.items()}

    def prefill(num_blocks, first):
        cache, done = PlannedOnly(CFG, [0, 1, 2], num_blocks=num_blocks), 0
        while done < total:
            n = min(first if done == 0 else chunk, total - done)
            cache.plan_step([StepRequest("a", n)])
            done += n

    firsts = range(1, min(chunk, 64) + 1)
    for first in firsts[::5]:
        prefill(need, first)
    for name, g in SPEC_GROUPS.items():
        if geo.group(g).window is not None and need[name] > 1:
            def fails(first, name=name):
                try:
                    prefill({**need, name: need[name] - 1}, first)
                except OutOfBlocksError as e:
                    return repr(name) in str(e)
                return False
            assert any(fails(first) for first in firsts), name
