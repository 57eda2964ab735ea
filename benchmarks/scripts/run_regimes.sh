#!/usr/bin/env bash
# The gather alone at world size 2 in each link regime (benchmarks/scripts/regimes.sh), on a host with two
# NVLink-connected GPUs: benchmarks/scripts/gather_bench.py writes OUTDIR/gather_dp2_REGIME.{json,md}.
# Usage (repository root): bash benchmarks/scripts/run_regimes.sh OUTDIR [REGIME...] [-- gather_bench args...]
#   e.g. bash benchmarks/scripts/run_regimes.sh OUT pcie ethernet -- --sizes 2048Mi --formats int8,int4 --rounds 8
# Environment: REGIME_TIMEOUT (200 s per regime).
set -u
out=${1:?usage: bash benchmarks/scripts/run_regimes.sh OUTDIR [REGIME...] [-- gather_bench args...]}
shift
here=$(cd "$(dirname "$0")" && pwd)
. "$here/regimes.sh"
regimes=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do regime_env "$1" || exit 2; regimes+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
[ ${#regimes[@]} -gt 0 ] || regimes=("${REGIMES[@]}")
mkdir -p "$out"
qzero_install || exit 1
status=0
for regime in "${regimes[@]}"; do
    regime_env "$regime"
    echo "=== $regime: ${REGIME_ENV[*]}"
    env "${REGIME_ENV[@]}" timeout "${REGIME_TIMEOUT:-200}" python3 -m torch.distributed.run --nproc_per_node=2 \
        -m qzero.app.benchmarks.gather --out "$out" --tag "gather_dp2_$regime" "$@" || status=1
done
exit $status
