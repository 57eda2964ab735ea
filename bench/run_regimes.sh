#!/usr/bin/env bash
# The world-size-2 gather benchmark in the three link regimes of SPEC.md section 3, on a
# host with two NVLink-connected GPUs. Usage: bash bench/run_regimes.sh OUTDIR [benchmark args...]
set -u
out=${1:-bench/results}
shift || true
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
python3 -m pip install -q --no-deps --no-build-isolation -e . >/tmp/qzero_pip.log 2>&1 || { echo "pip install failed"; tail /tmp/qzero_pip.log; }
run() {  # name, then NCCL settings
    local name=$1; shift
    echo "=== $name: $*"
    env "$@" timeout "${REGIME_TIMEOUT:-200}" python3 -m torch.distributed.run --nproc_per_node=2 \
        bench/gather_bench.py --out "$out" --tag "gather_dp2_$name" "${BENCH_ARGS[@]}"
}
BENCH_ARGS=("$@")
run nvlink NCCL_NVLS_ENABLE=0
run pcie NCCL_NVLS_ENABLE=0 NCCL_P2P_DISABLE=1
run ethernet NCCL_NVLS_ENABLE=0 NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1
