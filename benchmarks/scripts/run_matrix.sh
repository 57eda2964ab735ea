#!/usr/bin/env bash
# Step time per link regime (whole training steps) on a 2-GPU host: for each link regime, qzero bench steps
# runs every arm in fresh processes, rounds order-balanced (ABCD, DCBA, ...), for a
# Qwen3-1.7B-shaped model, and tabulates each arm against the first arm and against the peers.
# Installs this checkout first (benchmarks/scripts/regimes.sh; DeepSpeed must be installed for its arm: a missing peer shows as failed).
# Usage (repository root, on the GPU machine): bash benchmarks/scripts/run_matrix.sh OUTDIR [nvlink] [pcie] [ethernet]
# Environment: WORLD (2: ranks, one per GPU), PRESET (qwen3-1.7b), ALLGATHER_BUCKET_SIZE (5e8, the default of qzero and DeepSpeed), REDUCE_BUCKET_SIZE (5e7), STEPS (10: 2 warm up, the last is not timed), ROUNDS (2), MATRIX_TIMEOUT (560 s per regime), ARMS (space-separated
# NAME:key=value,... specs; default below), PEERS (deepspeed,fsdp2: those among the arms), REFERENCE.
set -u
out=${1:?usage: bash benchmarks/scripts/run_matrix.sh OUTDIR [nvlink pcie ethernet]}
shift
regimes=("$@")
here=$(cd "$(dirname "$0")" && pwd)
. "$here/regimes.sh"
[ ${#regimes[@]} -gt 0 ] || regimes=("${REGIMES[@]}")
for regime in "${regimes[@]}"; do regime_env "$regime" || exit 2; done
mkdir -p "$out"
qzero_install || exit 1
read -r -a arms <<< "${ARMS:-plain: plain_ahead:overlap=true int8:quantized=true,overlap=false int8_ahead:quantized=true,overlap=true fsdp2:backend=fsdp2 deepspeed:backend=deepspeed}"
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
        --steps "${STEPS:-10}" --warmup 2 --allgather-bucket-size "${ALLGATHER_BUCKET_SIZE:-5e8}" --reduce-bucket-size "${REDUCE_BUCKET_SIZE:-5e7}" --lr 1e-4
        --rounds "${ROUNDS:-2}")
status=0
for regime in "${regimes[@]}"; do
    regime_env "$regime"
    dir="$out/matrix_dp${world}_$regime"
    echo "=== $regime: ${REGIME_ENV[*]} -> $dir"
    env "${REGIME_ENV[@]}" timeout "${MATRIX_TIMEOUT:-560}" python3 -m qzero bench steps "${common[@]}" \
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
