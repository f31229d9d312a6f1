"""indexer_q's q may miss abs/rel on 0.5% of elements (quantization boundary flips), but each such element
only by one quantization step of the profile's format: a zeroed head fails."""
from __future__ import annotations

import pytest
from dsv4.backends.reference import ReferenceBackend
from dsv4.conformance.cases import Case, execute, prepare, private_copy
from dsv4.conformance.metrics import compare_tensor
from dsv4.conformance.runner import compare_outputs
from dsv4.conformance.tolerances import tolerance_for

PROFILES = ("deepseek", "vllm", "ascend")


def _outputs(profile):
    prepared = prepare(Case("indexer_q", "csa", profile, "-", "mixed"))
    return prepared, execute(private_copy(prepared), ReferenceBackend().indexer_q)


@pytest.mark.parametrize("profile", PROFILES)
def test_a_zeroed_head_fails(profile):
    prepared, expected = _outputs(profile)
    actual = {**expected, "q": expected["q"].clone()}
    actual["q"][0, 0] = 0  # token 0, head 0: 128 of 81920 elements, inside the 0.5% allowance
    q = compare_outputs(prepared, actual, expected)["q"]
    assert q["pass_fraction"] >= 0.995 and q["passed"] is False
    assert "of their block's amax (one quantization step)" in q["reason"]


@pytest.mark.parametrize("profile", PROFILES)
def test_one_step_passes_and_more_fails(profile):
    """The block's smallest element moved by 0.99 / 1.01 of the cap (well past abs/rel: it counts as failing)."""
    _, expected = _outputs(profile)
    tol = tolerance_for("indexer_q", "q", profile)
    e = expected["q"].double()
    block = e.flatten()[: tol.quant_block]
    smallest, amax = int(block.abs().argmin()), float(block.abs().max())
    assert tol.max_fail_of_block_amax * amax > 2 * tol.abs_tol

    def moved(fraction):
        a = e.clone().flatten()
        a[smallest] += fraction * tol.max_fail_of_block_amax * amax
        return a.view(e.shape)

    assert compare_tensor(moved(0.99), e, tol)["passed"] is True
    assert compare_tensor(moved(1.01), e, tol)["passed"] is False


def test_the_quantization_block_is_the_q_rules_not_the_key_formats():
    """The step cap's block is what one scale of the profile's q quantization covers (SPEC §6.6 q rule). Every
    SPEC profile stores keys with the same block; a profile that quantizes q in fp4 (per 32) with fp8 keys (one
    scale per 128-vector) gets the q block."""
    from dsv4.conformance.tolerances import _indexer_q_step
    from dsv4.specs.formats import get_format
    from dsv4.specs.numerics import get_profile

    for profile in PROFILES:
        numerics, tol = get_profile(profile), tolerance_for("indexer_q", "q", profile)
        key = get_format(numerics.indexer_key_format)
        assert tol.quant_block == numerics.indexer_q_block(128) == getattr(key, "quant_block", key.row_dim)
    mixed = get_profile("vllm").model_copy(update={"name": "fp4-q-fp8-keys", "indexer_quant": "fp4"})
    assert get_format(mixed.indexer_key_format).row_dim == 128 and not hasattr(get_format("indexer_fp8"),
                                                                                "quant_block")
    tol = _indexer_q_step(mixed)
    assert tol.quant_block == 32 and tol.max_fail_of_block_amax == 2 / 3
    assert _indexer_q_step(get_profile("deepseek").model_copy(update={"indexer_quant": "fp8"})).quant_block == 128
