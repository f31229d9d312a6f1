"""The layer on the Triton backend (interpreter): its direct path (dsv4.layer_dispatch, with the fused
top-k -> global slots launch) writes and returns the same bits as the path through dsv4.ops."""
import pytest
import torch
from dsv4 import Attention, ModelConfig, PagedKVCache, StepRequest, layer_dispatch

CFG = ModelConfig.preset("tiny")  # 1 CSA, 2 HCA


@torch.no_grad()
def _run(layer_id: int) -> tuple[list[torch.Tensor], dict]:
    attn = Attention(CFG, layer_id, backends="triton")
    attn.reset_parameters(torch.Generator().manual_seed(0))
    cache = PagedKVCache(CFG, [layer_id], num_blocks=64)
    outs = []
    for seed, sizes in enumerate(([9, 5], [1, 1])):  # two prefills, then a decode of each
        step = cache.plan_step([StepRequest(f"r{i}", n) for i, n in enumerate(sizes)])
        x = torch.randn(sum(sizes), CFG.hidden_size, generator=torch.Generator().manual_seed(seed)).bfloat16()
        outs.append(attn(x, step))
    return outs, {name: t.clone() for name, t in cache.layer(layer_id).tensors().items()}


@pytest.mark.parametrize("layer_id", [1, 2])
def test_direct_path_equals_the_ops_path(monkeypatch, layer_id):
    from dsv4.backends.triton import topk

    ref_outs, ref_cache = _run(layer_id)  # the CPU value-checks: through dsv4.ops
    fused = []
    real = topk.local_to_global
    monkeypatch.setattr(topk, "local_to_global", lambda *a: fused.append(1) or real(*a))
    monkeypatch.setattr(layer_dispatch, "device_value_checks", lambda device: False)
    outs, cache = _run(layer_id)
    assert len(fused) == (2 if layer_id == 1 else 0)  # CSA: the fused conversion ran each step
    assert all(torch.equal(a, b) for a, b in zip(outs, ref_outs, strict=True))
    assert all(torch.equal(cache[k].view(torch.uint8), ref_cache[k].view(torch.uint8)) for k in ref_cache)
