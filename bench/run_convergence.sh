#!/usr/bin/env bash
# Convergence: does training with the quantized gather reach the plain gather's loss? On a 2-GPU host: five arms (bf16 plain gather,
# INT8 g64, INT8 g8192, FP8 g64, INT4 g64) of a 125M-parameter Qwen3-shaped model
# (preset qwen3-125m-byte), 2000 steps of 16 x 512 bytes of the stdlib text corpus, bf16, all
# arms at once as world-size-1 runs (3 on GPU 0, 2 on GPU 1). Estimated ~4 min of wall time
# (see bench/convergence.py); TIME_LIMIT (default 520 s) stops the arms early, and the report
# then compares them over the steps all of them completed.
# Usage (repository root, on the GPU machine): bash bench/run_convergence.sh [OUTDIR] [convergence.py args...]
set -u
out=${1:-bench/results/convergence}
shift || true
mkdir -p "$out"
here=$(cd "$(dirname "$0")" && pwd)
. "$here/regimes.sh"
qzero_install || exit 1
nvidia-smi --query-gpu=index,name,driver_version,memory.used --format=csv,noheader
python3 -c "import torch, transformers, matplotlib; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'matplotlib', matplotlib.__version__)"
python3 "$here/convergence.py" --device cuda --out "$out" --time-limit "${TIME_LIMIT:-520}" "$@"
