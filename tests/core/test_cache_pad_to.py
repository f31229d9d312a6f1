"""``plan_step(..., pad_to=N)``: every table of a step's metadata as wide as N tokens need, so that one CUDA
graph serves a whole decode loop (``copy_metadata_`` needs equal shapes); padding changes no output."""
import pytest
import torch
from _cache_helpers import PlannedOnly
from _layer_helpers import CFG, tiny_layer, tiny_x
from dsv4 import PagedKVCache, StepRequest
from dsv4.metadata import INDEX_ALIGNMENT, copy_metadata_
from dsv4.specs.errors import DSV4TypeError, DSV4ValueError


def _decode_loop(pad_to, steps: int = 140):
    """Two requests of 120 and 250 tokens decoding ``steps`` tokens: SWA, c4, c128 and state pages are
    crossed on the way. -> the first step and whether every later step's metadata copied into it."""
    cache = PlannedOnly(CFG, [0, 1, 2], num_blocks=256)
    cache.plan_step([StepRequest("a", 120), StepRequest("b", 250)])
    first = cache.plan_step([StepRequest("a", 1), StepRequest("b", 1)], pad_to=pad_to)
    copied = 0
    for _ in range(steps):
        step = cache.plan_step([StepRequest("a", 1), StepRequest("b", 1)], pad_to=pad_to)
        try:
            copy_metadata_(first.metadata, step.metadata)
        except DSV4ValueError:
            continue
        copied += 1
        assert torch.equal(first.metadata.positions, step.metadata.positions)
    return first, copied


