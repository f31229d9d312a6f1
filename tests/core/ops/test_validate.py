"""dsv4.ops value-range checks (SPEC §10, §12): every index-like argument, both backends, nothing written;
the switch that keeps them off accelerators unless asked for."""
from __future__ import annotations

import pytest
import torch
from dsv4 import ops, reference
from dsv4.backends.reference import ReferenceBackend
from dsv4.codecs import get_codec
from dsv4.conformance.cases import Case, execute, prepare, private_copy
from dsv4.conformance.golden import expected_outputs
from dsv4.conformance.runner import compare_outputs
from dsv4.ops import validate
from dsv4.specs.errors import DSV4Error, DSV4ValueError

_CASES = {
    "qnorm_rope_insert": Case("qnorm_rope_insert", "swa", "deepseek", "fp8_ds_mla", "mixed"),
    "compress_insert": Case("compress_insert", "csa", "deepseek", "fp8_ds_mla", "multi-step"),
    "indexer_q": Case("indexer_q", "csa", "deepseek", "-", "mixed"),
    "indexer_topk": Case("indexer_topk", "csa", "deepseek", "indexer_mxfp4", "mixed"),
    "sparse_attention": Case("sparse_attention", "csa", "deepseek", "fp8_ds_mla", "prefill"),
    "output_projection": Case("output_projection", "swa", "-", "-", "bf16"),
}


def _capacity(fmt: str, cache: torch.Tensor) -> int:
    return cache.shape[0] * get_codec(fmt).block_size_of(cache)


def _set(index: int, row: tuple | int, value):
    """A mutation: a copy of argument ``index`` with ``value`` (a function of the args) at ``row``."""
    def mutate(args, kwargs):
        t = args[index].clone()
        t[row] = value(args, kwargs) if callable(value) else value
        return args[:index] + (t,) + args[index + 1:]
    return mutate


def _at_first_read(indices: int, lens: int, value):
    """A mutation of entry 0 of the first token whose list reads at least one entry."""
    def mutate(args, kwargs):
        t = args[indices].clone()
        t[int((args[lens] > 0).nonzero()[0, 0]), 0] = value(args, kwargs)
        return args[:indices] + (t,) + args[indices + 1:]
    return mutate


def _drop_state_page(args, kwargs):
    """Unmap the state page of the first position a closing block reads (its window start)."""
    positions, token_request, table, out_slots = args[1], args[2], args[4], args[10]
    closing = int((out_slots >= 0).nonzero()[0, 0])
    table = table.clone()
    table[int(token_request[closing]), 0] = -1  # position 0 is in the first closing block's window
    assert int(positions[closing]) < 2 * kwargs["ratio"]
    return args[:4] + (table,) + args[5:]


# (op, argument named in the error, mutation of steps[0]'s args)
_BAD = [
    ("qnorm_rope_insert", "swa_slot_mapping", _set(5, 0, lambda a, k: _capacity(k["kv_format"], a[4]))),
    ("qnorm_rope_insert", "swa_slot_mapping", _set(5, 1, -2)),
    ("qnorm_rope_insert", "positions", _set(2, 0, lambda a, k: a[3].shape[0])),
    ("qnorm_rope_insert", "positions", _set(2, 0, -1)),
    ("compress_insert", "positions", _set(1, 0, lambda a, k: a[8].shape[0])),
    ("compress_insert", "token_request", _set(2, 0, lambda a, k: a[4].shape[0])),
    ("compress_insert", "state_block_table", _set(4, (0, 0), lambda a, k: a[3].shape[0])),
    ("compress_insert", "state_block_table", _drop_state_page),
    ("compress_insert", "state_slot_mapping", _set(5, 0, lambda a, k: a[3].shape[0] * a[3].shape[1])),
    ("compress_insert", "state_slot_mapping", _set(5, 0, 10 ** 6)),
    ("compress_insert", "out_slot_mapping", _set(10, 0, lambda a, k: _capacity(k["out_format"], a[9]))),
    ("compress_insert", "out_slot_mapping", _set(10, 0, 0)),  # position 0 closes no block
    ("indexer_q", "positions", _set(2, 0, lambda a, k: a[3].shape[0])),
    ("indexer_topk", "positions", _set(2, 0, -1)),
    ("indexer_topk", "token_request", _set(3, 0, lambda a, k: a[5].shape[0])),
    ("indexer_topk", "key_block_table", _set(5, (0, 0), lambda a, k: a[4].shape[0])),
    ("indexer_topk", "key_block_table", lambda a, k: a[:5] + (a[5][:, :1].contiguous(),) + a[6:]),  # too narrow
    ("indexer_topk", "key_block_table", _set(5, (2, 3), -1)),  # a page that entries token 14 sees lack
    ("sparse_attention", "swa_indices", _at_first_read(2, 3, lambda a, k: _capacity(k["kv_format"], a[1]))),
    ("sparse_attention", "swa_indices", _at_first_read(2, 3, lambda a, k: -2)),
    ("sparse_attention", "swa_lens", _set(3, 0, lambda a, k: a[2].shape[1] + 1)),
    ("sparse_attention", "swa_lens", _set(3, 0, -1)),
    ("sparse_attention", "extra_indices", _at_first_read(5, 6, lambda a, k: _capacity(k["kv_format"], a[4]))),
    ("sparse_attention", "extra_lens", _set(6, 0, lambda a, k: a[5].shape[1] + 1)),
    ("output_projection", "positions", _set(1, 0, lambda a, k: a[2].shape[0])),
]
_IDS = [f"{op}-{name}-{i}" for i, (op, name, _) in enumerate(_BAD)]


