#!/usr/bin/env bash
# The kernels on one GPU: the GPU-only kernel tests, then benchmarks/scripts/gather_bench.py's single-GPU
# benchmark (pack / unpack against the device copy bandwidth, eager reference, world-size-1 gather).
# Usage (repository root, on the GPU machine): bash benchmarks/scripts/run_device.sh OUTDIR [gather_bench args...]
# Environment: TEST_TIMEOUT (200 s), BENCH_TIMEOUT (340 s).
set -u
out=${1:?usage: bash benchmarks/scripts/run_device.sh OUTDIR [gather_bench args...]}
shift
here=$(cd "$(dirname "$0")" && pwd)
. "$here/regimes.sh"
mkdir -p "$out"
qzero_install || exit 1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
t0=$(date +%s)
timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q --maxfail=5 -p no:cacheprovider -W ignore::FutureWarning \
    "$here/../../tests/test_triton.py" >"$out/gpu_tests.log" 2>&1
echo "GPU tests: rc=$? in $(( $(date +%s) - t0 )) s"; tail -n 25 "$out/gpu_tests.log"
timeout "${BENCH_TIMEOUT:-340}" python3 -m qzero bench gather --out "$out" "$@" 2>&1 | tee "$out/bench.log"
