#!/usr/bin/env bash
# Whole-step matrix (issues 4 and 7) on a 2-GPU host: for each link regime, bench/steps_matrix.py
# runs every arm in fresh processes, rounds order-balanced (ABCD, DCBA, ...), for a
# Qwen3-1.7B-shaped model, and tabulates each arm against the first arm and against the peers.
# qzero must already be installed there (DeepSpeed too, for its arm; a missing peer shows as failed).
# Usage (repository root, on the GPU machine): bash bench/run_matrix.sh OUTDIR [nvlink] [pcie] [ethernet]
# Environment: WORLD (2: ranks, one per GPU), PRESET (qwen3-1.7b), AG_BUCKET (5e8, the default of qzero and DeepSpeed), RS_BUCKET (5e7), STEPS (8), ROUNDS (2), MATRIX_TIMEOUT (560 s per regime), ARMS (space-separated
# NAME:key=value,... specs; default below), PEERS (deepspeed,fsdp2: those among the arms), REFERENCE.
set -u
out=${1:?usage: bash bench/run_matrix.sh OUTDIR [nvlink pcie ethernet]}
shift
regimes=("$@")
[ ${#regimes[@]} -gt 0 ] || regimes=(nvlink pcie ethernet)
for regime in "${regimes[@]}"; do
    case $regime in nvlink|pcie|ethernet) ;; *) echo "unknown regime '$regime' (nvlink, pcie or ethernet)"; exit 2 ;; esac
done
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
here=$(cd "$(dirname "$0")" && pwd)
read -r -a arms <<< "${ARMS:-plain: plain_ahead:overlap=true int8:quantized=true int8_ahead:quantized=true,overlap=true fsdp2:engine=fsdp2 deepspeed:engine=deepspeed}"
arm_args=()
names=" "
for a in "${arms[@]}"; do arm_args+=(--arm "$a"); names+="${a%%:*} "; done
peers=""
wanted=${PEERS-deepspeed,fsdp2}
for p in ${wanted//,/ }; do  # only the peers that are arms
    [[ "$names" == *" $p "* ]] && peers+="${peers:+,}$p"
done
extra=()
[ -n "$peers" ] && extra+=(--peers "$peers")
[ -n "${REFERENCE:-}" ] && extra+=(--reference "$REFERENCE")
world=${WORLD:-2}
common=(--device cuda --world-size "$world" --preset "${PRESET:-qwen3-1.7b}" --seq-len 2048 --micro-batch 2
        --steps "${STEPS:-8}" --warmup 2 --allgather-bucket "${AG_BUCKET:-5e8}" --reduce-bucket "${RS_BUCKET:-5e7}" --lr 1e-4
        --rounds "${ROUNDS:-2}")
status=0
for regime in "${regimes[@]}"; do
    case $regime in
        nvlink) envs=() ;;
        pcie) envs=(NCCL_P2P_DISABLE=1) ;;
        ethernet) envs=(NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1) ;;
    esac
    dir="$out/matrix_dp${world}_$regime"
    echo "=== $regime: ${envs[*]:-default NCCL} -> $dir"
    env "${envs[@]}" timeout "${MATRIX_TIMEOUT:-560}" python3 "$here/steps_matrix.py" "${common[@]}" \
        "${arm_args[@]}" "${extra[@]}" --regime-label "dp$world $regime" --out "$dir"
    rc=$?
    if [ $rc -ne 0 ]; then
        status=1
        echo "=== $regime: exit $rc$([ $rc -eq 124 ] && echo ' (timed out)')"
        # a run cut short still leaves the table of what it measured
        [ -f "$dir/matrix.md" ] && tail -n "$(( ${#arms[@]} + 2 ))" "$dir/matrix.md"
    fi
done
exit $status
