"""dsv4.layer_dispatch: the layer's selections are made once a configuration, and in eager mode without
value checks it calls the selected backends directly, with the same bits as through dsv4.ops."""
import pytest
import torch
from _layer_helpers import CFG, same_bytes, snapshot, tiny_layer, tiny_x
from _spies import first_args
from dsv4 import Attention, PagedKVCache, StepRequest, layer_dispatch, ops
from dsv4.backends.reference import ReferenceBackend
from dsv4.ops.dispatch import record_selections
from dsv4.registry import get_registry
from dsv4.specs.errors import DSV4Error

CHUNKS = [70, 1, 57, 1, 1]  # a prefill, decodes, a chunk that closes HCA block 127, decodes


def _direct(monkeypatch, on: bool) -> None:
    """The CPU always value-checks, so it never calls directly: tests switch that off to reach the path."""
    monkeypatch.setattr(layer_dispatch, "device_value_checks", lambda device: not on)


def _count_custom_ops(monkeypatch) -> list:
    return first_args(monkeypatch, ops, "_call")


@torch.no_grad()
def _run(attn: Attention) -> tuple[list[torch.Tensor], dict]:
    cache = PagedKVCache(CFG, [attn.layer_id], num_blocks=256)
    outs = [attn(tiny_x(n, seed=seed), cache.plan_step([StepRequest("a", n)])) for seed, n in enumerate(CHUNKS)]
    return outs, {name: t.clone() for name, t in cache.layer(attn.layer_id).tensors().items()}


@pytest.mark.parametrize("layer_id", [0, 1, 2])
def test_direct_calls_write_and_return_the_same_bits_as_the_ops(monkeypatch, layer_id):
    calls = _count_custom_ops(monkeypatch)
    _direct(monkeypatch, False)
    ref_outs, ref_cache = _run(tiny_layer(layer_id))
    assert len(calls) >= 3 * len(CHUNKS)  # qnorm_rope_insert, sparse_attention, output_projection at least
    calls.clear()
    _direct(monkeypatch, True)
    outs, cache = _run(tiny_layer(layer_id))
    assert calls == []  # no dsv4.ops boundary, no custom op
    assert all(torch.equal(a, b) for a, b in zip(outs, ref_outs, strict=True))
    assert cache.keys() == ref_cache.keys()
    assert all(torch.equal(cache[k].view(torch.uint8), ref_cache[k].view(torch.uint8)) for k in cache)


