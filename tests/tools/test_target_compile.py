"""tools/target_compile.py: every Triton kernel compiled for every target on this CPU (a fresh process: the
kernels must be JIT functions, not the interpreter's), with the wrappers' own path choices there."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "target_compile.py"
sys.path.insert(0, str(TOOL.parent))


def test_every_kernel_builds_for_every_target(tmp_path) -> None:
    """Fails on a kernel that does not compile for a target (e.g. a Gluon or Triton API that a Triton release
    renamed), a kernel that no driver launches where its wrapper would, or a launch that a target refuses
    (shared memory, threads, tensor memory) without the launcher stepping down to one it takes."""
    import target_compile

    path = tmp_path / "records.json"
    out = subprocess.run([sys.executable, str(TOOL), "--json", str(path)], capture_output=True, text=True,
                         timeout=1800, check=False)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "0 problem(s)" in out.stdout
    results = json.loads(path.read_text())
    assert sorted(results) == sorted(target_compile.TARGETS)
    sums = {t: target_compile.summarize(r) for t, r in results.items()}
    for t, kernels in sums.items():
        for name, k in kernels.items():
            assert not k["fails"], (t, name, k["fails"])
            assert k["shared"] <= results[t]["smem"], (t, name)
    # the H200-tuned sparse-attention shapes do not fit these targets: each stepped down, and ran
    for t in ("sm_100", "sm_120", "gfx942"):
        k = sums[t]["sparse_attention._sparse_attention_kernel"]
        assert k["refused"] and all("shared memory" in why for why in k["refused"].values()), t
        assert k["keys"], t
    # sm_90 compiles the warp-specialized Gluon kernels (they use no other target)
    assert sums["sm_90"]["sparse_hopper._sparse_hopper_kernel"]["keys"]
    assert "sparse_hopper._sparse_hopper_kernel" not in sums["gfx942"]


def test_report_counts_what_a_target_launches() -> None:
    """The report counts a kernel missing where its wrapper launches it, not where it does not."""
    import target_compile

    facts = {"wgmma": False, "hw_e4m3": False, "mx_mma": True}
    assert not target_compile.expected("sparse_hopper._sparse_hopper_kernel", facts)
    assert target_compile.expected("indexer._q_codes_kernel", facts)
    assert target_compile.expected("topk._topk_kernel", facts)
    result = {"target": "gfx942", "smem": 65536, "facts": {**facts, "mx_mma": False}, "errors": [], "records": [
        {"kernel": "topk._topk_kernel", "driver": "d", "status": "ok", "key": "a", "shared": 1024, "scratch": 0},
        {"kernel": "topk._topk_kernel", "driver": "d", "status": "refused", "key": "b", "shared": 1 << 17,
         "scratch": 0, "refusal": "shared memory 131072 > 65536"}]}
    lines = []

    class Out:
        def write(self, text):
            lines.append(text)

    problems = target_compile.report({"gfx942": result}, ["suite"], out=Out())
    text = "".join(lines)
    missing = len(target_compile.KERNELS) - 3  # topk launched; the Hopper and q-codes kernels not wanted there
    assert problems == missing and "1/1K/0 +1" in text and "refused gfx942 topk._topk_kernel" in text
