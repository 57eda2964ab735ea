#!/usr/bin/env bash
# The DeepSpeed adapter on a 2-GPU host without network: install the wheelhouse .whl/ and
# qzero, then run benchmarks/scripts/deepspeed_gpu_check.py (NCCL, ZeRO-2 and ZeRO-1).
# Usage (repository root): bash benchmarks/scripts/run_deepspeed_gpu.sh OUTDIR [check args...]
# Writes OUTDIR/deepspeed_gpu_check.log and OUTDIR/deepspeed_gpu_check.json; exits with the check's status.
set -u
out=${1:-OUT}
shift || true
cd "$(dirname "$0")/.."
mkdir -p "$out"
. benchmarks/scripts/regimes.sh
export DS_BUILD_OPS=0
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/torch_extensions}

qzero_install || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null
python3 -c "import torch, deepspeed, qzero; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'deepspeed', deepspeed.__version__, 'gpus', torch.cuda.device_count())"

t0=$(date +%s)
timeout "${CHECK_TIMEOUT:-240}" python3 -m torch.distributed.run --nproc_per_node=2 \
    benchmarks/scripts/deepspeed_gpu_check.py --out "$out/deepspeed_gpu_check.json" "$@" 2>&1 | tee "$out/deepspeed_gpu_check.log"
rc=${PIPESTATUS[0]}
echo "deepspeed_gpu_check: rc=$rc in $(( $(date +%s) - t0 )) s"
exit "$rc"
