# Sourced by the device-run scripts (tools/h200_run.sh, tools/h200x2_run.sh): installs the carried
# wheels (.whl: pydantic, pydantic-core, annotated-types, typing-inspection, sgl-flash-mla 1.0.0; cp312)
# and this checkout into /tmp, and sets PYTHONPATH / PATH / the NCCL environment (NVLink multicast off).
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/dsv4 . >/dev/null 2>&1 \
  || { echo "install of dsv4 failed"; exit 1; }
export PYTHONPATH=/tmp/dsv4:/tmp/site PATH=/tmp/dsv4/bin:$PATH
GOLDEN=.device/deepseek_tiny_b1.json
step() { echo; echo "=== $*"; "$@"; echo "--- exit $?"; }