def _bad_call(op: str, mutate):
    prepared = prepare(_CASES[op])
    args, kwargs = prepared.steps[0]
    bad = mutate(args, kwargs)
    before = [a.clone() if isinstance(a, torch.Tensor) else a for a in bad]
    return bad, kwargs, before


def _assert_unchanged(after, before):
    for a, b in zip(after, before):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # bytes: NaN poison compares too


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize(("op", "name", "mutate"), _BAD, ids=_IDS)
def test_out_of_range_is_rejected_before_anything_is_written(op, name, mutate, backend):
    args, kwargs, before = _bad_call(op, mutate)
    with pytest.raises(DSV4ValueError, match=f"^{name}: expected .*, got ") as info:
        getattr(ops, op)(*args, **kwargs, backend=backend)
    assert info.value.argument == name
    _assert_unchanged(args, before)


@pytest.mark.parametrize(("op", "name", "mutate"), _BAD, ids=_IDS)
def test_reference_gives_the_same_error(op, name, mutate):
    """The reference runs the same checks (moved to dsv4.ops.validate), with the same message, except
    block-table page ids, which only the boundary checks (the reference indexes with them)."""
    args, kwargs, before = _bad_call(op, mutate)
    with pytest.raises(DSV4ValueError) as boundary:
        getattr(ops, op)(*args, **kwargs, backend="reference")
    if name.endswith("block_table") and ("page ids" in str(boundary.value) or "sees" in str(boundary.value)):
        return  # the reference reads only the pages it scores (SPEC §6.3's shortcut reads none)
    with pytest.raises(DSV4ValueError) as direct:
        getattr(reference, op)(*args, **kwargs)
    assert str(direct.value) == str(boundary.value)
    _assert_unchanged(args, before)


@pytest.mark.parametrize("op", list(_CASES))
def test_in_range_triton_call_matches_the_reference(op):
    prepared = prepare(_CASES[op])
    run = private_copy(prepared)
    actual = execute(run, lambda *a, **k: getattr(ops, op)(*a, **k, backend="triton"))
    metrics = compare_outputs(run, actual, expected_outputs(prepared))
    assert all(m.get("passed") is not False for m in metrics.values()), metrics


def test_messages_name_expected_and_received():
    args, kwargs, _ = _bad_call("qnorm_rope_insert", _BAD[0][2])
    capacity = _capacity(kwargs["kv_format"], args[4])
    with pytest.raises(DSV4ValueError, match=rf"swa_slot_mapping: expected -1 or values in \[0, {capacity}\), "
                                             rf"got \[{capacity}\] \(first offenders\)"):
        ops.qnorm_rope_insert(*args, **kwargs, backend="triton")
    args, kwargs, _ = _bad_call("indexer_topk", _BAD[15][2])  # page ids past the cache
    with pytest.raises(DSV4ValueError, match=r"key_block_table: expected -1 or page ids in \[0, \d+\)"):
        ops.indexer_topk(*args, **kwargs, backend="triton")


# -- the switch -------------------------------------------------------------------------------------
@pytest.fixture
def switch(monkeypatch):
    monkeypatch.delenv(validate.VALIDATE_ENV, raising=False)
    validate._env_enabled.cache_clear()
    yield
    validate.set_value_checks(None)
    validate._env_enabled.cache_clear()


