"""Random sparse-attention inputs over paged caches, shared by the vendor-backend tests.

Fresh random data on every call (no fixed seed): rows written through our codec at random
slots, per-token index rows of distinct global slots with random lengths, -1 holes inside the
read range and live (but unread) slots past it, so a table builder that reads past ``lens`` or
mistakes -1 fails the comparison with ``dsv4.reference.sparse_attention``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from dsv4.codecs import get_codec

SOFTMAX_SCALE = 512 ** -0.5


@dataclass
class SparseCase:
    q: torch.Tensor
    swa_cache: torch.Tensor
    swa_indices: torch.Tensor
    swa_lens: torch.Tensor
    extra_cache: torch.Tensor | None
    extra_indices: torch.Tensor | None
    extra_lens: torch.Tensor | None
    sink: torch.Tensor
    kv_format: str

    def args(self) -> tuple:
        return (self.q, self.swa_cache, self.swa_indices, self.swa_lens, self.extra_cache,
                self.extra_indices, self.extra_lens, self.sink)


def filled_cache(kv_format: str, num_blocks: int, block_size: int) -> torch.Tensor:
    """uint8 pages of ``kv_format`` with every slot written (random rows of random scale)."""
    codec = get_codec(kv_format)
    cache = codec.allocate(num_blocks, block_size, "cpu")
    slots = torch.arange(num_blocks * block_size, dtype=torch.int64)
    rows = torch.randn(slots.numel(), 512) * torch.rand(slots.numel(), 1) * 2
    codec.write_rows(cache, slots, rows)
    return cache


def _table(num_tokens: int, width: int, capacity: int, *, full_fraction: float = 0.3,
           holes: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    rows = torch.stack([torch.randperm(capacity)[:width] for _ in range(num_tokens)]).to(torch.int32)
    lens = torch.randint(0, width + 1, (num_tokens,), dtype=torch.int32)
    lens[torch.rand(num_tokens) < full_fraction] = width
    if num_tokens > 2:
        lens[0] = 0                        # an empty row
    if holes:
        rows[torch.rand(rows.shape) < 0.1] = -1
    # Columns past the used width of a row may hold -1 or stale slots; both must be ignored.
    stale = torch.rand(rows.shape) < 0.5
    cols = torch.arange(width)[None, :]
    rows = torch.where((cols >= lens[:, None]) & stale, torch.full_like(rows, -1), rows)
    return rows.contiguous(), lens


def make_case(*, num_tokens: int, heads: int, kv_format: str = "fp8_ds_mla", swa_block: int = 64,
              swa_width: int = 128, extra_block: int | None = None, extra_width: int = 0,
              num_blocks: int = 5, holes: bool = True) -> SparseCase:
    """A case; ``extra_block=None`` means an SWA-only layer (no compressed cache)."""
    swa_cache = filled_cache(kv_format, num_blocks, swa_block)
    swa_indices, swa_lens = _table(num_tokens, swa_width, num_blocks * swa_block, holes=holes)
    extra_cache = extra_indices = extra_lens = None
    if extra_block is not None:
        extra_blocks = max(num_blocks, -(-extra_width // extra_block) + 2)
        extra_cache = filled_cache(kv_format, extra_blocks, extra_block)
        extra_indices, extra_lens = _table(num_tokens, extra_width, extra_blocks * extra_block, holes=holes)
    q = (torch.randn(num_tokens, heads, 512) * 3).to(torch.bfloat16)
    sink = torch.randn(heads) * 2
    sink[torch.rand(heads) < 0.2] = float("-inf")
    return SparseCase(q, swa_cache, swa_indices, swa_lens, extra_cache, extra_indices, extra_lens,
                      sink.float(), kv_format)


def reference(case: SparseCase, profile: str = "vllm", ideal: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference on the case; ``ideal``: the float64 ideal (q and sink in float64, SPEC §13)."""
    from dsv4.reference import sparse_attention

    args = list(case.args())
    if ideal:
        args[0], args[7] = args[0].double(), args[7].double()
    return sparse_attention(*args, kv_format=case.kv_format, softmax_scale=SOFTMAX_SCALE, profile=profile)


def assert_attention_close(out: torch.Tensor, lse: torch.Tensor | None, case: SparseCase,
                           profile: str = "vllm") -> None:
    """The conformance suite's sparse-attention rule (SPEC §13) against the float64 reference."""
    from dsv4.conformance.metrics import compare_tensor
    from dsv4.conformance.tolerances import tolerance_for

    ref_out, ref_lse = reference(case, profile)
    assert out.shape == ref_out.shape and out.dtype == case.q.dtype
    verdict = compare_tensor(out, ref_out, tolerance_for("sparse_attention", "out", profile))
    assert verdict["passed"], verdict
    if lse is not None:
        verdict = compare_tensor(lse, ref_lse, tolerance_for("sparse_attention", "lse", profile))
        assert verdict["passed"], verdict
