#!/usr/bin/env bash
# The one call on the H200 (device tool): checks and times everything, writes JSON under $OUT.
#   carry: .whl (pydantic, pydantic-core, annotated-types, typing-inspection, sgl-flash-mla 1.0.0; cp312)
#          .device (a copy of ../shared/goldens: deepseek_tiny_b1.{json,safetensors})
# Usage there: bash tools/h200_run.sh [quick]
set -uo pipefail
source tools/device_env.sh
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, triton, flash_mla; print(torch.__version__, triton.__version__, 'flash_mla legacy', flash_mla.has_legacy())"
step dsv4-conformance list
step dsv4-conformance run --backend triton --device cuda --json "$OUT/conformance_triton.json"
step dsv4-conformance run --backend flashmla --device cuda --json "$OUT/conformance_flashmla.json"
step dsv4-conformance layer-golden $GOLDEN --backend triton --device cuda --json "$OUT/golden_triton.json"
step dsv4-conformance layer-golden $GOLDEN --backend triton --backend sparse_attention=flashmla --device cuda \
  --json "$OUT/golden_triton_flashmla.json"
step dsv4-conformance layer-golden $GOLDEN --device cuda --json "$OUT/golden_auto.json"
step python3 tools/check_flashmla.py --json "$OUT/check_flashmla.json"
step python3 tools/target_isa.py  # what the mxfp4 indexer lowers to on sm_90 / sm_100 / gfx950 / gfx942 (compiled only)
step python3 tools/graph_guards_check.py  # capture before reserve_positions refused; refresh_weights reaches graphs; capture selects as eager
step python3 tools/spec_decode_check.py  # verify steps with rollback: rejected rows never read; accepted = plain run
step python3 tools/large_tokens_check.py  # [T, 128, 512] tensors past 2**31 elements (T = 32832)
step python3 tools/topk_padded.py  # a padded row against the same row unpadded (top-k, CUDA-graph replay)
if [ "${1:-}" != "quick" ]; then
  step python3 tools/gpu_check.py
fi
step python3 tools/bench_layer.py --batch 64 --context 4096 --json "$OUT/bench_layer.json"
step python3 tools/profile_layer.py --json "$OUT/profile_layer.json" --top 12 --layers 1,4
step python3 tools/host_overhead.py --json "$OUT/host_overhead.json"  # eager host time a step, direct vs via dsv4.ops
if [ "${1:-}" != "quick" ]; then  # the mxfp4 indexer loop against variants that drop its work (~60 s; a table in the log)
  step python3 tools/indexer_floor.py
  step python3 tools/indexer_reg_fp8.py  # the fastest sm_90 mxfp4 design measured, not installed (~20 s)
fi
# at most 8 files come back from the device tool: the three golden reports go into one
python3 - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
parts = sorted(out.glob("golden_*.json"))
if parts:
    (out / "goldens.json").write_text(json.dumps({p.stem: json.loads(p.read_text()) for p in parts}, indent=1))
    for p in parts:
        p.unlink()
PY
ls "$OUT"
