"""The layer's pre-write checks (SPEC §12): stale steps, backends, parameter dtypes, cache/config agreement,
and what a rejected forward leaves behind. Every rejection must leave every cache byte as it was."""
import numpy as np
import pytest
import torch
from _layer_helpers import CFG, same_bytes, snapshot, tiny_layer, tiny_x
from dsv4 import Attention, ModelConfig, PagedKVCache, StepRequest
from dsv4.cache import StaleStepError
from dsv4.specs.errors import CacheLayoutError, DSV4Error, DSV4TypeError, DSV4ValueError


@torch.no_grad()
def test_stale_step_is_refused_before_it_overwrites_another_requests_pages():
    attn = tiny_layer(0)
    cache = PagedKVCache(CFG, [0], num_blocks=8)
    old = cache.plan_step([StepRequest("victim", 10)])
    cache.free("victim")  # preempted after planning
    new = cache.plan_step([StepRequest("other", 10)])  # reuses the victim's page
    assert torch.equal(old.metadata.swa_slot_mapping, new.metadata.swa_slot_mapping)
    attn(tiny_x(10, seed=5), new)
    before = snapshot(cache)
    with pytest.raises(StaleStepError, match="stale step: request 'victim' was freed"):
        attn(tiny_x(10, seed=9), old)
    assert same_bytes(before, snapshot(cache))
    attn(tiny_x(1, seed=6), cache.plan_step([StepRequest("other", 1)]))  # not marked: a stale step marks nothing


@torch.no_grad()
def test_every_layer_may_run_the_latest_step_and_a_rerun_writes_the_same_bytes():
    layers = [tiny_layer(i) for i in (0, 1, 2)]
    cache = PagedKVCache(CFG, [0, 1, 2], num_blocks=64)
    step = cache.plan_step([StepRequest("r", 50)])
    x = tiny_x(50)
    first = [attn(x, step) for attn in layers]
    after_first = snapshot(cache)
    second = [attn(x, step) for attn in layers]
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert same_bytes(after_first, snapshot(cache))


@torch.no_grad()
def test_rejected_forward_blocks_the_next_plan_until_retried_or_freed():
    attn = tiny_layer(0)
    cache = PagedKVCache(CFG, [0], num_blocks=64)
    step = cache.plan_step([StepRequest("r", 40), StepRequest("s", 3)])
    bad = tiny_x(43)
    bad[0, 0] = float("nan")
    with pytest.raises(DSV4ValueError, match="NaN/Inf"):
        attn(bad, step)
    with pytest.raises(DSV4ValueError, match=r"requests\['r'\]: .*layers \[0\] still to run step #1.*free\(\)"):
        cache.plan_step([StepRequest("r", 1)])
    cache.plan_step([StepRequest("t", 2)])  # other requests are not blocked
    attn(tiny_x(43), step)  # the same step with a corrected input: clears the mark
    cache.plan_step([StepRequest("r", 1), StepRequest("s", 1)])
    # or free and prefill again
    step = cache.plan_step([StepRequest("u", 5)])
    with pytest.raises(DSV4ValueError, match="rows"):
        attn(tiny_x(5), step, rows=slice(0, 5, 2))
    cache.free("u")
    cache.plan_step([StepRequest("u", 5)])


@torch.no_grad()
def test_bad_rows_are_refused_before_the_forward_marks_anything():
    """``rows`` that is not a contiguous slice with int bounds: an error naming ``rows`` (not slice.indices'
    bare TypeError), and the layers that already ran the step stay written (no mark_unwritten)."""
    cache = PagedKVCache(CFG, [0, 1], num_blocks=64)
    step = cache.plan_step([StepRequest("r", 6)])
    tiny_layer(0)(tiny_x(6), step)
    attn = tiny_layer(1)
    for rows in (slice(0.5, 2), slice(0, 6, 2), slice("a", None), range(6)):
        before = snapshot(cache)
        with pytest.raises(DSV4ValueError, match=r"^rows: expected None or a contiguous slice"):
            attn(tiny_x(6), step, rows=rows)
        assert same_bytes(before, snapshot(cache))
    assert attn(tiny_x(6), step, rows=slice(2, None)).shape[0] == 4
    cache.plan_step([StepRequest("r", 1)])  # layer 0 need not run the step again


