"""Shared fixtures-as-functions of the Triton tests: random caches, tables and comparisons."""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import sys

import torch
from dsv4.codecs import get_codec
from dsv4.conformance.tolerances import tolerance_for

ROPE_DIM = 64


def cos_sin_table(num_positions: int, theta: float = 10000.0) -> torch.Tensor:
    """fp32 [P, 64] rows [cos_0..31 | sin_0..31] (SPEC §4), plain RoPE."""
    inv = theta ** (-torch.arange(0, ROPE_DIM, 2, dtype=torch.float64) / ROPE_DIM)
    angles = torch.arange(num_positions, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=1).float()


def assert_close(name: str, actual: torch.Tensor, expected: torch.Tensor, op: str, output: str,
                 abs_tol: float | None = None, rel_tol: float | None = None, cos_diff: float | None = None,
                 min_pass_fraction: float | None = None, profile: str | None = None) -> None:
    """Element rule |a-e| <= abs or <= rel*|e|, plus the pass fraction and cosine bound. The numbers are
    the suite's (``tolerance_for(op, output, profile)``) wherever it has them: passing any here for such
    an output is an error, so no check keeps a second copy. Outputs the suite does not cover (tool-only
    comparisons) must pass ``abs_tol`` and ``rel_tol``."""
    given = {k: v for k, v in {"abs_tol": abs_tol, "rel_tol": rel_tol, "cos_diff": cos_diff,
                               "min_pass_fraction": min_pass_fraction}.items() if v is not None}
    try:
        tol = tolerance_for(op, output, profile)
    except KeyError:
        tol = None
    if tol is not None:
        if given:
            raise ValueError(f"{op}/{output}: the suite owns its tolerance; do not pass {sorted(given)}")
        abs_tol, rel_tol, cos_diff, min_pass_fraction = tol.abs_tol, tol.rel_tol, tol.cos_diff, tol.min_pass_fraction
    elif abs_tol is None or rel_tol is None:
        raise ValueError(f"{op}/{output}: no suite tolerance; pass abs_tol and rel_tol")
    min_pass_fraction = 1.0 if min_pass_fraction is None else min_pass_fraction
    a, e = actual.double(), expected.double()
    assert torch.equal(torch.isfinite(a), torch.isfinite(e)), f"{name}: non-finite positions differ"
    finite = torch.isfinite(e)
    assert torch.equal(a[~finite], e[~finite]), f"{name}: infinities differ"
    a, e = a[finite], e[finite]
    diff = (a - e).abs()
    ok = (diff <= abs_tol) | (diff <= rel_tol * e.abs())
    fraction = ok.double().mean().item() if ok.numel() else 1.0
    assert fraction >= min_pass_fraction, (
        f"{name}: {fraction:.4f} pass < {min_pass_fraction}; max abs err {diff.max().item():.3g}")
    if cos_diff is not None and e.numel():
        cos = 1 - 2 * (a * e).sum() / ((a * a).sum() + (e * e).sum())
        assert cos.item() < cos_diff, f"{name}: cosine difference {cos.item():.3g} >= {cos_diff} (SPEC §13: <)"


def e4m3_ulp(x: torch.Tensor) -> torch.Tensor:
    """One e4m3 ULP at |x| (SPEC §13): 2**(floor(log2|x|) - 3), subnormal floor 2**-9."""
    exponent = torch.floor(torch.log2(x.abs().clamp_min(2.0 ** -6)))
    return torch.exp2(exponent - 3)


def assert_cache_equivalent(name: str, fmt: str, actual: torch.Tensor, expected: torch.Tensor,
                            slots: torch.Tensor) -> None:
    """Byte-exact pages, or every dequantized element of the written slots within one e4m3 ULP."""
    if torch.equal(actual.view(torch.uint8), expected.view(torch.uint8)):
        return
    codec = get_codec(fmt)
    a = codec.read_rows(actual, slots)
    e = codec.read_rows(expected, slots)
    scale = e.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    # The ULP of the element's FP8 block is bounded by its row's largest value's ULP.
    bound = e4m3_ulp(scale) * 1.0001
    bad = (a - e).abs() > bound
    assert not bad.any(), (f"{name}: {int(bad.sum())} dequantized values beyond one e4m3 ULP; max diff "
                           f"{(a - e).abs().max().item():.3g}")
    # Bytes outside written rows must be untouched (the reference and we start from the same poison).
    assert math.isfinite(a.abs().sum().item())


def random_block_table(num_requests: int, pages_per_request: int, num_pages: int,
                       generator: torch.Generator | None = None) -> torch.Tensor:
    """int32 [R, pages] with distinct random physical pages (SPEC §10)."""
    perm = torch.randperm(num_pages, generator=generator)[: num_requests * pages_per_request]
    return perm.view(num_requests, pages_per_request).to(torch.int32)


def poisoned_like(cache: torch.Tensor) -> torch.Tensor:
    """Random bytes (not zeros) so that unwritten or wrongly written bytes show."""
    raw = torch.randint(0, 256, (cache.numel() * cache.element_size(),), dtype=torch.uint8)
    if cache.dtype == torch.uint8:
        return raw.view(cache.shape).clone()
    if cache.dtype == torch.bfloat16:
        return (torch.randn(cache.shape) * 3).to(torch.bfloat16)
    return torch.randn(cache.shape).to(cache.dtype)


def load_kernel_variant(module_name: str, old: str, new: str, tmp_path, monkeypatch,
                        dependents: tuple[str, ...] = ()) -> None:
    """For one test, ``dsv4.backends.triton.<module_name>`` with its one occurrence of ``old`` replaced by
    ``new`` (sys.modules and the package attribute, restored by monkeypatch), then ``dependents`` (modules
    that import from it) executed again so that they bind the variant. Loaded from files: Triton reads a
    kernel's source. Raises AssertionError where ``old`` is not there exactly once."""
    import dsv4.backends.triton as package

    def load(name: str, source: str) -> None:
        full = f"dsv4.backends.triton.{name}"
        path = tmp_path / f"{name}.py"
        path.write_text(source)
        spec = importlib.util.spec_from_file_location(full, path)
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, full, module)  # its dataclasses and dependents look it up there
        spec.loader.exec_module(module)
        monkeypatch.setattr(package, name, module)

    source = inspect.getsource(importlib.import_module(f"dsv4.backends.triton.{module_name}"))
    assert source.count(old) == 1, f"{module_name}: the text this variant replaces moved"
    load(module_name, source.replace(old, new))
    for name in dependents:
        load(name, inspect.getsource(importlib.import_module(f"dsv4.backends.triton.{name}")))
