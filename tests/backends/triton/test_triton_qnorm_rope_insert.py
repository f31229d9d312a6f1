"""qnorm_rope_insert (SPEC §3 steps 2-3) vs dsv4.reference under the Triton interpreter."""
from __future__ import annotations

import pytest
import torch
from _triton_helpers import assert_cache_equivalent, assert_close, cos_sin_table, poisoned_like
from dsv4 import reference
from dsv4.backends.triton import TritonBackend
from dsv4.codecs import get_codec
from dsv4.specs.errors import DSV4TypeError


@pytest.mark.parametrize("kv_format", ["fp8_ds_mla", "bf16"])
@pytest.mark.parametrize("profile", ["deepseek", "vllm"])
def test_matches_reference(kv_format: str, profile: str) -> None:
    num_tokens, heads, block_size, num_blocks = 5, 12, 16, 3
    q = (torch.randn(num_tokens, heads, 512) * 2).to(torch.bfloat16)
    kv = torch.randn(num_tokens, 512).to(torch.bfloat16)
    kv[1, :64] *= 1e-6  # a near-zero FP8 block (amax floor)
    positions = torch.randint(0, 4000, (num_tokens,), dtype=torch.int64)
    cos_sin = cos_sin_table(4096)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens].to(torch.int64)
    slots[2] = -1  # SPEC §10: skip
    cache = poisoned_like(get_codec(kv_format).allocate(num_blocks, block_size))
    expected_cache = cache.clone()

    q_out = TritonBackend().qnorm_rope_insert(q, kv, positions, cos_sin, cache, slots, kv_format=kv_format,
                                              eps=1e-6, profile=profile)
    q_ref = reference.qnorm_rope_insert(q, kv, positions, cos_sin, expected_cache, slots, kv_format=kv_format,
                                        eps=1e-6, profile=profile)
    assert_close("q_out", q_out, q_ref, "qnorm_rope_insert", "q_out")
    # Same poison outside the written rows, so a stray write shows as a byte difference there.
    written = slots[slots >= 0]
    assert_cache_equivalent("swa_cache", kv_format, cache, expected_cache, written)
    mismatch = cache.view(torch.uint8).flatten() != expected_cache.view(torch.uint8).flatten()
    assert mismatch.float().mean().item() < 0.01


def test_rejects_int32_positions() -> None:
    cache = get_codec("fp8_ds_mla").allocate(1, 16)
    before = cache.clone()
    q = torch.randn(2, 4, 512).to(torch.bfloat16)
    kv = torch.randn(2, 512).to(torch.bfloat16)
    with pytest.raises(DSV4TypeError, match="positions"):
        TritonBackend().qnorm_rope_insert(q, kv, torch.zeros(2, dtype=torch.int32), cos_sin_table(8), cache,
                                          torch.zeros(2, dtype=torch.int64), kv_format="fp8_ds_mla", eps=1e-6)
    assert torch.equal(cache, before)