def test_device_switch(switch, monkeypatch):
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert validate.device_value_checks(cpu) and not validate.device_value_checks(gpu)
    validate.set_value_checks(True)
    assert validate.device_value_checks(gpu)
    validate.set_value_checks(False)
    assert validate.device_value_checks(cpu) and not validate.device_value_checks(gpu)  # the CPU: always
    validate.set_value_checks(None)
    monkeypatch.setenv(validate.VALIDATE_ENV, "1")
    assert not validate.device_value_checks(gpu)  # the environment is read once
    validate._env_enabled.cache_clear()
    assert validate.device_value_checks(gpu)
    assert not validate.value_checks_enabled(torch.empty(1, device="meta"))


class _Spy(ReferenceBackend):
    name = "spy"

    def __init__(self):
        super().__init__()
        self.calls = 0

    def qnorm_rope_insert(self, q, *args, **kwargs):
        self.calls += 1
        return q.clone()


def test_no_value_check_on_an_accelerator_unless_switched_on(switch, monkeypatch):
    # simulate an accelerator: the ops ask the device part of the predicate about a "cuda" tensor
    monkeypatch.setattr(ops, "value_checks_enabled", lambda t: validate.device_value_checks(torch.device("cuda")))
    args, kwargs, _ = _bad_call("qnorm_rope_insert", _BAD[0][2])
    spy = _Spy()
    ops.qnorm_rope_insert(*args, **kwargs, backend=spy)
    assert spy.calls == 1  # off: the out-of-range slot reached the backend unchecked (no sync)
    validate.set_value_checks(True)
    with pytest.raises(DSV4ValueError, match="^swa_slot_mapping: "):
        ops.qnorm_rope_insert(*args, **kwargs, backend=spy)
    assert spy.calls == 1


def test_fake_tensors_are_not_read():
    args, kwargs, _ = _bad_call("qnorm_rope_insert", _BAD[0][2])
    gm = torch.fx.experimental.proxy_tensor.make_fx(
        lambda *a: ops.qnorm_rope_insert(*a, **kwargs, backend="reference"), tracing_mode="fake")(*args)
    assert "dsv4.qnorm_rope_insert" in str(gm.graph)


def test_unknown_cache_layout_is_left_to_the_backend():
    assert validate.cache_capacity("fp8_ds_mla", torch.zeros(2, 3, dtype=torch.uint8)) is None
    assert validate.cache_capacity("no_such_format", torch.zeros(2, 3)) is None
    prepared = prepare(_CASES["qnorm_rope_insert"])
    (q, kv, positions, cos_sin, cache, slots), kwargs = prepared.steps[0]
    with pytest.raises(DSV4Error, match="cache"):
        ops.qnorm_rope_insert(q, kv, positions, cos_sin, cache[:, :7], slots, **kwargs, backend="reference")


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("width", [0, 1])
def test_a_key_table_too_narrow_for_the_shortcut_is_rejected(backend, width):
    """SPEC §6.3: a token that sees <= topk entries takes them all; the reference takes them without reading
    a key, a kernel bounded by the table returned fewer (16 or 0 of 25): every visible entry needs its page."""
    codec = get_codec("indexer_mxfp4")
    cache = codec.allocate(2, 16)
    q, w = torch.randn(1, 64, 128).to(torch.bfloat16), torch.randn(1, 64)
    positions, token_request = torch.tensor([99]), torch.tensor([0], dtype=torch.int32)  # 25 entries visible
    table = torch.zeros((1, width), dtype=torch.int32)
    with pytest.raises(DSV4ValueError, match=r"^key_block_table: expected at least 2 pages a row .* got shape"):
        ops.indexer_topk(q, w, positions, token_request, cache, table, topk=32, key_format="indexer_mxfp4",
                         backend=backend)
    wide = ops.indexer_topk(q, w, positions, token_request, cache, torch.tensor([[0, 1]], dtype=torch.int32),
                            topk=32, key_format="indexer_mxfp4", backend=backend)
    assert sorted(wide[0, :25].tolist()) == list(range(25)) and wide[0, 25:].tolist() == [-1] * 7  # order: free


@pytest.mark.parametrize("ratio", [0, -1, 4.0])
def test_indexer_topk_names_a_ratio_that_is_not_a_positive_int(ratio):
    """The boundary checks ``ratio`` before the key-page check divides by it (a ZeroDivisionError before)."""
    codec = get_codec("indexer_mxfp4")
    q, w = torch.randn(1, 64, 128).to(torch.bfloat16), torch.randn(1, 64)
    with pytest.raises(DSV4ValueError, match=f"^ratio: expected a positive int, got {ratio}"):
        ops.indexer_topk(q, w, torch.tensor([99]), torch.tensor([0], dtype=torch.int32), codec.allocate(2, 16),
                         torch.tensor([[0, 1]], dtype=torch.int32), topk=32, key_format="indexer_mxfp4", ratio=ratio)
