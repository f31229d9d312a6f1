"""A backend may change only the caches its op writes: an input edited in place fails the row by name, and no
check reads what the backend left in its arguments."""
from __future__ import annotations

import torch
from _wrong_backends import registry_of
from dsv4.backends.reference import ReferenceBackend
from dsv4.conformance.cases import default_cases, prepare, select_cases
from dsv4.conformance.golden import GoldenStore
from dsv4.conformance.input_guard import InputGuard
from dsv4.conformance.placement import place_far
from dsv4.conformance.runner import run_case, run_differential


class PositionsZeroed(ReferenceBackend):
    """Zeroes ``positions`` in place and returns no entry: with positions 0 nothing is visible, so a check
    that read the argument after the call would find all -1 right."""

    name = "positions-zeroed"

    def indexer_topk(self, q, w, positions, token_request, key_cache, key_block_table, *, topk, key_format,
                     ratio=4):
        positions.zero_()
        return torch.full((q.shape[0], topk), -1, dtype=torch.int32, device=q.device)


class ReadCacheEdited(ReferenceBackend):
    """Sparse attention that writes into the SWA cache it only reads, on the far run only (caches > 1 GiB)."""

    name = "read-cache-edited"

    def sparse_attention(self, q, swa_cache, *args, **kwargs):
        result = super().sparse_attention(q, swa_cache, *args, **kwargs)
        if swa_cache.numel() * swa_cache.element_size() > 2**30:
            swa_cache[-1].view(torch.uint8).fill_(0)
        return result


class ApeScaled(ReferenceBackend):
    name = "ape-scaled"

    def compress_insert(self, *args, **kwargs):
        super().compress_insert(*args, **kwargs)
        args[6].mul_(2)  # ape, shared by both steps


def _case(op, keyword):
    return select_cases(default_cases(), [op], keyword)[0]


def test_zeroed_positions_fail_by_name_and_the_topk_check_reads_the_untouched_ones():
    row = run_case(PositionsZeroed(), _case("indexer_topk", "vllm and mixed"), torch.device("cpu"), GoldenStore(),
                   far=False)
    assert row.outcome == "failed"
    assert row.metrics["inputs"]["modified"] == ["positions"] and "positions" in row.metrics["inputs"]["reason"]
    assert row.metrics["topk"]["passed"] is False  # scored on the positions as generated
    # the modified input leads the summary (it can be why the output is wrong), with no "max abs err - at None"
    assert row.summary() == ("indexer_topk.inputs: the backend modified its input positions (only the caches "
                             "the op writes may change)")


def test_a_read_only_cache_edited_on_the_far_run_fails_there():
    row = run_case(ReadCacheEdited(), _case("sparse_attention", "vllm and csa and fp8_ds_mla and decode"),
                   torch.device("cpu"), GoldenStore())
    assert "inputs" not in row.metrics and row.outcome == "failed"
    assert row.metrics["inputs@far"]["modified"] == ["swa_cache"]


def test_multi_step_inputs_are_named_with_their_step_and_differential_mode_guards_too():
    case = _case("compress_insert", "deepseek and hca")
    row = run_case(ApeScaled(), case, torch.device("cpu"), GoldenStore(), far=False)
    assert row.outcome == "failed" and row.metrics["inputs"]["modified"] == ["ape (step 0)"]
    reg = registry_of(ApeScaled())
    diff = run_differential("reference", "ape-scaled", [case], seed=1, registry=reg, far=False)
    assert diff.rows[0].metrics["inputs"]["modified"] == ["ape (step 0)"]
    flipped = run_differential("ape-scaled", "reference", [case], seed=1, registry=reg, far=False)
    assert flipped.rows[0].outcome == "failed"  # A's outputs are the expected values: A is guarded too
    assert flipped.rows[0].metrics["inputs_ape-scaled"]["modified"] == ["ape (step 0)"]


def test_the_far_guard_copies_the_case_pages_not_the_pad():
    far = place_far(prepare(_case("sparse_attention", "vllm and csa and fp8_ds_mla and decode")))
    guard = InputGuard(far)
    copied = sum(before.numel() * before.element_size() for _, _, before in guard._saved)
    assert 0 < copied < 2**20 and guard.modified() == []
    far.steps[0][0][2][0, 0] += 1  # swa_indices
    assert guard.modified() == ["swa_indices"]


def test_the_reference_modifies_no_input():
    for case in default_cases()[::5]:
        row = run_case(ReferenceBackend(), case, torch.device("cpu"), GoldenStore(), far=False)
        assert row.outcome == "passed" and "inputs" not in row.metrics, case.id
