#!/usr/bin/env bash
# Everything one single-GPU device call does: install, GPU kernel tests, benchmark.
# Usage (repository root, on the GPU machine): bash bench/run_device.sh OUTDIR [benchmark args...]
set -u
out=${1:-bench/results}
shift || true
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
python3 -m pip install -q --no-deps --no-build-isolation -e . >/tmp/qzero_pip.log 2>&1 || { echo "pip install failed"; tail /tmp/qzero_pip.log; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
t0=$(date +%s)
timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q --maxfail=5 -p no:cacheprovider -W ignore::FutureWarning \
    tests/test_triton.py >"$out/gpu_tests.log" 2>&1
echo "GPU tests: rc=$? in $(( $(date +%s) - t0 )) s"; tail -n 25 "$out/gpu_tests.log"
timeout "${BENCH_TIMEOUT:-340}" python3 bench/gather_bench.py --out "$out" "$@" 2>&1 | tee "$out/bench.log"
