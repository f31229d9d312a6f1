"""Paged caches and step metadata (SPEC §9-§10): allocation, windows, slots, index lists."""
import pytest
import torch
from _cache_helpers import PlannedOnly
from dsv4.cache import OutOfBlocksError, StepRequest
from dsv4.metadata import closing_windows_in_call, slots_from_block_table, topk_local_to_global
from dsv4.specs.config import ModelConfig
from dsv4.specs.errors import ConfigError, DSV4ValueError

CFG = ModelConfig.preset("tiny")  # layers: 0 SWA, 1 CSA, 2 HCA


def _slot(table: list[int], i: int, B: int) -> int:
    return table[i // B] * B + i % B


def test_slots_from_block_table_matches_formula():
    bt = torch.tensor([[5, 2, -1], [7, 1, 3]], dtype=torch.int32)
    idx = torch.tensor([[0, 3, 4, 9, -1], [11, 4, 0, -1, -1]])
    req = torch.tensor([0, 1])
    got = slots_from_block_table(idx, req, bt, 4)
    want = torch.tensor([[20, 23, 8, -1, -1], [15, 4, 28, -1, -1]])  # 9 -> page 2 unallocated -> -1
    assert torch.equal(got, want)


def test_topk_local_to_global_counts_valid():
    bt = torch.tensor([[3, 0]], dtype=torch.int32)
    local = torch.tensor([[1, 0, 65, -1], [-1, -1, -1, -1]], dtype=torch.int32)
    glob, lens = topk_local_to_global(local, torch.tensor([0, 0]), bt, 64)
    assert glob.dtype == torch.int32
    assert glob.tolist() == [[193, 192, 1, -1], [-1, -1, -1, -1]]
    assert lens.tolist() == [3, 0]


def test_mixed_step_metadata_is_what_the_formulas_say():
    cache = PlannedOnly(CFG, [0, 1, 2], num_blocks=300)
    cache.plan_step([StepRequest("a", 300)])
    step = cache.plan_step([StepRequest("a", 1), StepRequest("b", 130)]).metadata
    assert step.positions[:3].tolist() == [300, 0, 1]
    assert step.token_request.tolist() == [0] + [1] * 130
    assert step.query_start_loc.tolist() == [0, 1, 131]
    assert step.seq_lens.tolist() == [301, 130]
    assert step.max_seq_len == 301
    B = cache.groups["swa"].block_size
    ta, tb = cache.groups["swa"].tables["a"], cache.groups["swa"].tables["b"]
    # SWA window of the decode token at 300: positions 173..300 in order, all 128 valid
    assert step.swa_lens[0] == CFG.sliding_window
    assert step.swa_indices[0].tolist() == [_slot(ta, p, B) for p in range(173, 301)]
    # token b@5 sees 0..5 then -1 padding
    row = step.swa_indices[1 + 5].tolist()
    assert row[:6] == [_slot(tb, p, B) for p in range(6)] and set(row[6:]) == {-1}
    assert step.swa_slot_mapping[0] == _slot(ta, 300, B)
    # compressed entries: slot only where (p+1) % r == 0
    r4 = step.ratios[4]
    c4 = cache.groups["c4"]
    closes = [(int(p) + 1) % 4 == 0 for p in step.positions]
    assert [(s >= 0) for s in r4.compressed_slot_mapping.tolist()] == closes
    assert r4.compressed_slot_mapping[1 + 3] == _slot(c4.tables["b"], 0, c4.block_size)
    # HCA lists: the decode at 300 sees entries 0 and 1 of "a"; b@127 sees entry 0 only
    r128 = step.ratios[128]
    c128 = cache.groups["c128"]
    assert r128.hca_lens[0] == 2 and r128.hca_lens[1 + 127] == 1 and r128.hca_lens[1 + 126] == 0
    assert r128.hca_indices[0, :2].tolist() == [_slot(c128.tables["a"], i, c128.block_size) for i in range(2)]
    assert r128.hca_indices.shape[1] % 128 == 0


def test_windows_in_step_is_true_only_when_closing_requests_are_fresh():
    """SPEC §5.2 windows: the host-side promise compress_insert may act on (no device sync)."""
    cache = PlannedOnly(CFG, [0, 1, 2], num_blocks=400)
    fresh = cache.plan_step([StepRequest("a", 300), StepRequest("b", 7)]).metadata
    assert fresh.context_lens == (0, 0)
    assert fresh.windows_in_step(4) and fresh.windows_in_step(128)
    assert fresh._windows_in_step == {4: True, 128: True}  # once a step, then every layer reads it
    # a decode at 300 (closes no block at r = 4 or 128) beside a fresh prefill: still in the call
    step = cache.plan_step([StepRequest("a", 1), StepRequest("c", 130)]).metadata
    assert step.context_lens == (300, 0)
    assert step.windows_in_step(4) and step.windows_in_step(128)
    # a at 301..303: 303 closes an r = 4 block whose window starts at 296 (an earlier step); no r = 128 block
    step = cache.plan_step([StepRequest("a", 3)]).metadata
    assert not step.windows_in_step(4) and step.windows_in_step(128)
    # b continues 7..129: closes r = 4 blocks and the r = 128 block at 127
    step = cache.plan_step([StepRequest("b", 123)]).metadata
    assert not step.windows_in_step(4) and not step.windows_in_step(128)
    # metadata built elsewhere without host context lengths promises nothing
    from dataclasses import replace

    assert not replace(fresh, context_lens=None).windows_in_step(4)


def test_closing_windows_in_call_counts_closing_positions():
    """The closed form (c+n)//r == c//r against the definition: no new position p with (p+1) % r == 0."""
    for r in (4, 128):
        for c in range(2 * r + 3):
            for n in range(2 * r + 3):
                closes = any((p + 1) % r == 0 for p in range(c, c + n))
                assert closing_windows_in_call([c], [n], r) == (c == 0 or not closes), (r, c, n)
    assert closing_windows_in_call([0, 5], [9, 2], 4)  # fresh request closes, continuing one does not
    assert not closing_windows_in_call([0, 5], [9, 3], 4)  # 5..7: 7 closes a block opened in an earlier step
    with pytest.raises(ValueError):
        closing_windows_in_call([0], [1, 2], 4)


def test_sliding_groups_free_pages_outside_their_window():
    cache = PlannedOnly(CFG, [0, 1, 2], num_blocks=300)
    cache.plan_step([StepRequest("a", 1000)])
    before = cache.free_pages()
    cache.plan_step([StepRequest("a", 1)])
    after = cache.free_pages()

    def live(group: str) -> list[int]:
        return [i for i, p in enumerate(cache.groups[group].tables["a"]) if p >= 0]

    # The decode at position 1000 reads SWA positions 873..1000: pages 13..15 of 64 tokens stay.
    assert live("swa") == [13, 14, 15]
    assert after["swa"] - before["swa"] == 16 - 3
    # r=128 state (window 128, 8 rows a page): positions 873..1000 -> pages 109..125.
    assert live("state128") == list(range(873 // 8, 1000 // 8 + 1))
    # r=4 state (window 8, 4 rows a page): positions 993..1000 -> pages 248..250.
    assert live("state4") == [248, 249, 250]
    # compressed groups keep every entry: 1001 // 4 = 250 entries -> 4 pages of 64; 1001 // 128 = 7 -> 4 of 2
    assert live("c4") == [0, 1, 2, 3] and live("c128") == [0, 1, 2, 3]
    assert after["c4"] == before["c4"]


def test_rejected_plan_changes_nothing():
    cache = PlannedOnly(CFG, [0], num_blocks=4)
    cache.plan_step([StepRequest("a", 64)])
    snapshot = (cache.free_pages(), dict(cache.seq_lens), {k: list(v) for k, v in cache.groups["swa"].tables.items()})
    with pytest.raises(OutOfBlocksError, match="swa"):
        cache.plan_step([StepRequest("a", 10), StepRequest("b", 400)])
    with pytest.raises(DSV4ValueError, match="num_tokens"):
        cache.plan_step([StepRequest("c", 0)])
    with pytest.raises(DSV4ValueError, match="at most once"):
        cache.plan_step([StepRequest("a", 1), StepRequest("a", 1)])
    assert snapshot == (cache.free_pages(), dict(cache.seq_lens),
                        {k: list(v) for k, v in cache.groups["swa"].tables.items()})


def test_free_returns_every_page():
    cache = PlannedOnly(CFG, [0, 1, 2], num_blocks=300)
    empty = cache.free_pages()
    cache.plan_step([StepRequest("a", 500), StepRequest("b", 3)])
    cache.free("a")
    cache.free("b")
    assert cache.free_pages() == empty
    with pytest.raises(DSV4ValueError, match="request_id"):
        cache.free("a")


@pytest.mark.parametrize("geometry, kv, key, latent_page, key_page", [
    # vendor_backends.md §1.4 at bs 128: A5 81920 / 16896, A2/A3 131072 / 16640.
    ("ascend-a5", "ascend_a5", "indexer_fp8", 128 * 640, 128 * 132),
    ("ascend", "ascend_bf16", "indexer_ascend_int8", 128 * 1024, 128 * 130),
])
def test_ascend_geometry_cache_allocates_the_geometry_formats(geometry, kv, key, latent_page, key_page):
    cache = PlannedOnly(CFG, [1], num_blocks=2, geometry=geometry, profile="ascend")
    assert (cache.kv_format, cache.indexer_key_format) == (kv, key)
    lc = cache.layer(1)
    assert lc.swa[0].numel() * lc.swa.element_size() == latent_page
    assert lc.compressed[0].numel() * lc.compressed.element_size() == latent_page
    assert lc.indexer_keys[0].numel() * lc.indexer_keys.element_size() == key_page
    assert cache.groups["swa"].block_size == 128 and cache.groups["state4"].block_size == 8


def test_a_cache_refuses_a_geometry_that_would_change_its_profiles_formats():
    with pytest.raises(ConfigError, match="profile='ascend'"):  # deepseek writes mxfp4 keys, not int8
        PlannedOnly(CFG, [1], num_blocks=2, geometry="ascend")


def test_explicit_cache_format_wins_over_the_geometry_format():
    cache = PlannedOnly(CFG, [1], num_blocks=2, geometry="ascend-a5", profile="ascend", kv_format="fp8_ds_mla")
    assert (cache.kv_format, cache.indexer_key_format) == ("fp8_ds_mla", "indexer_fp8")
    lc = cache.layer(1)
    assert lc.swa[0].numel() * lc.swa.element_size() == 74880  # roundup(128 * 584, 576)
    assert lc.indexer_keys[0].numel() * lc.indexer_keys.element_size() == 128 * 132




class _Built(Exception):
    pass


def test_a_pool_whose_slots_overflow_int32_is_refused_before_anything_is_built(monkeypatch):
    """SPEC §10: index rows hold global slots in int32, so a group may have at most 2**31 slots."""
    import dsv4.cache as cache_module

    probe = PlannedOnly(CFG, [0, 2], num_blocks=1)
    per_page = {name: group.block_size for name, group in probe.groups.items()}

    def build(name, block_size, num_blocks, window):
        if num_blocks > 1:
            raise _Built(name)
        return real(name, block_size, num_blocks, window)

    real = cache_module.BlockPool
    monkeypatch.setattr(cache_module, "BlockPool", build)
    for name, entries in per_page.items():
        most = dict.fromkeys(per_page, 1)
        most[name] = 2**31 // entries  # slots 0 .. 2**31 - 1: accepted, so its pool is built
        with pytest.raises(_Built, match=name):
            PlannedOnly(CFG, [0, 2], num_blocks=most)
        with pytest.raises(DSV4ValueError, match=rf"num_blocks\['{name}'\].*int32 global slots"):
            PlannedOnly(CFG, [0, 2], num_blocks={**most, name: most[name] + 1})
