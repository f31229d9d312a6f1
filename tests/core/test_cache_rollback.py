"""Speculative decoding (MTP): ``PagedKVCache.rollback`` discards the rejected draft tokens of a request's
latest step. The accepted tokens' outputs equal the ideal of the accepted sequence alone, bit for bit, and
the rejected rows (left in the pages) never reach a later output."""
import pytest
import torch
from _cache_helpers import PlannedOnly
from _layer_helpers import CFG, tiny_layer, tiny_x
from dsv4 import PagedKVCache, StepRequest
from dsv4.specs.errors import DSV4TypeError, DSV4ValueError

# Accepted tokens a verify step of 1 + 4 tokens keeps (the first, the last sampled token, always).
# After a 252-token prefill the first verify step covers positions 252-256 and keeps 252-253: its rejected
# rows at 255 close an HCA entry (r = 128) and a CSA entry (r = 4) that no accepted token may see.
PREFILL, DRAFTS, ACCEPTED = 252, 4, (2, 5, 1, 3, 5, 2, 1, 4)


def _speculative(attn, x: torch.Tensor, garbage_seed: int) -> torch.Tensor:
    """Outputs of the accepted rows ``x`` run as a prefill then verify steps of 1 + DRAFTS tokens, each
    keeping ``ACCEPTED[i]`` rows; the rejected rows are ``garbage_seed``'s large random rows."""
    cache = PagedKVCache(CFG, [attn.layer_id], num_blocks=256)
    gen = torch.Generator().manual_seed(garbage_seed)
    outs = [attn(x[:PREFILL], cache.plan_step([StepRequest("r", PREFILL)]))]
    length = PREFILL
    for kept in ACCEPTED:
        junk = (torch.randn(DRAFTS + 1 - kept, x.shape[1], generator=gen) * 50).to(x.dtype)
        out = attn(torch.cat([x[length:length + kept], junk]), cache.plan_step([StepRequest("r", DRAFTS + 1)]))
        outs.append(out[:kept])
        length = cache.rollback("r", DRAFTS + 1 - kept)
    assert length == PREFILL + sum(ACCEPTED) == x.shape[0]
    return torch.cat(outs)


@pytest.mark.parametrize("layer_id", [0, 1, 2])
@torch.no_grad()
def test_accepted_tokens_equal_the_accepted_sequence_alone(layer_id):
    """float64: the ideal is batch-invariant, so verify steps with rollbacks give the prefill's bits; bf16:
    two runs whose rejected rows differ give the same bits (no read reaches a rejected row)."""
    n = PREFILL + sum(ACCEPTED)
    ideal = tiny_layer(layer_id, dtype=torch.float64)
    x64 = tiny_x(n, dtype=torch.float64)
    prefill = ideal(x64, PagedKVCache(CFG, [layer_id], num_blocks=256).plan_step([StepRequest("r", n)]))
    assert torch.equal(_speculative(ideal, x64, garbage_seed=1), prefill)
    served, x = tiny_layer(layer_id), tiny_x(n)
    assert torch.equal(_speculative(served, x, garbage_seed=1), _speculative(served, x, garbage_seed=2))


def test_rollback_moves_the_next_step_back_and_keeps_the_pages():
    cache = PlannedOnly(CFG, [0, 1, 2], num_blocks=64)
    cache.plan_step([StepRequest("a", 130), StepRequest("b", 3)])
    cache.plan_step([StepRequest("a", 5)])
    tables = {name: group.tables for name, group in cache.groups.items()}
    assert cache.rollback("a", 3) == 132 and cache.rollback("a", 0) == 132 and cache.seq_lens == {"a": 132, "b": 3}
    assert {name: group.tables for name, group in cache.groups.items()} == tables
    free = cache.free_pages()
    step = cache.plan_step([StepRequest("a", 2)])  # positions 132, 133: on pages a already holds
    assert step.metadata.positions.tolist() == [132, 133] and step.metadata.context_lens == (132,)
    assert all(len(cache.groups[name].tables["a"]) == len(tables[name]["a"]) for name in cache.groups)
    assert all(cache.free_pages()[name] >= free[name] for name in free)  # none taken (a state page slid out)
    cache.rollback("a", 2)
    cache.free("a")
    with pytest.raises(DSV4ValueError, match="request_id: expected a request known to this cache"):
        cache.rollback("a", 1)


