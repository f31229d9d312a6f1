"""dsv4.batch_invariant: float64 products give every row the same bits whatever the batch."""
import torch
from dsv4.batch_invariant import grouped_linear, linear


def test_float64_rows_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(384, 200, generator=g, dtype=torch.float64)
    x = torch.randn(70, 200, generator=g, dtype=torch.float64)
    full = linear(x, w)
    for start, size in ((0, 1), (3, 2), (10, 33), (69, 1)):
        assert torch.equal(linear(x[start:start + size], w), full[start:start + size])
    assert torch.allclose(full, x @ w.t(), rtol=1e-12, atol=1e-12)


def test_grouped_linear_matches_einsum_and_is_invariant():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, 3, 64, generator=g, dtype=torch.float64)
    w = torch.randn(3, 16, 64, generator=g, dtype=torch.float64)
    full = grouped_linear(x, w)
    assert torch.allclose(full, torch.einsum("tgk,gnk->tgn", x, w), rtol=1e-12, atol=1e-12)
    assert torch.equal(grouped_linear(x[4:5], w), full[4:5])
    assert torch.equal(grouped_linear(x.float(), w.float()), torch.einsum("tgk,gnk->tgn", x.float(), w.float()))
