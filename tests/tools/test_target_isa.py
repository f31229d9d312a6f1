"""tools/target_isa.py: the mxfp4 indexer's default lowering per target, compiled on CPU by Triton (a fresh
process: the kernels must be real JIT functions, not the interpreter's)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "target_isa.py"


def _run(*targets: str) -> dict[str, str]:
    out = subprocess.run([sys.executable, str(TOOL), *targets], capture_output=True, text=True, timeout=600,
                         check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line.split(None, 1) for line in out.stdout.splitlines()[1:]]
    return {name: rest for name, rest in rows}


def test_block_scaled_mma_where_the_target_has_one() -> None:
    """sm_100 / sm_103 and gfx950 score mxfp4 keys with block-scaled MMAs (no decode); sm_90, sm_120 and
    gfx942 have none, and their kernels keep the decode / dequantized paths. Fails if dot_scaled loses its q scales or its 128-key
    tile (Triton then lowers it to bf16 MMAs on upcast operands) or if the device facts stop selecting it."""
    rows = _run("sm_90", "sm_100", "sm_103", "sm_120", "gfx950", "gfx942")
    for sm in ("sm_100", "sm_103"):
        assert "tl.dot_scaled" in rows[sm] and "kind::mxf8f6f4.block_scale" in rows[sm]
    assert "integer decode" in rows["sm_120"] and "block_scale" not in rows["sm_120"]
    assert "tl.dot_scaled" in rows["gfx950"] and "v_mfma_scale_f32" in rows["gfx950"] and "f8f6f4" in rows["gfx950"]
    assert "integer decode" in rows["sm_90"] and "wgmma" in rows["sm_90"] and "block_scale" not in rows["sm_90"]
    assert "v_mfma_scale" not in rows["gfx942"] and "v_mfma_f32" in rows["gfx942"]


def test_zero_accumulator_both_ways() -> None:
    """RUNTIME_ZERO_ACC is on before Triton 3.9 only: from 3.9 the block-scaled MMA must compile from a constant
    zero on sm_100 (before 3.9 Triton's OptimizeAccumulatorInit pass fails on it, docs/triton.md), and the
    workaround's branch (a runtime zero, what older Tritons run) must still lower to the block-scaled MMA."""
    import triton
    from dsv4.backends.triton import indexer_mx

    version = tuple(int(v) for v in triton.__version__.split(".")[:2])
    assert bool(indexer_mx.RUNTIME_ZERO_ACC) == (version < (3, 9))
    for zero in ("constant", "runtime") if version >= (3, 9) else ("runtime",):
        rows = _run("--zero-acc", zero, "sm_100")
        assert "kind::mxf8f6f4.block_scale" in rows["sm_100"], zero


def test_zero_acc_override_rejects_an_unknown_value() -> None:
    out = subprocess.run([sys.executable, str(TOOL), "--zero-acc", "never", "sm_100"], capture_output=True,
                         text=True, timeout=120, check=False)
    assert out.returncode == 2 and "--zero-acc: expected runtime or constant, got ['never']" in out.stderr
