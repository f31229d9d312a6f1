#!/usr/bin/env bash
# The call on a machine of two (or more) H200s (device tool, kind nvidia-h200-x2): tensor- and
# context-parallel layers over NCCL. Writes JSON under $OUT.
#   carry: .whl and .device, as tools/h200_run.sh
# Usage there: bash tools/h200x2_run.sh [quick]   (quick: the two CLI runs only)
set -uo pipefail
source tools/device_env.sh
nvidia-smi --query-gpu=index,name,driver_version --format=csv
nvidia-smi topo -m
python3 -c "import torch; print(torch.__version__, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())"
step dsv4-conformance make-layer-golden /tmp/golden/tiny_g2.json
step dsv4-conformance layer-golden /tmp/golden/tiny_g2.json --tp 2 --device cuda --json "$OUT/cli_tp2.json"
step dsv4-conformance layer-golden $GOLDEN --cp 2 --device cuda --json "$OUT/cli_cp2_official.json"
[ "${1:-}" = "quick" ] && exit 0
step python3 tools/multi_gpu_check.py --golden $GOLDEN --json "$OUT/multi_gpu_check.json"
step python3 tools/bench_parallel.py --json "$OUT/bench_parallel.json"
