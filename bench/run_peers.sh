#!/usr/bin/env bash
# Whole-step arms against the peers (issue 7), on a 2-GPU host: for each link regime,
# `qzero qualify` of DeepSpeed ZeRO-2 (unmodified) and of FSDP2 (fully_shard per layer,
# reshard_after_forward=False) as baselines against qzero INT8 g64 with gather-ahead.
# DeepSpeed must be importable there (carry its wheel and deps: see issue 7).
# Usage (repository root, on the GPU machine): bash bench/run_peers.sh OUTDIR
set -u
out=${1:-bench/results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
python3 -m pip install -q --no-deps --no-build-isolation -e . >/tmp/qzero_pip.log 2>&1 || { echo "pip install failed"; tail /tmp/qzero_pip.log; }
common=(--device cuda --world-size 2 --preset qwen3-1.7b --seq-len 2048 --micro-batch 2
        --steps "${STEPS:-12}" --warmup 2 --allgather-bucket 5e7 --reduce-bucket 5e7 --lr 1e-4
        --candidate quantized=true --candidate overlap=true)
for regime in nvlink pcie ethernet; do
    case $regime in
        nvlink) envs=() ;;
        pcie) envs=(NCCL_P2P_DISABLE=1) ;;
        ethernet) envs=(NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1) ;;
    esac
    for peer in deepspeed fsdp2; do
        echo "=== $regime vs $peer"
        env "${envs[@]}" timeout "${QUALIFY_TIMEOUT:-400}" qzero qualify "${common[@]}" \
            --baseline "engine=$peer" --out "$out/peer_${regime}_${peer}" 2>&1 | tail -n 2
    done
done
