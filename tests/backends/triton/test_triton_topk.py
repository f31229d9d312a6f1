"""Triton top-k selection (backends/triton/topk.py) vs an exact CPU top-k, under the interpreter."""
from __future__ import annotations

import torch


def test_topk_indices_exact() -> None:
    """The Triton select returns an exact top-k of its logits (ties, -inf, short rows, all-equal rows)."""
    from dsv4.backends.triton.topk import topk_indices

    n, k = 600, 40
    logits = torch.randn(7, n)
    logits[1, 100:] = float("-inf")
    logits[2] = torch.randint(0, 3, (n,)).float()  # heavy ties across the k-th value
    logits[3] = 2.0
    logits[4, 30:] = float("-inf")  # fewer valid entries than k
    logits[5] = float("-inf")
    logits[6, ::2] = float("-inf")
    for kwargs in ({"chunk": 64, "candidates": 64}, {"chunk": 128, "candidates": 16, "ways": 4}):
        out = topk_indices(logits, k, **kwargs)
        assert out.shape == (7, k) and out.dtype == torch.int32
        for t in range(7):
            finite = torch.isfinite(logits[t])
            nv = min(k, int(finite.sum()))
            row = out[t]
            assert torch.all(row[:nv] >= 0) and torch.all(row[nv:] == -1)
            sel = row[:nv].long()
            assert sel.unique().numel() == nv and torch.all(finite[sel])
            if nv:
                kth = logits[t][finite].sort(descending=True).values[nv - 1]
                assert torch.all(logits[t][sel] >= kth)
