#!/usr/bin/env bash
# One call on a 2-GPU machine: GPU tests + single-GPU kernel benchmark (run_device.sh),
# then the world-size-2 gather in the three link regimes (run_regimes.sh). Leaves at most
# 8 files in OUTDIR: logs in one file, regime results as JSON (render Markdown with --render).
# Usage: bash bench/run_all.sh OUTDIR
set -u
out=${1:-bench/results}
bash bench/run_device.sh "$out"
bash bench/run_regimes.sh "$out" --rounds "${ROUNDS:-9}" >"$out/regimes.log" 2>&1
grep -v "^\[W\|Warning\|warn(" "$out/regimes.log" | tail -n 45
cat "$out/gpu_tests.log" "$out/bench.log" "$out/regimes.log" > "$out/logs.txt"
rm -f "$out/gpu_tests.log" "$out/bench.log" "$out/regimes.log" "$out"/gather_dp2_*.md
ls "$out"
