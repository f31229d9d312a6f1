"""Shared generators for codec tests: rows with zero, NaN, Inf, tiny and huge blocks; page sizes."""
import torch
from dsv4.specs import ModelConfig, cache_geometry
from hypothesis import strategies as st

BLOCK_KINDS = ("normal", "zero", "nan", "inf", "tiny", "huge")


def make_rows(seed: int, kinds: list[str], row_dim: int, block: int = 32) -> torch.Tensor:
    """``[len(kinds), row_dim]`` fp32; row i has one block of kind ``kinds[i]``, the rest normal."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(len(kinds), row_dim, generator=gen) * torch.exp(torch.randn(len(kinds), 1, generator=gen) * 2)
    for i, kind in enumerate(kinds):
        start = int(torch.randint(0, row_dim // block, (1,), generator=gen)) * block
        part = rows[i, start: start + block]
        if kind == "zero":
            part.zero_()
        elif kind == "nan":
            part[0] = float("nan")
        elif kind == "inf":
            part[1] = float("inf") if i % 2 else float("-inf")
        elif kind == "tiny":
            part.mul_(1e-9)
        elif kind == "huge":
            part.mul_(1e30)
    return rows


rows_cases = st.tuples(st.integers(0, 2**31 - 1), st.lists(st.sampled_from(BLOCK_KINDS), min_size=1, max_size=12))


def page_sizes(formats: tuple[str, ...]) -> list[tuple[str, int, int]]:
    """Every (format, tokens a page, page bytes) that the geometries produce for these formats."""
    cfg = ModelConfig.preset("tiny")
    found = set()
    for profile, geometry, blocks in (("deepseek", "vllm", (None,)), ("vllm", "vllm", (None,)),
                                      ("ascend", "ascend", (32, 64, 128)), ("ascend", "ascend-a5", (32, 64, 128))):
        for block in blocks:
            for kv in (None, "fp8_ds_mla"):
                geo = cache_geometry(cfg, profile, geometry, block_size=block, kv_format=kv)
                for group in geo.groups:
                    if group.format in formats:
                        found.add((group.format, group.entries_per_page, group.page_bytes))
    return sorted(found)