@torch.no_grad()
def test_direct_calls_only_where_nothing_traces_and_nothing_value_checks(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    x = torch.zeros(2, 3)
    assert not layer_dispatch.direct_calls(x)  # the CPU value-checks every call
    _direct(monkeypatch, True)
    assert layer_dispatch.direct_calls(x)
    with torch.enable_grad():  # the custom ops refuse a backward; the backends alone would not
        assert not layer_dispatch.direct_calls(x)
    with FakeTensorMode() as mode:
        assert not layer_dispatch.direct_calls(mode.from_tensor(x))

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Passthrough():  # make_fx and functionalization trace through a dispatch mode
        assert not layer_dispatch.direct_calls(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not layer_dispatch.direct_calls(x)
    monkeypatch.setattr(torch.jit, "is_tracing", lambda: True)
    assert not layer_dispatch.direct_calls(x)
    monkeypatch.setattr(torch.jit, "is_tracing", lambda: False)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not layer_dispatch.direct_calls(x)


def test_value_checks_stay_on_under_modes_that_hold_real_tensors():
    """Only proxy tracing (make_fx, functionalization) turns the CPU's value checks off."""
    from dsv4.ops.validate import value_checks_enabled
    from torch.utils.flop_counter import FlopCounterMode

    x = torch.zeros(2, 3)
    with FlopCounterMode(display=False):
        assert value_checks_enabled(x)


def test_make_fx_of_the_layer_keeps_the_opaque_custom_ops(monkeypatch):
    """Tracing the layer records dsv4 custom ops even where eager calls would go direct."""
    _direct(monkeypatch, True)
    attn = Attention(CFG, 1, backends="reference", check_finite=False)
    attn.reset_parameters(torch.Generator().manual_seed(0))
    cache = PagedKVCache(CFG, [1], num_blocks=64)
    step = cache.plan_step([StepRequest("a", 9)])
    with torch.no_grad():
        gm = torch.fx.experimental.proxy_tensor.make_fx(lambda x: attn(x, step), tracing_mode="real")(tiny_x(9, seed=0))
    graph = str(gm.graph)
    for op in ("qnorm_rope_insert", "compress_insert", "indexer_q", "indexer_topk", "sparse_attention",
               "output_projection"):
        assert f"dsv4.{op}" in graph, op


class _Counting(ReferenceBackend):
    name = "counting_reference"


def test_selection_is_made_once_and_made_again_when_anything_it_depends_on_changes(monkeypatch):
    _direct(monkeypatch, True)
    resolved = first_args(monkeypatch, layer_dispatch, "resolve")
    attn = tiny_layer(1)  # CSA: seven op calls a forward, compress_insert twice
    cache = PagedKVCache(CFG, [1], num_blocks=64)

    def forward(n: int = 1):
        resolved.clear()
        with torch.no_grad(), record_selections() as used:
            attn(tiny_x(n, seed=0), cache.plan_step([StepRequest("a", n)]))
        return list(resolved), used

    first, used = forward(8)
    assert sorted(first) == sorted(["qnorm_rope_insert", "compress_insert", "compress_insert", "indexer_q",
                                    "indexer_topk", "sparse_attention", "output_projection"])
    again, used_again = forward()
    assert again == []  # memoized
    assert used_again == used == {op: {"reference"} for op in set(first)}  # still recorded
    registry = get_registry()
    registry.register_backend(_Counting())
    try:
        assert forward()[0] != []  # a registry change selects again
        assert forward()[0] == []
        monkeypatch.setenv("DSV4_BACKEND", "counting_reference")
        attn.backends = dict.fromkeys(attn.backends, "auto")
        assert sorted(forward()[0]) == sorted(first)  # the environment and the layer's choices are in the key
        assert forward()[1] == {op: {"counting_reference"} for op in set(first)}
        monkeypatch.setenv("DSV4_BACKEND", "bogus")
        with pytest.raises(DSV4Error, match="bogus"):  # a memo never hides a refusal
            forward()
    finally:
        registry.unregister_backend("counting_reference")


def test_grad_mode_goes_through_the_ops(monkeypatch):
    """With autograd on, the layer takes the custom ops (which refuse a backward) even where eager
    inference would call the backends directly."""
    calls = _count_custom_ops(monkeypatch)
    _direct(monkeypatch, True)
    attn = tiny_layer(2)
    cache = PagedKVCache(CFG, [2], num_blocks=64)
    attn(tiny_x(4, seed=0), cache.plan_step([StepRequest("a", 4)]))
    assert "sparse_attention" in calls


def test_a_backend_instance_needs_no_hash_and_copies_keep_the_registry_backends(monkeypatch):
    import copy
    from dataclasses import dataclass

    @dataclass
    class Tuned(ReferenceBackend):  # a dataclass with eq: unhashable
        knob: int = 1

    _direct(monkeypatch, True)
    attn = tiny_layer(1, backends=Tuned())
    cache = PagedKVCache(CFG, [1], num_blocks=64)
    with torch.no_grad():
        for n in (5, 1):
            attn(tiny_x(n, seed=n), cache.plan_step([StepRequest("a", n)]))
    assert len(attn._selection_memo) == 1  # the prefill's selection, reused by the decode
    reference = tiny_layer(2)
    with torch.no_grad():
        reference(tiny_x(3, seed=0), PagedKVCache(CFG, [2], num_blocks=64).plan_step([StepRequest("a", 3)]))
    twin = copy.deepcopy(reference)
    assert twin._selection_memo == {}  # rebuilt on the copy's first forward, with the registry's own backends
    with torch.no_grad():
        twin(tiny_x(3, seed=0), PagedKVCache(CFG, [2], num_blocks=64).plan_step([StepRequest("a", 3)]))
    (direct,) = twin._selection_memo.values()
    assert all(impl is get_registry().get("reference") for impl in direct.chosen.values())


@torch.no_grad()
def test_selection_under_graph_capture_takes_only_capturable_backends(monkeypatch):
    """While a CUDA graph is captured (``dispatch.capturing``, asked once a forward) the request says so and a backend whose
    capabilities are not graph-safe (the reference: it syncs) is refused before any write; the memo keys
    on it, so the eager selection made before is not reused and the eager one after still runs."""
    import dsv4.layer as layer_module

    attn = tiny_layer(2)
    cache = PagedKVCache(CFG, [2], num_blocks=64)
    attn(tiny_x(3, seed=0), cache.plan_step([StepRequest("a", 3)]))
    monkeypatch.setattr("dsv4.ops.dispatch.capturing", lambda device: True)
    monkeypatch.setattr(layer_module, "capturing_on", lambda device: True)
    step = cache.plan_step([StepRequest("a", 1)])
    before = snapshot(cache)
    with pytest.raises(DSV4Error, match="not capturable under CUDA graphs"):
        attn(tiny_x(1, seed=1), step)
    assert same_bytes(before, snapshot(cache))
    monkeypatch.undo()
    attn(tiny_x(1, seed=1), step)
