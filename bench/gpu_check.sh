#!/usr/bin/env bash
# GPU check, for a machine with a GPU, PyTorch and nvcc but no network:
#   bash bench/gpu_check.sh [OUT_DIR]
# builds the CUDA extension, runs every CUDA test (the device-parametrised op/layer tests and the
# emulator-vs-device agreement of tests/test_emulator_vs_cuda.py), the emulator tests, and the GPU
# kernel bandwidth benchmark, bench.step of every method (exact clipping included) and the norm cost
# rule's measurement (bench/norm_cost.py), and writes every log and result into OUT_DIR (default
# gpu_check_<date>). Exit status: non-zero if the build or any test failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-gpu_check_$(date +%Y%m%d_%H%M%S)}
mkdir -p "$OUT"
if [[ -n "${PYTHON:-}" ]]; then PY=$PYTHON; elif [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
# The system compiler, not the one Python was built with: on the lent H100/H200 image that is a
# wrapper, /opt/gcc/bin/g++, and the extension it linked segfaulted inside libstdc++ code when an
# error message formatted a number (seen 2026-11-23; /usr/bin/g++ 13.3 builds one that raises).
export CC=${CC:-gcc} CXX=${CXX:-g++}
export LDSHARED=${LDSHARED:-"$CXX -shared"}
status=0
step() {  # step NAME CMD...: run, log to OUT/NAME.log, remember failure
  local name=$1; shift
  echo "== $name: $*" | tee -a "$OUT/summary.txt"
  "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "   exit $rc" | tee -a "$OUT/summary.txt"
  [[ $rc -eq 0 ]] || status=1
  return $rc
}
{ nvidia-smi; nvcc --version; "$PY" -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())'; } >"$OUT/machine.txt" 2>&1
step build env BPCLIP_FORCE_CUDA=1 MAX_JOBS="${MAX_JOBS:-8}" "$PY" setup.py build_ext --inplace || { echo "build failed; see $OUT/build.log"; exit 1; }
step build_info "$PY" -c 'import bpclip_fast, json; print(json.dumps(bpclip_fast.build_info(), indent=1))'
# With pytest-xdist (when installed) a test that crashes the interpreter fails alone instead of ending the run.
XDIST=(); "$PY" -c 'import xdist' 2>/dev/null && XDIST=(-n "${PYTEST_WORKERS:-8}")
step pytest_cuda "$PY" -m pytest -q -rfEs "${XDIST[@]}" -m cuda tests --junitxml="$OUT/pytest_cuda.xml"
step pytest_emulator "$PY" -m pytest -q tests/test_emulator.py
step bandwidth "$PY" -m pytest bench/test_kernels.py --benchmark-only -q -p no:cacheprovider --bench-device cuda \
  --bench-sizes-mb 1,32,512,2048 --benchmark-json="$OUT/bandwidth.json"
# One child per cell and short timing windows: each child spends ~10 s starting CUDA, so the
# default 5 reps of 36 cells would outlast a 10-minute lease.
step step_bench "$PY" -m bench.step --device cuda --models mnist,cifar10 --batch-sizes 128,512 --reps 1 \
  --warmup-time 0.5 --min-time 1 \
  --methods nonprivate,bpclip_fast,flat,per_layer,opacus_ghost,opacus_hooks --json "$OUT/step.json" --md "$OUT/step.md"
step norm_cost "$PY" -m bench.norm_cost --device cuda
tail -n 3 "$OUT"/pytest_*.log >>"$OUT/summary.txt" 2>/dev/null
echo "results in $OUT (summary.txt)"
exit $status
