#!/usr/bin/env bash
# Whole-step A/B runs on a 2-GPU host: GPU correctness check, then `qzero qualify` of the
# plain synchronous gather (baseline) against INT8 g64 with gather-ahead (candidate) for a
# Qwen3-1.7B-shaped model in the PCIe-class and Ethernet-class regimes of SPEC.md section 3.
# Usage (repository root, on the GPU machine): bash bench/run_steps.sh OUTDIR
set -u
out=${1:-bench/results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
python3 -m pip install -q --no-deps --no-build-isolation -e . >/tmp/qzero_pip.log 2>&1 || { echo "pip install failed"; tail /tmp/qzero_pip.log; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
[ -n "${SKIP_CHECK:-}" ] || timeout "${CHECK_TIMEOUT:-150}" python3 -m torch.distributed.run --nproc_per_node=2 bench/gpu_check.py --delays 2>&1 \
    | grep -E "PASS|FAIL|Error|error" | tee "$out/gpu_check.log"
common=(--device cuda --world-size 2 --preset qwen3-1.7b --seq-len 2048 --micro-batch 2
        --steps "${STEPS:-8}" --warmup 2 --allgather-bucket 5e7 --reduce-bucket 5e7 --lr 1e-4)
qual() {  # name, then NCCL settings
    local name=$1; shift
    echo "=== $name: $*"
    env "$@" timeout "${QUALIFY_TIMEOUT:-200}" qzero qualify "${common[@]}" \
        --candidate quantized=true --candidate overlap=true --out "$out/$name" 2>&1 | tail -n 3
}
qual step_dp2_pcie_int8_ahead NCCL_P2P_DISABLE=1
qual step_dp2_ethernet_int8_ahead NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1
for d in "$out"/step_dp2_*; do
    [ -f "$d/report.json" ] && python3 - "$d" <<'PY'
import json, sys
r = json.load(open(sys.argv[1] + "/report.json"))
lo, hi = r["speedup_ci95"]
print(f"{sys.argv[1].rsplit('/', 1)[-1]:34s} base {1e3*r['baseline_median_s']:8.1f} ms  cand {1e3*r['candidate_median_s']:8.1f} ms"
      f"  speedup {r['speedup']:.3f} [{lo:.3f}, {hi:.3f}]  gates {'pass' if r['passed'] else 'FAIL'}")
PY
done