def test_backend_names_are_checked_when_the_layer_is_built():
    with pytest.raises(DSV4ValueError, match=r"backends\['qnorm_rope_insert'\]: expected 'auto' or a registered"):
        Attention(CFG, 2, backends={"qnorm_rope_insert": "bogus"})
    with pytest.raises(DSV4ValueError, match="backends: expected 'auto' or a registered backend .*got 'bogus'"):
        Attention(CFG, 0, backends="bogus")
    with pytest.raises(DSV4ValueError, match=r"backends: expected keys among .*\['bogus_op'\]"):
        Attention(CFG, 0, backends={"bogus_op": "reference"})
    with pytest.raises(DSV4TypeError, match="backends: expected None, a backend name.*got int 123"):
        Attention(CFG, 0, backends=123)
    assert Attention(CFG, 0, backends={"sparse_attention": "reference"}).backends["indexer_q"] == "auto"
    # a backend named for an op it does not implement: said when the layer is built, not as its probe's reason
    with pytest.raises(DSV4ValueError, match=r"^backends\['output_projection'\]: expected a backend that implements "
                                             r"output_projection, got 'flashmla', which implements sparse_attention"):
        Attention(CFG, 2, backends={"output_projection": "flashmla"})
    with pytest.raises(DSV4ValueError, match=r"^backends: expected a backend that implements qnorm_rope_insert, "
                                             r"got 'flashmla'.*backends=\{'sparse_attention': 'flashmla'\}"):
        Attention(CFG, 1, backends="flashmla")


@pytest.mark.parametrize("layer_id, backends", [(1, {"sparse_attention": "flashmla"}),
                                                (2, {"sparse_attention": "flashmla"})])
@torch.no_grad()
def test_a_backend_that_cannot_run_the_step_is_refused_before_any_write(layer_id, backends):
    attn = tiny_layer(layer_id, backends=backends)
    cache = PagedKVCache(CFG, [layer_id], num_blocks=64)
    step = cache.plan_step([StepRequest("r", 40)])
    before = snapshot(cache)
    with pytest.raises(DSV4Error, match="flashmla"):
        attn(tiny_x(40), step)
    assert same_bytes(before, snapshot(cache))


@pytest.mark.parametrize("path, change, error, message", [
    ("wq_b.weight", lambda t: t.float(), DSV4TypeError,
     r"^layer parameter wq_b.weight: expected dtype torch.bfloat16 \(x's: the projections run in it\), got torch.float32"),
    ("indexer.weights_proj.weight", lambda t: t.float(), DSV4TypeError,
     r"^layer parameter indexer.weights_proj.weight: expected dtype torch.bfloat16"),
    ("wo_b.weight", lambda t: t.to("meta"), DSV4ValueError,
     r"^layer parameter wo_b.weight: expected device cpu \(x's and the cache's\), got meta"),
    ("compressor.ape", lambda t: t.to("meta"), DSV4ValueError, r"^layer parameter compressor.ape: expected device cpu"),
])
@torch.no_grad()
def test_a_projection_in_another_dtype_or_device_is_named_before_any_write(path, change, error, message):
    """A ``.data`` swap of a projection weight (dtype) or any parameter (device): before, torch raised inside the
    projection after the compressor had written the cache (or, on ``meta``, the output was garbage)."""
    attn = tiny_layer(1)  # CSA: compressor, indexer and projections
    cache = PagedKVCache(CFG, [1], num_blocks=64)
    step = cache.plan_step([StepRequest("r", 40)])
    param = attn.get_parameter(path)
    if error is DSV4TypeError:
        param.data = change(param.data)  # the same Parameter, another dtype
    else:  # a tensor cannot take another device's data: a new Parameter in its place
        owner, _, attr = path.rpartition(".")
        setattr(attn.get_submodule(owner), attr, torch.nn.Parameter(change(param.data), requires_grad=False))
    before = snapshot(cache)
    with pytest.raises(error, match=message):
        attn(tiny_x(40), step)
    assert same_bytes(before, snapshot(cache))


@pytest.mark.parametrize("layer_id", [0, 1, 2])
@torch.no_grad()
def test_layer_cast_to_bf16_names_the_fp32_parameter(layer_id):
    attn = tiny_layer(layer_id).to(torch.bfloat16)
    cache = PagedKVCache(CFG, [layer_id], num_blocks=64)
    step = cache.plan_step([StepRequest("r", 20)])
    before = snapshot(cache)
    with pytest.raises(DSV4TypeError, match=r"layer parameter attn_sink.*expected dtype torch.float32.*"
                                            r"got torch.bfloat16; .*cast the input x"):
        attn(tiny_x(20), step)
    assert same_bytes(before, snapshot(cache))


@pytest.mark.parametrize("path, name", [("indexer.compressor.norm", "indexer.compressor.norm.weight"),
                                        ("compressor", "compressor.ape"), ("q_norm", "q_norm.weight")])
@torch.no_grad()
def test_a_submodule_replaced_after_a_forward_by_a_bf16_one_is_refused(path, name):
    """The fp32-parameter check finds its parameters once; a submodule swapped in after that first forward
    (here a bf16 copy) must still be seen, not the old module it found then."""
    import copy
    attn = tiny_layer(1)
    cache = PagedKVCache(CFG, [1], num_blocks=64)
    attn(tiny_x(20), cache.plan_step([StepRequest("r", 20)]))
    owner, _, attr = path.rpartition(".")
    parent = attn.get_submodule(owner) if owner else attn
    setattr(parent, attr, copy.deepcopy(getattr(parent, attr)).bfloat16())
    step = cache.plan_step([StepRequest("r", 1)])
    before = snapshot(cache)
    with pytest.raises(DSV4TypeError, match=rf"layer parameter {name.replace('.', '[.]')}: expected dtype torch.float32"):
        attn(tiny_x(1), step)
    assert same_bytes(before, snapshot(cache))