def test_a_padded_decode_loop_keeps_every_shape():
    _, copied = _decode_loop(pad_to=512)
    assert copied == 140
    _, copied = _decode_loop(pad_to=None)
    assert copied < 140  # unpadded tables grow as pages are crossed: a graph would need capturing again
    padded, _ = _decode_loop(pad_to=512, steps=0)
    r4, r128 = padded.metadata.ratios[4], padded.metadata.ratios[128]
    assert padded.metadata.swa.block_table.shape[1] == 512 // padded.metadata.swa.block_size
    assert r4.compressed.block_table.shape[1] == -(-(512 // 4) // r4.compressed.block_size)
    assert r4.state.block_table.shape[1] == 512 // r4.state.block_size
    assert r128.hca_indices.shape[1] == INDEX_ALIGNMENT  # 512 // 128 entries, rounded up to the alignment
    cache = PlannedOnly(CFG, [2], num_blocks=256)
    wide = cache.plan_step([StepRequest("a", 3)], pad_to=40000).metadata.ratios[128]
    assert wide.hca_indices.shape[1] == 384 and wide.compressed.block_table.shape[1] == -(-312 // wide.compressed.block_size)


@pytest.mark.parametrize("layer_id", [0, 1, 2])
@torch.no_grad()
def test_padding_changes_no_output(layer_id):
    """A prefill and two decodes of two requests, padded to 1024 and not: the same bits (float64 and bf16)."""
    for dtype in (torch.float64, torch.bfloat16):
        attn, x = tiny_layer(layer_id, dtype=dtype), tiny_x(262, dtype=dtype)
        outs = []
        for pad_to in (None, 1024):
            cache = PagedKVCache(CFG, [layer_id], num_blocks=256)
            out = [attn(x[:258], cache.plan_step([StepRequest("a", 130), StepRequest("b", 128)], pad_to=pad_to))]
            for i in range(2):
                rows = x[258 + 2 * i:260 + 2 * i]
                out.append(attn(rows, cache.plan_step([StepRequest("a", 1), StepRequest("b", 1)], pad_to=pad_to)))
            outs.append(torch.cat(out))
        assert torch.equal(outs[0], outs[1]), dtype


@pytest.mark.parametrize("pad_to, error, message", [
    (24, DSV4ValueError, r"pad_to: expected a length in 25 \.\. 1048576 .*got 24"),
    (2**21, DSV4ValueError, r"pad_to: expected a length in 25 \.\. 1048576 .*got 2097152"),
    (True, DSV4TypeError, r"pad_to: expected None or an int.*got bool True"),
    (64.0, DSV4TypeError, r"pad_to: expected None or an int.*got float 64.0"),
])
def test_pad_to_arguments_raise_named_errors_and_change_nothing(pad_to, error, message):
    cache = PlannedOnly(CFG, [0, 1, 2], num_blocks=64)
    cache.plan_step([StepRequest("a", 20)])
    with pytest.raises(error, match=message):
        cache.plan_step([StepRequest("a", 5)], pad_to=pad_to)
    assert cache.seq_lens == {"a": 20}
    cache.plan_step([StepRequest("a", 5)], pad_to=64)


def test_pages_a_rollback_kept_past_pad_to_are_named_before_anything_is_committed(monkeypatch):
    """A request rolled back from 66 to 62 still holds two SWA pages of 64; padding its next step to 63
    tokens (one page) cannot hold its table: refused naming pad_to, before any page or record changes
    (the commit's undo is never needed)."""
    cache = PlannedOnly(CFG, [0], num_blocks=64)
    cache.plan_step([StepRequest("a", 60)])
    cache.plan_step([StepRequest("a", 6)])
    cache.rollback("a", 4)
    tables, free = cache.groups["swa"].tables, cache.free_pages()
    monkeypatch.setattr(PlannedOnly, "_undo_plan", lambda *a: pytest.fail("a refused pad_to reached the commit"))
    with pytest.raises(DSV4ValueError, match=r"pad_to: expected a length >= 65 \(request 'a' holds 2 'swa' pages of 64 "
                                             r"entries\), got 63; a rollback leaves its pages"):
        cache.plan_step([StepRequest("a", 1)], pad_to=63)
    assert (cache.seq_lens, cache.groups["swa"].tables, cache.free_pages()) == ({"a": 62}, tables, free)
    assert cache.plan_step([StepRequest("a", 1)], pad_to=65).metadata.swa.block_table.shape == (1, 2)


def test_the_least_pad_to_named_for_a_compressed_group():
    """A 130-token prefill rolled back whole: request b holds its c128 page (and c4, state pages); the
    refusal names the least pad_to, which then plans."""
    cache = PlannedOnly(CFG, [1, 2], num_blocks=64)
    cache.plan_step([StepRequest("a", 3), StepRequest("b", 130)])
    cache.rollback("b", 130)
    with pytest.raises(DSV4ValueError, match=r"pad_to: expected a length >= (\d+) \(request 'b' holds") as error:
        cache.plan_step([StepRequest("a", 1), StepRequest("b", 1)], pad_to=4)
    least = int(error.value.expected.split()[3])
    with pytest.raises(DSV4ValueError, match="pad_to: expected a length >="):
        cache.plan_step([StepRequest("a", 1), StepRequest("b", 1)], pad_to=least - 1)
    cache.plan_step([StepRequest("a", 1), StepRequest("b", 1)], pad_to=least)


def test_the_least_pad_to_named_fits_every_group():
    """Pages of different sizes need different least lengths (swa 64 entries, c4 64 entries of 4 tokens,
    state4 pages of 4): the refusal names the largest, once, and that length plans (it named swa's 513, then
    c4's 516, then state4's 517 in turn when each group was checked alone)."""
    cache = PlannedOnly(CFG, [1, 2], num_blocks=256)
    cache.plan_step([StepRequest("a", 520)])
    cache.rollback("a", 220)
    with pytest.raises(DSV4ValueError, match=r"pad_to: expected a length >= (\d+) \(request 'a' holds") as error:
        cache.plan_step([StepRequest("a", 1)], pad_to=301)
    least = int(error.value.expected.split()[3])
    cache.plan_step([StepRequest("a", 1)], pad_to=least)
