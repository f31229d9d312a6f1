"""sparse_tuning and the launcher that steps the sparse-attention kernel down to a shape the device takes
(``_common.FittingLaunch``): a device with less shared memory than the tuned shape needs (sm_100 for bf16
rows, sm_120, CDNA3) runs a smaller one instead of failing (tools/target_compile.py measures each target)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from dsv4.backends.triton import TritonBackend, sparse_tuning
from dsv4.backends.triton import sparse_attention as sa
from dsv4.backends.triton._common import FittingLaunch, facts_of
from dsv4.backends.triton.sparse_tuning import smaller_shapes
from dsv4.codecs import get_codec
from triton.runtime.errors import OutOfResources


@pytest.mark.parametrize(("props", "hip", "smem"), [
    (SimpleNamespace(major=9, minor=0, multi_processor_count=132, shared_memory_per_block_optin=232448), False, 232448),
    (SimpleNamespace(major=12, minor=0, multi_processor_count=188, shared_memory_per_block_optin=101376), False, 101376),
    (SimpleNamespace(major=9, minor=4, multi_processor_count=304, gcnArchName="gfx942:sramecc+:xnack-"), True, 65536),
    (SimpleNamespace(major=9, minor=5, multi_processor_count=256, gcnArchName="gfx950:sramecc+:xnack-"), True, 163840),
    (SimpleNamespace(major=8, minor=0, multi_processor_count=108), False, 49152),  # no opt-in field: the default
])
def test_shared_memory_fact(props, hip: bool, smem: int) -> None:
    """CUDA's opt-in limit as torch reports it; HIP reports none: 64 KiB of LDS, 160 KiB on gfx950."""
    assert facts_of(props, hip=hip).smem == smem


def test_smaller_shapes_order() -> None:
    """Fewer stages first (down to two), then half the keys a tile at two stages, then one stage; never the
    tuned shape itself, never a tile under 16 keys."""
    assert smaller_shapes(64, 5) == [(64, 4), (64, 3), (64, 2), (32, 2), (16, 2), (64, 1), (32, 1), (16, 1)]
    assert smaller_shapes(32, 3) == [(32, 2), (16, 2), (32, 1), (16, 1)]
    assert smaller_shapes(16, 1) == []


def _refusing(limit: int, calls: list):
    def launch(shape):
        calls.append(shape)
        if shape[0] * shape[1] > limit:
            raise OutOfResources(shape[0] * shape[1], limit, "shared memory")
        return shape
    return launch


def test_fitting_launch_steps_down_and_remembers() -> None:
    fit, calls, built = FittingLaunch(), [], []

    def shapes():
        built.append(1)
        return [(64, 5), *smaller_shapes(64, 5)]

    assert fit("k", shapes, _refusing(150, calls)) == (64, 2)
    assert calls == [(64, 5), (64, 4), (64, 3), (64, 2)]
    calls.clear()
    assert fit("k", shapes, _refusing(150, calls)) == (64, 2) and calls == [(64, 2)]  # straight to it
    assert len(built) == 1  # the list is built on a key's first call only (the hot path builds nothing)
    assert fit("other", shapes, _refusing(1000, calls)) == (64, 5)  # per key
    with pytest.raises(OutOfResources, match="shared memory, Required: 16, Hardware limit: 8"):
        fit("tiny", shapes, _refusing(8, calls))  # nothing fits: the last refusal
    with pytest.raises(ValueError, match="no launch shape"):
        FittingLaunch()("none", list, _refusing(8, calls))


def test_sparse_attention_takes_the_shape_the_device_takes(monkeypatch) -> None:
    """The wrapper off the interpreter: the default shape refused, the next ones tried with the split count
    and grid of each; a caller's block_keys / num_stages run as given (the refusal reaches the caller)."""
    calls = []

    class Kernel:
        def __getitem__(self, grid):
            def launch(*args, BN, num_stages, NUM_SPLITS, **kw):
                calls.append((BN, num_stages, grid))
                if BN * num_stages > 128:
                    raise OutOfResources(BN * num_stages * 1024, 128 * 1024, "shared memory")
                next(a for a in reversed(args) if isinstance(a, torch.Tensor) and a.dim() == 3).zero_()  # out
            return launch

    monkeypatch.setattr(sa, "INTERPRET", False)
    monkeypatch.setattr(sparse_tuning, "INTERPRET", False)  # the GPU's tuned shape: 64 keys, 5 stages
    monkeypatch.setattr(sa, "_sparse_attention_kernel", Kernel())
    monkeypatch.setattr(sa, "_FITTING", FittingLaunch())
    codec = get_codec("fp8_ds_mla")
    cache = codec.allocate(4, 16)
    codec.write_rows(cache, torch.arange(64), torch.randn(64, 512))
    q = torch.randn(2, 64, 512).to(torch.bfloat16)
    idx = torch.randint(0, 64, (2, 48), dtype=torch.int32)
    lens = torch.full((2,), 48, dtype=torch.int32)
    args = (q, cache, idx, lens, None, None, None, torch.zeros(64))
    kwargs = {"kv_format": "fp8_ds_mla", "softmax_scale": 0.05, "profile": "deepseek", "hopper": False}
    out, _ = TritonBackend().sparse_attention(*args, **kwargs)
    assert [c[:2] for c in calls] == [(64, 5), (64, 4), (64, 3), (64, 2)]
    assert out.abs().max() == 0
    calls.clear()
    TritonBackend().sparse_attention(*args, **kwargs)
    assert [c[:2] for c in calls] == [(64, 2)]
    calls.clear()
    with pytest.raises(OutOfResources):
        TritonBackend().sparse_attention(*args, num_stages=3, **kwargs)
    assert [c[:2] for c in calls] == [(64, 3)]