@pytest.mark.parametrize("call, error, message", [
    (lambda c: c.rollback("nobody", 1), DSV4ValueError, r"request_id: expected a request known .*got 'nobody'"),
    (lambda c: c.rollback(["a"], 1), DSV4ValueError, r"request_id: expected a request known"),
    (lambda c: c.rollback("a", True), DSV4TypeError, r"num_tokens: expected an int >= 0.*got bool True"),
    (lambda c: c.rollback("a", 1.0), DSV4TypeError, r"num_tokens: expected an int >= 0.*got float 1.0"),
    (lambda c: c.rollback("a", -1), DSV4ValueError,
     r"num_tokens: expected 0 \.\. 5 \(the tokens step #2 appended to request 'a' and not rolled back\).*got -1"),
    (lambda c: c.rollback("a", 6), DSV4ValueError, r"num_tokens: expected 0 \.\. 5 .*got 6"),
    (lambda c: (c.rollback("a", 3), c.rollback("a", 3)), DSV4ValueError, r"num_tokens: expected 0 \.\. 2 .*got 3"),
])
def test_rollback_arguments_raise_named_errors_and_change_nothing(call, error, message):
    cache = PlannedOnly(CFG, [0, 1, 2], num_blocks=64)
    cache.plan_step([StepRequest("a", 20)])
    cache.plan_step([StepRequest("a", 5)])
    with pytest.raises(error, match=message):
        call(cache)
    assert cache.seq_lens["a"] in (25, 22)  # 22: the first of two rollbacks took effect, the second none


def test_rollback_waits_for_every_layer_to_run_the_step():
    """Rejected tokens are known once the step ran in every layer (and was sampled): a rollback before
    that is an engine bug, refused naming the layers; after mark_written (a graph replay) it is taken."""
    cache = PagedKVCache(CFG, [0, 1, 2], num_blocks=64)
    step = cache.plan_step([StepRequest("a", 5)])
    cache.mark_written(step, 0)
    with pytest.raises(DSV4ValueError, match=r"request_id: .*every layer wrote.*got layers \[1, 2\] still to run step "
                                             r"#1 \(never run.*cache.mark_written\(step\)"):
        cache.rollback("a", 2)
    assert cache.seq_lens == {"a": 5}
    cache.mark_written(step)
    assert cache.rollback("a", 2) == 3


def test_rollback_of_a_step_that_can_no_longer_run_says_free_and_prefill():
    """Layer 0 ran a step of a and b; b was freed and another request planned: the step can no longer run,
    so running it (or mark_written) is no remedy; the refusal says what is (as plan_step's does)."""
    cache = PagedKVCache(CFG, [0, 1, 2], num_blocks=64)
    step = cache.plan_step([StepRequest("a", 5), StepRequest("b", 5)])
    cache.mark_written(step, 0)
    cache.free("b")
    cache.mark_written(cache.plan_step([StepRequest("c", 3)]))
    message = (r"request_id: .*got layers \[1, 2\] still to run step #1, which can no longer run \(request 'b' of it "
               r"was freed and step #3 planned since\).*free\(\) this request and prefill it again")
    with pytest.raises(DSV4ValueError, match=message):
        cache.rollback("a", 2)
    with pytest.raises(DSV4ValueError, match=message.replace("request_id", r"requests\['a'\]")):
        cache.plan_step([StepRequest("a", 1)])
    assert cache.seq_lens == {"a": 5, "c": 3}


def test_a_plan_undone_keeps_the_tokens_a_rollback_may_discard(monkeypatch):
    """A plan whose metadata cannot be built is undone, including where the latest step started."""
    import dsv4.cache as cache_module

    cache = PlannedOnly(CFG, [0, 1, 2], num_blocks=64)
    cache.plan_step([StepRequest("a", 5)])

    def boom(*args, **kwargs):
        raise MemoryError("out of device memory building the step tables")

    monkeypatch.setattr(cache_module.PagedKVCache, "_metadata", boom)
    with pytest.raises(MemoryError):
        cache.plan_step([StepRequest("a", 3)])
    assert cache.rollback("a", 5) == 0
