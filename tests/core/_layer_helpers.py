"""The tiny test layer and its inputs, shared by the layer tests (test_layer, test_layer_checks,
test_layer_dispatch): one config, parameters and rows from fixed seeds."""
from __future__ import annotations

import torch
from dsv4 import Attention, ModelConfig

CFG = ModelConfig.preset("tiny")  # 0 SWA, 1 CSA, 2 HCA


def tiny_layer(layer_id: int, *, backends="reference", dtype: torch.dtype = torch.bfloat16, seed: int = 0,
               **kw) -> Attention:
    """Layer ``layer_id`` of the tiny config, parameters from ``seed``; ``dtype=torch.float64`` gives the ideal
    (``.double()``), any other dtype leaves the layer's own dtypes (activations set the compute dtype)."""
    attn = Attention(CFG, layer_id, backends=backends, **kw)
    attn.reset_parameters(torch.Generator().manual_seed(seed))
    return attn.double() if dtype == torch.float64 else attn


def tiny_x(n: int, *, seed: int = 1, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``[n, hidden]`` normal rows from ``seed`` in ``dtype``."""
    return torch.randn(n, CFG.hidden_size, generator=torch.Generator().manual_seed(seed)).to(dtype)


def snapshot(cache) -> dict:
    """A copy of every storage tensor of ``cache`` (``{(layer_id, name): tensor}``)."""
    return {(lid, name): t.clone() for lid, lc in cache.layers.items() for name, t in lc.tensors().items()}


def same_bytes(a: dict, b: dict) -> bool:
    """Two snapshots hold the same bytes (NaN bytes included)."""
    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)
