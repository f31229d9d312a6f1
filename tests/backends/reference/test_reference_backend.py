"""The reference backend: registered through its entry point, available on CPU, thin over dsv4.reference."""
from __future__ import annotations

import torch
from dsv4.backend import OP_NAMES, OpRequest
from dsv4.backends.reference import ReferenceBackend
from dsv4.conformance.cases import Case, execute, prepare, private_copy
from dsv4.registry import Registry


def test_registered_through_the_entry_point():
    registry = Registry()
    statuses = {s.name: s for s in registry.load_entry_points()}
    assert statuses["reference"].state == "loaded" and statuses["reference"].backends == ["reference"]
    backend = registry.get("reference")
    assert isinstance(backend, ReferenceBackend) and registry.probe("reference") == []


def test_supports_every_op_format_and_profile():
    backend = ReferenceBackend()
    assert backend.capabilities.ops == frozenset(OP_NAMES)
    for fmt in ("fp8_ds_mla", "bf16", "ascend_a5"):
        for profile in ("deepseek", "vllm", "ascend"):
            request = OpRequest("sparse_attention", device_type="cpu", dtype=torch.float64, kv_format=fmt,
                                heads=7, topk=13, profile=profile, has_sink=True, needs_lse=True)
            assert backend.not_supported_reasons(request) == []
    assert backend.not_supported_reasons(OpRequest("sparse_attention", dtype=torch.int8))


def test_wrappers_pass_every_argument_through():
    from dsv4 import reference

    prepared = prepare(Case("compress_insert", "csa", "vllm", "indexer_fp8", "indexer-multi-step"))
    assert [kw["windows_in_call"] for _, kw in prepared.steps] == [True, False]  # the fresh first step's promise
    mine = execute(private_copy(prepared), ReferenceBackend().compress_insert)
    theirs = execute(private_copy(prepared), reference.compress_insert)
    for name in mine:
        assert torch.equal(mine[name].view(torch.uint8), theirs[name].view(torch.uint8))
    assert not torch.isnan(mine["state_cache"]).all()
