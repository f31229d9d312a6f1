"""output_projection (SPEC §3 steps 6-7, §8) vs dsv4.reference."""
from __future__ import annotations

import pytest
import torch
from _triton_helpers import assert_close, cos_sin_table
from dsv4 import reference
from dsv4.backends.triton import TritonBackend


@pytest.mark.parametrize("fp8_activations", [False, True])
@pytest.mark.parametrize("heads,groups", [(8, 1), (16, 2)])
def test_matches_reference(fp8_activations: bool, heads: int, groups: int) -> None:
    num_tokens, o_lora, hidden = 5, 64, 96
    o = torch.randn(num_tokens, heads, 512).to(torch.bfloat16)
    positions = torch.randint(0, 2000, (num_tokens,), dtype=torch.int64)
    cos_sin = cos_sin_table(2048)
    width = heads // groups * 512
    wo_a = (torch.randn(groups * o_lora, width) * width ** -0.5).to(torch.bfloat16)
    wo_b = (torch.randn(hidden, groups * o_lora) * (groups * o_lora) ** -0.5).to(torch.bfloat16)
    out = TritonBackend().output_projection(o, positions, cos_sin, wo_a, wo_b, fp8_activations=fp8_activations)
    ref = reference.output_projection(o, positions, cos_sin, wo_a, wo_b, fp8_activations=fp8_activations)
    assert out.shape == (num_tokens, hidden) and out.dtype == torch.bfloat16
    assert_close("out", out, ref, "output_projection", "out")
