#!/usr/bin/env bash
# One GPU session's calls on a 2 x H200 host, in the order they were run (each fits one
# 600 s device call). Usage (repository root, on the GPU machine):
#   bash bench/gpu_session.sh checks OUT     # install, gpu_check --delays, DeepSpeed adapter check, NVLink matrix
#   bash bench/gpu_session.sh pcie OUT       # whole-step matrix, PCIe-class (+ ZeRO-1 and FP16 rows)
#   bash bench/gpu_session.sh ethernet OUT   # whole-step matrix, Ethernet-class
#   bash bench/gpu_session.sh convergence OUT
#   bash bench/gpu_session.sh nvlink OUT     # (next session) all six arms incl. the peers, NVLink
#   bash bench/gpu_session.sh profile OUT    # (next session) per-phase times in all three regimes
# Budget: LIMIT (default 570 s) bounds each phase; the matrix gets what the checks leave.
set -u
phase=${1:?phase}
out=${2:?outdir}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 HF_HUB_OFFLINE=1
start=$(date +%s)
left() { echo $(( ${LIMIT:-570} - ($(date +%s) - start) )); }
install() {
    [ -d .whl ] && bash bench/install_wheels.sh .whl >"$out/install.log" 2>&1
    python3 -m pip install -q --no-deps --no-build-isolation -e . >>"$out/install.log" 2>&1 || tail "$out/install.log"
}
case $phase in
    checks)
        install
        nvidia-smi --query-gpu=index,name,driver_version,memory.used --format=csv,noheader
        timeout 150 python3 -m torch.distributed.run --nproc_per_node=2 bench/gpu_check.py --delays >"$out/gpu_check.log" 2>&1
        echo "gpu_check rc=$? after $(( $(date +%s) - start )) s"
        grep -E "PASS|FAIL|Error" "$out/gpu_check.log" | tail -n 25
        CHECK_TIMEOUT=150 bash bench/run_deepspeed_gpu.sh "$out/deepspeed" >/dev/null 2>&1
        echo "deepspeed check rc=$? after $(( $(date +%s) - start )) s"
        grep -E "FAIL" "$out/deepspeed/deepspeed_gpu_check.log" | head
        tail -n 8 "$out/deepspeed/deepspeed_gpu_check.log"
        ARMS="plain: int8:quantized=true int8_ahead:quantized=true,overlap=true" STEPS=${STEPS:-8} \
            MATRIX_TIMEOUT=$(left) bash bench/run_matrix.sh "$out" nvlink 2>&1 | tail -n 8
        ;;
    pcie)
        install
        NCCL_P2P_DISABLE=1 timeout 120 python3 -m torch.distributed.run --nproc_per_node=2 bench/step_profile.py \
            --arms plain,int8,int8_ahead --steps 5 --out "$out/profile_pcie.json" >"$out/profile_pcie.log" 2>&1
        grep -E "^arm|^plain|^int8" "$out/profile_pcie.log"
        ARMS="plain: int8_ahead:quantized=true,overlap=true fsdp2:engine=fsdp2 deepspeed:engine=deepspeed int8:quantized=true plain_ahead:overlap=true zero1_int8_ahead:stage=1,quantized=true,overlap=true fp16_int8_ahead:precision=fp16,quantized=true,overlap=true" \
            STEPS=${STEPS:-8} MATRIX_TIMEOUT=$(left) bash bench/run_matrix.sh "$out" pcie 2>&1 | tail -n 12
        ;;
    ethernet)
        install
        ARMS="plain: int8_ahead:quantized=true,overlap=true fsdp2:engine=fsdp2 deepspeed:engine=deepspeed int8:quantized=true plain_ahead:overlap=true" \
            STEPS=${STEPS:-8} MATRIX_TIMEOUT=$(left) bash bench/run_matrix.sh "$out" ethernet 2>&1 | tail -n 10
        ;;
    nvlink)
        install
        ARMS="plain: int8_ahead:quantized=true,overlap=true fsdp2:engine=fsdp2 deepspeed:engine=deepspeed int8:quantized=true plain_ahead:overlap=true" \
            STEPS=${STEPS:-8} MATRIX_TIMEOUT=$(left) bash bench/run_matrix.sh "$out" nvlink 2>&1 | tail -n 10
        ;;
    profile)
        install
        for regime in nvlink pcie ethernet; do
            case $regime in nvlink) envs=() ;; pcie) envs=(NCCL_P2P_DISABLE=1) ;;
                ethernet) envs=(NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1) ;; esac
            env "${envs[@]}" timeout 170 python3 -m torch.distributed.run --nproc_per_node=2 bench/step_profile.py \
                --arms plain,plain_ahead,int8,int8_ahead,int8_ahead_streams --steps 6 --out "$out/profile_$regime.json" >"$out/profile_$regime.log" 2>&1
            echo "== $regime"; grep -E "^arm|^plain|^int8" "$out/profile_$regime.log"
        done
        ;;
    convergence)
        install
        TIME_LIMIT=$(( $(left) - 30 )) bash bench/run_convergence.sh "$out/convergence" 2>&1 | tail -n 14
        ;;
    *) echo "unknown phase $phase"; exit 2 ;;
esac
echo "phase $phase done in $(( $(date +%s) - start )) s"