@pytest.mark.parametrize("layer_id, cache_cfg, message", [
    (1, {"compress_ratios": (0, 128, 4, 0)}, "step.cache layer 1: expected a CSA layer .*got HCA"),
    (2, {"compress_ratios": (0, 128, 4, 0)}, "step.cache layer 2: expected a HCA layer .*got CSA"),
    (0, {"sliding_window": 64}, "step.cache sliding_window: expected 128 .*got 64"),
    (1, {"index_topk": 16}, "step.cache index_topk: expected 8 .*got 16"),
    (0, {"max_position_embeddings": 1 << 21}, r"step.cache max_position_embeddings: expected at most \d+ .*got 2097152"),
])
@torch.no_grad()
def test_cache_built_from_another_config_is_refused(layer_id, cache_cfg, message):
    attn = tiny_layer(layer_id)
    cache = PagedKVCache(ModelConfig(**{**CFG.model_dump(), **cache_cfg}), [layer_id], num_blocks=64)
    step = cache.plan_step([StepRequest("r", 200)])
    before = snapshot(cache)
    with pytest.raises(CacheLayoutError, match=message):
        attn(tiny_x(200), step)
    assert same_bytes(before, snapshot(cache))


@torch.no_grad()
def test_a_step_of_a_cache_without_the_layer_names_the_step():
    """The caller passed a step, not a layer id: the error names ``step`` and the layers its cache serves."""
    cache = PagedKVCache(CFG, [0, 1], num_blocks=16)
    step = cache.plan_step([StepRequest("r", 4)])
    before = snapshot(cache)
    with pytest.raises(DSV4ValueError, match=r"^step: expected a step of a cache serving layer 2 \(this layer\), "
                                             r"got a step of a cache serving layers \(0, 1\)"):
        tiny_layer(2)(tiny_x(4), step)
    assert same_bytes(before, snapshot(cache))


class _CountingLayers(dict):
    """A cache's ``layers`` dict that counts look-ups of a layer id (``in``, ``[]``, ``get``)."""

    lookups = 0

    def __contains__(self, key):
        type(self).lookups += 1
        return super().__contains__(key)

    def __getitem__(self, key):
        type(self).lookups += 1
        return super().__getitem__(key)

    def get(self, key, default=None):
        type(self).lookups += 1
        return super().get(key, default)


@pytest.mark.parametrize("layer_id", [0, 1, 2])
@torch.no_grad()
def test_a_forward_looks_its_layer_id_up_in_the_cache_once(layer_id, monkeypatch):
    """The membership check (the error naming ``step``) also finds the layer's storage; the forward and its
    ``mark_written`` do not look it up again (they did three to five times)."""
    cache = PagedKVCache(CFG, [0, 1, 2], num_blocks=16)
    cache.layers = _CountingLayers(cache.layers)
    step = cache.plan_step([StepRequest("r", 8)])
    monkeypatch.setattr(_CountingLayers, "lookups", 0)
    tiny_layer(layer_id)(tiny_x(8), step)
    assert _CountingLayers.lookups == 1
    assert cache._pending[step.serial] == {0, 1, 2} - {layer_id}  # still marked written by this layer


def test_non_tensor_input_is_a_named_error():
    attn = tiny_layer(0)
    cache = PagedKVCache(CFG, [0], num_blocks=16)
    with pytest.raises(DSV4TypeError, match="x: expected a torch.Tensor"):
        attn(np.zeros((4, CFG.hidden_size)), cache.plan_step([StepRequest("r", 4)]))


def test_a_failed_layer_marks_every_layer_of_the_cache_until_each_has_run_the_step_again():
    """Layer 0 succeeds, layer 1 raises, layer 2 never runs: all three must run the step again before
    the next plan (re-running layer 1 alone would leave layer 2's pages of the step unwritten). The NaN
    error names the requests of the bad rows."""
    from dsv4.layer import Attention

    torch.manual_seed(0)
    layers = [Attention(CFG, layer_id=i).double() for i in range(3)]
    cache = PagedKVCache(CFG, [0, 1, 2], num_blocks=64)
    step = cache.plan_step([StepRequest("good", 5), StepRequest("bad", 3)])
    x = torch.randn(8, CFG.hidden_size, dtype=torch.float64)
    layers[0](x, step)
    bad = x.clone()
    bad[6] = float("nan")
    with pytest.raises(DSV4ValueError, match=r"NaN/Inf in token rows \[6\] \(requests \['bad'\]\)"):
        layers[1](bad, step)
    layers[1](x, step)
    with pytest.raises(DSV4ValueError, match=r"layers \[0, 2\] still to run step"):
        cache.plan_step([StepRequest("good", 1)])
    layers[0](x, step)
    layers[2](x, step)
    cache.plan_step([StepRequest("good", 1)])
