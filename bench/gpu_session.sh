#!/usr/bin/env bash
# One GPU session's calls on a 2 x H200 host, in the order they were run (each fits one
# 600 s device call). Usage (repository root, on the GPU machine):
#   bash bench/gpu_session.sh checks OUT     # install, gpu_check --delays, DeepSpeed adapter check, NVLink matrix
#   bash bench/gpu_session.sh pcie OUT       # whole-step matrix, PCIe-class (+ ZeRO-1 and FP16 rows)
#   bash bench/gpu_session.sh ethernet OUT   # whole-step matrix, Ethernet-class
#   bash bench/gpu_session.sh convergence OUT
#   bash bench/gpu_session.sh nvlink OUT     # (next session) all six arms incl. the peers, NVLink
#   bash bench/gpu_session.sh profile OUT    # (next session) per-phase times in all three regimes
# Session 3 (one tarball per call, OUT/s3*.tgz, plus the key tables beside it):
#   bash bench/gpu_session.sh s3a OUT  # GPU tests, kernels (1 GPU), gpu_check --delays, profiles PCIe + Ethernet, DP2 gathers
#   bash bench/gpu_session.sh s3b OUT  # whole-step matrix on NVLink, all arms incl. both peers and side-stream gather-ahead
#   bash bench/gpu_session.sh s3d OUT  # the step-timing fix: PCIe-class plain / int8 / int8_ahead / fsdp2
#   REGIME=ethernet bash bench/gpu_session.sh matrix OUT   # next: any regime, six core arms (ARMS to change)
#   bash bench/gpu_session.sh dp4 OUT                      # issue 9 (4-GPU host)
#   bash bench/gpu_session.sh dp8-gather OUT; REGIME=pcie|ethernet bash bench/gpu_session.sh dp8 OUT   # issue 10 (8-GPU host)
#   bash bench/gpu_session.sh s3c OUT  # gpu_check --delays, then the PCIe-class matrix (side streams and sliced update now the defaults)
# Session 4 (exact lines in bench/results/session4_2026-11-30/README.md):
#   LIMIT=... REGIME=ethernet|nvlink|pcie ARMS="..." bash bench/gpu_session.sh matrix OUT
#   bash bench/gpu_session.sh memory OUT   # bench/memory_peak.py per engine (ENGINES), then qzero vs fsdp2
#   LIMIT=... REGIME=pcie|ethernet PRESET=qwen3-1.7b|qwen3-4b bash bench/gpu_session.sh fsdp2 OUT
#       # bench/fsdp2_check.py, then plain FSDP2 vs FSDP2 + qzero.fsdp (both reshard modes) and ZeroOptimizer INT8
# Budget: LIMIT (default 570 s) bounds each phase; the matrix gets what the checks leave.
set -u
phase=${1:?phase}
out=${2:?outdir}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 HF_HUB_OFFLINE=1
start=$(date +%s)
left() { echo $(( ${LIMIT:-570} - ($(date +%s) - start) )); }
t() { local l=$(( $(left) - 20 )); [ "$l" -gt 5 ] || l=5; echo $(( $1 < l ? $1 : l )); }  # a step's timeout within what is left
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
    s3a)
        w="$out/s3a"; mkdir -p "$w"
        install
        nvidia-smi --query-gpu=index,name,driver_version,memory.used --format=csv,noheader | tee "$w/nvidia-smi.txt"
        timeout $(t 150) python3 -m pytest -q -x -p no:cacheprovider tests/test_triton.py tests/test_overlap.py >"$w/pytest_gpu.log" 2>&1
        echo "pytest (GPU) rc=$? after $(( $(date +%s) - start )) s: $(tail -n 1 "$w/pytest_gpu.log")"
        timeout $(t 100) python3 bench/gather_bench.py --sizes 2048Mi,256Mi --formats int8,fp8,int4 --tune 2048x4 \
            --out "$w" --tag kernels_single >"$w/kernels.log" 2>&1
        echo "kernels rc=$? after $(( $(date +%s) - start )) s"; grep -E "^\| 2 Gi|equal to" "$w/kernels.log"
        timeout $(t 130) python3 -m torch.distributed.run --nproc_per_node=2 bench/gpu_check.py --delays >"$w/gpu_check.log" 2>&1
        echo "gpu_check rc=$? after $(( $(date +%s) - start )) s"; grep -cE "^PASS" "$w/gpu_check.log"; grep -E "FAIL|Error" "$w/gpu_check.log" | head
        for regime in pcie ethernet; do
            case $regime in pcie) envs=(NCCL_P2P_DISABLE=1) ;; ethernet) envs=(NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1) ;; esac
            env "${envs[@]}" timeout $(t 115) python3 -m torch.distributed.run --nproc_per_node=2 bench/step_profile.py \
                --arms plain,plain_ahead,int8,int8_ahead,int8_ahead_streams --steps 5 \
                --out "$w/profile_$regime.json" >"$w/profile_$regime.log" 2>&1
            echo "== profile $regime rc=$? after $(( $(date +%s) - start )) s"; grep -E "^arm|^plain|^int8" "$w/profile_$regime.log"
        done
        for regime in pcie ethernet; do
            [ "$(left)" -gt 60 ] || break
            case $regime in pcie) envs=(NCCL_P2P_DISABLE=1) ;; ethernet) envs=(NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1) ;; esac
            env "${envs[@]}" timeout $(t 100) python3 -m torch.distributed.run --nproc_per_node=2 bench/gather_bench.py \
                --sizes 2048Mi --formats int8,int4 --rounds 8 --out "$w" --tag "gather_dp2_$regime" >"$w/gather_$regime.log" 2>&1
            echo "== gather $regime rc=$? after $(( $(date +%s) - start )) s"; grep -E "^\|" "$w/gather_$regime.log" | tail -n 4
        done
        tar czf "$out/s3a.tgz" -C "$w" . && rm -rf "$w"
        ;;
    s3b|s3c)
        regime=$([ "$phase" = s3b ] && echo nvlink || echo pcie)
        install
        if [ "$phase" = s3b ]; then  # the pack after its second change (no clamp, no F2I), one GPU
            timeout 60 python3 bench/gather_bench.py --sizes 2048Mi --formats int8,int4 --tune 2048x4 --no-reference \
                --out "$out" --tag kernels_single_v2 >"$out/kernels_v2.log" 2>&1; grep -E "^\| 2 Gi|equal to" "$out/kernels_v2.log"
        fi
        # s3b ran before side streams became the default: there int8_ahead is the hook-driven pump.
        arms="plain: int8:quantized=true plain_ahead:overlap=true int8_ahead:quantized=true,overlap=true int8_ahead_streams:quantized=true,overlap=true,env.QZERO_AHEAD_STREAMS=1 fsdp2:engine=fsdp2 deepspeed:engine=deepspeed"
        if [ "$phase" = s3c ]; then  # side streams and the sliced update are the defaults now
            arms="plain: int8:quantized=true int8_ahead:quantized=true,overlap=true int8_ahead_whole:quantized=true,overlap=true,env.QZERO_SLICED_UPDATE=0 fsdp2:engine=fsdp2"
            timeout $(t 150) python3 -m torch.distributed.run --nproc_per_node=2 bench/gpu_check.py --delays >"$out/gpu_check.log" 2>&1
            echo "gpu_check rc=$? after $(( $(date +%s) - start )) s"; grep -cE "^PASS" "$out/gpu_check.log"; grep -E "FAIL|Error" "$out/gpu_check.log" | head
        fi
        ARMS="$arms" STEPS=${STEPS:-8} MATRIX_TIMEOUT=$(( $(left) - 15 )) bash bench/run_matrix.sh "$out" "$regime" 2>&1 | tail -n 12
        d="$out/matrix_dp2_$regime"
        [ -d "$d/logs" ] && tar czf "$out/logs_$regime.tgz" -C "$d" logs && rm -rf "$d/logs"
        ;;
    s3d)  # after the step-timing fix (no device-wide sync between steps): PCIe-class, the core arms
        install
        ARMS="${ARMS:-plain: int8_ahead:quantized=true,overlap=true fsdp2:engine=fsdp2}" \
            STEPS=${STEPS:-10} MATRIX_TIMEOUT=$(( $(left) - 10 )) bash bench/run_matrix.sh "$out" pcie 2>&1 | tail -n 9
        d="$out/matrix_dp2_pcie"
        [ -d "$d/logs" ] && tar czf "$out/logs_pcie.tgz" -C "$d" logs && rm -rf "$d/logs"
        ;;
    dp4)  # issue 9, on a 4-GPU host: the public proposal's configuration (Qwen3-4B, PCIe-class, 26M/50M buckets)
        install
        nvidia-smi --query-gpu=index,name --format=csv,noheader
        WORLD=4 PRESET=qwen3-4b RS_BUCKET=26e6 AG_BUCKET=5e7 STEPS=${STEPS:-10} \
            ARMS="${ARMS:-plain: int8:quantized=true int8_ahead:quantized=true,overlap=true deepspeed:engine=deepspeed}" \
            MATRIX_TIMEOUT=$(( $(left) - 10 )) bash bench/run_matrix.sh "$out" pcie 2>&1 | tail -n 10
        [ -d "$out/matrix_dp4_pcie/logs" ] && tar czf "$out/logs_dp4.tgz" -C "$out/matrix_dp4_pcie" logs && rm -rf "$out/matrix_dp4_pcie/logs"
        ;;
    dp8-gather)  # issue 10, on an 8-GPU host: the gather at world 8 and 4 (and 2), then the bandwidth model
        install
        mkdir -p "$out/gather"
        for regime in pcie ethernet; do
            case $regime in pcie) envs=(NCCL_P2P_DISABLE=1) ;; ethernet) envs=(NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1) ;; esac
            for w in 2 4 8; do
                env "${envs[@]}" timeout $(t 120) python3 -m torch.distributed.run --nproc_per_node=$w bench/gather_bench.py \
                    --sizes 2048Mi --formats int8,int4 --rounds 6 --out "$out/gather" --tag "gather_dp${w}_$regime" >"$out/gather/dp${w}_$regime.log" 2>&1 \
                    || echo "gather dp$w $regime failed"
            done
            python3 bench/gather_scaling.py "$out"/gather/gather_dp*_"$regime".json --out "$out/scaling_$regime" | tail -n 12
        done
        (cd "$out" && tar czf gather.tgz gather && rm -rf gather)
        ;;
    dp8)  # issue 10, on an 8-GPU host: whole steps at DP8 (Qwen3-4B), REGIME=pcie|ethernet, against both peers
        install
        WORLD=8 PRESET=qwen3-4b STEPS=${STEPS:-10} \
            ARMS="${ARMS:-plain: int8:quantized=true int8_ahead:quantized=true,overlap=true fsdp2:engine=fsdp2 deepspeed:engine=deepspeed}" \
            MATRIX_TIMEOUT=$(( $(left) - 10 )) bash bench/run_matrix.sh "$out" "${REGIME:-pcie}" 2>&1 | tail -n 11
        d="$out/matrix_dp8_${REGIME:-pcie}"
        [ -d "$d/logs" ] && tar czf "$out/logs_dp8.tgz" -C "$d" logs && rm -rf "$d/logs"
        ;;
    matrix)  # any regime, any arms: REGIME=pcie|ethernet|nvlink ARMS="..." (default: the six core arms)
        install
        ARMS="${ARMS:-plain: int8:quantized=true plain_ahead:overlap=true int8_ahead:quantized=true,overlap=true fsdp2:engine=fsdp2 deepspeed:engine=deepspeed}" \
            STEPS=${STEPS:-10} MATRIX_TIMEOUT=$(( $(left) - 10 )) bash bench/run_matrix.sh "$out" "${REGIME:-pcie}" 2>&1 | tail -n 12
        d="$out/matrix_dp2_${REGIME:-pcie}"
        [ -d "$d/logs" ] && tar czf "$out/logs_${REGIME:-pcie}.tgz" -C "$d" logs && rm -rf "$d/logs"
        ;;
    memory)  # what is live at the memory peak, per engine (ENGINES="qzero fsdp2 deepspeed"), NVLink, DP2
        install
        mkdir -p "$out/memory"
        for e in ${ENGINES:-qzero fsdp2}; do
            timeout $(t 150) python3 -m torch.distributed.run --nproc_per_node=2 bench/memory_peak.py --engine "$e" \
                --steps ${MEM_STEPS:-3} --out "$out/memory" >"$out/memory/$e.log" 2>&1 || { echo "memory $e failed"; tail -n 5 "$out/memory/$e.log"; }
            grep -m1 -i "peak" "$out/memory/$e.log"
        done
        [ -f "$out/memory/memory_qzero.json" ] && [ -f "$out/memory/memory_fsdp2.json" ] && \
            python3 bench/memory_peak.py --compare "$out/memory/memory_qzero.json" "$out/memory/memory_fsdp2.json" | tee "$out/memory/compare.md" | head -n 40
        (cd "$out" && tar czf memory.tgz memory && rm -rf memory)
        ;;
    fsdp2)  # FSDP2 + qzero.fsdp against plain FSDP2, both reshard modes, plus ZeroOptimizer INT8 gather-ahead
        # REGIME=pcie|ethernet PRESET=qwen3-1.7b|qwen3-4b; the first arm is the reference, fsdp2 the peer
        install
        timeout $(t 120) python3 -m torch.distributed.run --nproc_per_node=2 bench/fsdp2_check.py --out "$out" \
            >"$out/fsdp2_check.log" 2>&1; echo "fsdp2_check rc=$?"; grep -E "PASS|FAIL|Error" "$out/fsdp2_check.log" | tail -n 6
        ARMS="${ARMS:-fsdp2_rs:engine=fsdp2,reshard_after_forward=true fsdp2_rs_int8:engine=fsdp2,reshard_after_forward=true,quantized=true fsdp2:engine=fsdp2 fsdp2_int8:engine=fsdp2,quantized=true zero_int8_ahead:quantized=true,overlap=true}" \
            PEERS=${PEERS:-fsdp2} STEPS=${STEPS:-8} MATRIX_TIMEOUT=$(( $(left) - 10 )) bash bench/run_matrix.sh "$out" "${REGIME:-pcie}" 2>&1 | tail -n 10
        d="$out/matrix_dp2_${REGIME:-pcie}"
        [ -d "$d/logs" ] && tar czf "$out/logs_${REGIME:-pcie}.tgz" -C "$d" logs && rm -rf "$d/logs"
        ;;
    *) echo "unknown phase $phase"; exit 2 ;;
esac
echo "phase $phase done in $(( $(date +%s) - start )) s"
