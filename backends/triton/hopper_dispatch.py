"""When ``sparse_attention`` hands a call to the sm_90 Gluon kernels (``sparse_hopper``), and loading them.

Host-side only: ``sparse_hopper`` imports ``triton.experimental.gluon``, so it is imported lazily, on the
first call that can use it; where that import fails the reason is kept and every call takes the
Triton kernel.
"""
from __future__ import annotations

from functools import cache

from dsv4.backends.triton._common import DeviceFacts
from dsv4.backends.triton.layout import LatentLayout

__all__ = ["BLOCK_HEADS", "BLOCK_KEYS", "hopper_unsupported", "loader"]

BLOCK_HEADS, BLOCK_KEYS = 64, 64  # the Hopper kernel's program: heads (the wgmma M) and keys a tile


@cache
def loader():
    """(module, None) or (None, why): ``sparse_hopper`` imports Gluon, so only where it can run."""
    try:
        from dsv4.backends.triton import sparse_hopper
    except Exception as exc:  # noqa: BLE001 - any import failure means "not here", with the reason
        return None, f"Gluon kernel not importable: {type(exc).__name__}: {exc}"
    return sparse_hopper, None


def hopper_unsupported(facts: DeviceFacts, swa: LatentLayout, ext: LatentLayout, dim: int,
                       probs_bf16: bool) -> str | None:
    """Why the Hopper kernels (``sparse_hopper``) cannot serve a call; None when they can.

    They take fp8_ds_mla records (SPEC §9.1) or bf16 rows (SPEC §9.2) of 512 in power-of-two pages with
    16-byte aligned records, bf16 probabilities (SPEC §6.6: deepseek, vllm), on sm_90 CUDA (wgmma,
    setmaxnreg; not under the interpreter).
    """
    if not facts.wgmma:
        return "needs sm_90 CUDA (warpgroup MMA)"
    if swa.format_name not in ("fp8_ds_mla", "bf16") or dim != 512 or swa.row_dim != 512:
        return f"needs fp8_ds_mla or bf16 rows of 512 (got {swa.format_name}, q dim {dim})"
    if not probs_bf16:
        return "needs bf16 probabilities (deepseek, vllm profiles)"
    for lay in (swa, ext):
        aligned = lay.page_stride | lay.token_stride | lay.nope_offset | lay.rope_offset
        if lay.block_size & (lay.block_size - 1) or aligned % 16 or lay.scale_offset % 8:
            return "needs power-of-two pages and 16-byte aligned records"
    return loader()[1]
