#!/usr/bin/env bash
# Does gather-ahead hold at every bucket, on every link? The whole-step matrix over models x
# gather buckets x reduce buckets x link regimes on a 2-GPU host, each cell one
# bench/run_matrix.sh run (fresh processes, order-balanced rounds, per-step CUDA-event medians
# beside the wall time of the measured steps between two device-wide syncs).
#
# Arms: a 1-GPU compute-only floor (`gpu1`: world size 1, no communication), qzero plain and
# INT8, each synchronous and with gather-ahead, FSDP2 (reshard_after_forward=False) and
# DeepSpeed ZeRO-2 (it must be installed: bench/install_wheels.sh).
#
# Usage (repository root, on the GPU machine): bash bench/overlap_sweep.sh OUTDIR
# Environment (space-separated lists; the full default grid takes hours, pick a slice):
#   PRESETS      (qwen3-1.7b qwen3-4b)
#   ALLGATHER_BUCKET_SIZES   (2e7 5e7 2e8 5e8)   gather bucket, elements across all ranks
#   REDUCE_BUCKET_SIZES   (2.6e7 5e7)         reduce bucket
#   SWEEP_REGIMES (nvlink pcie ethernet)
#   ROUNDS (2), STEPS (10), MATRIX_TIMEOUT (per cell, 560 s), ARMS (to override the arms)
# Output: OUTDIR/PRESET_agAG_rsRS/matrix_dp2_REGIME/matrix.{json,md}, steps.png, and a
# one-line-per-cell summary OUTDIR/summary.md (gather-ahead / synchronous ratios per format).
set -u
out=${1:?usage: bash bench/overlap_sweep.sh OUTDIR}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
arms=${ARMS:-"gpu1:world_size=1 plain:overlap=false plain_ahead:overlap=true int8:quantized=true,overlap=false int8_ahead:quantized=true,overlap=true fsdp2:backend=fsdp2 deepspeed:backend=deepspeed"}
status=0
for preset in ${PRESETS:-qwen3-1.7b qwen3-4b}; do
    for ag in ${ALLGATHER_BUCKET_SIZES:-2e7 5e7 2e8 5e8}; do
        for rs in ${REDUCE_BUCKET_SIZES:-2.6e7 5e7}; do
            cell="$out/${preset}_ag${ag}_rs${rs}"
            echo "=== $preset, gather bucket $ag, reduce bucket $rs"
            PRESET=$preset ALLGATHER_BUCKET_SIZE=$ag REDUCE_BUCKET_SIZE=$rs ARMS=$arms REFERENCE=plain \
                bash "$here/run_matrix.sh" "$cell" ${SWEEP_REGIMES:-nvlink pcie ethernet} || status=1
            SKIP_INSTALL=1  # installed once is enough
            export SKIP_INSTALL
        done
    done
done
python3 - "$out" <<'EOF'
import glob, json, os, statistics, sys
out = sys.argv[1]
# speedups are median(other) / median(arm) (> 1: faster); the last column is a step-time ratio
rows = ["| cell | regime | plain: gather-ahead speedup | int8: gather-ahead speedup | int8_ahead speedup over fsdp2 "
        "| int8_ahead step / 1-GPU step |", "|---|---|---|---|---|---|"]
for path in sorted(glob.glob(os.path.join(out, "*", "matrix_dp*_*", "matrix.json"))):
    m = json.load(open(path))
    med = {a["arm"]: a.get("median_step_s") for a in m.get("analysis", {}).get("arms", [])}
    def r(a, b):
        return f"{med[b] / med[a]:.3f}" if med.get(a) and med.get(b) else "—"
    cell, regime = path.split(os.sep)[-3], path.split(os.sep)[-2].split("_")[-1]
    rows.append(f"| {cell} | {regime} | {r('plain_ahead', 'plain')} | {r('int8_ahead', 'int8')} | "
                f"{r('int8_ahead', 'fsdp2')} | {med['int8_ahead'] / med['gpu1']:.3f} |" if med.get("int8_ahead") and med.get("gpu1")
                else f"| {cell} | {regime} | {r('plain_ahead', 'plain')} | {r('int8_ahead', 'int8')} | {r('int8_ahead', 'fsdp2')} | — |")
open(os.path.join(out, "summary.md"), "w").write("\n".join(rows) + "\n")
print("\n".join(rows))
EOF
exit $status
