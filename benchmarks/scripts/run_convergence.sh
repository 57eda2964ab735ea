#!/usr/bin/env bash
# Convergence: does training with the quantized gather reach the plain gather's loss? On a 2-GPU host: five arms (bf16 plain gather,
# INT8 g64, INT8 g8192, FP8 g64, INT4 g64) of a 125M-parameter Qwen3-shaped model
# (preset qwen3-125m-byte), 2000 steps of 16 x 512 bytes of the stdlib text corpus, bf16, all
# arms at once as world-size-1 runs (3 on GPU 0, 2 on GPU 1). Estimated ~4 min of wall time
# (see benchmarks/scripts/convergence.py); TIME_LIMIT (default 520 s) stops the arms early, and the report
# then compares them over the steps all of them completed.
#
# WORLD=2: the gradient study instead. Every arm is one DP2 job on both GPUs (rank r on GPU r),
# four at once: ARMS (default bf16,int8-g64,int8-g64+gq-int8-g64,int8-g64+gq-int8-g256; "+gq-..."
# quantizes the gradient reduction), 2000 steps of a global batch of MICRO_BATCH (default 8, the
# global batch of the committed world-1 study: 4 x 512 bytes per rank) sequences. Expected wall
# time ~3-4 min: ~130 s of training estimated from the world-1 study's measured ~111 TFLOP/s per
# shared H200 (4 arms x 2048 tokens per rank and step on each GPU, plus each rank's ~250 MB of plain
# gradient and weight traffic per step at 100 GB/s), plus ~60 s of start-up; arms of two ranks that
# wait for each other while sharing GPUs with three other arms may well run slower, so TIME_LIMIT
# defaults to 330 s there (report after ~5.5-6 min at the latest).
#
# SEEDS="4 5 6": one study per seed, all at once on the GPU(s) (one driver each, into OUTDIR/seedN,
# started 3 s apart, one CPU thread per rank), then benchmarks/scripts/convergence_seeds.py over them
# (OUTDIR/seeds/, against TARGET, default 0.25 %). Six arms of two ranks (three seeds of two arms)
# fill one H200: about 500 s for 2000 steps of the 125M preset. MPS=1 runs them under the CUDA
# Multi-Process Service (started here, stopped at the end; pipe and log folders in /tmp), so the
# arms' kernels run at once instead of in time slices: three seeds in about 310 s, four in 455 s
# (87 GB of the H200 for eight arms). A daemon already running at CUDA_MPS_PIPE_DIRECTORY is used
# as it is and left running; if none runs and one cannot start, the seeds run without it.
# SEEDS_AT_ONCE=N runs the seeds N at a time (default: all at once), so a whole study is one command:
#   MPS=1 SEEDS="$(seq -s ' ' 0 23)" SEEDS_AT_ONCE=4 WORLD=2 ARMS=bf16,int4-delta-g64 TIME_LIMIT=540 \
#       bash benchmarks/scripts/run_convergence.sh OUT --share-gpu --lr-warmup 100
#
# Usage (repository root, on the GPU machine): bash benchmarks/scripts/run_convergence.sh [OUTDIR] [convergence.py args...]
#   WORLD=2 bash benchmarks/scripts/run_convergence.sh OUTDIR
#   WORLD=2 ARMS=bf16,int8-g64+gq-int8-g64 MICRO_BATCH=16 TIME_LIMIT=480 bash benchmarks/scripts/run_convergence.sh OUTDIR
#   SEEDS="4 5 6" WORLD=2 ARMS=bf16,int4-delta-g256 TIME_LIMIT=530 bash benchmarks/scripts/run_convergence.sh OUTDIR --share-gpu
#   MPS=1 SEEDS="4 5 6 7" WORLD=2 ARMS=bf16,int4-delta-g256 TIME_LIMIT=545 bash benchmarks/scripts/run_convergence.sh OUTDIR --share-gpu
set -u
out=${1:-OUT/convergence}
shift || true
mkdir -p "$out"
here=$(cd "$(dirname "$0")" && pwd)
. "$here/regimes.sh"
qzero_install || exit 1
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=index,name,driver_version,memory.used --format=csv,noheader
python3 -c "import torch, transformers, matplotlib; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'matplotlib', matplotlib.__version__)"
world=${WORLD:-1}
if [ -n "${SEEDS:-}" ]; then
    mps=0
    if [ "${MPS:-0}" = 1 ]; then
        export CUDA_MPS_PIPE_DIRECTORY=${CUDA_MPS_PIPE_DIRECTORY:-/tmp/qzero_mps_pipe} \
            CUDA_MPS_LOG_DIRECTORY=${CUDA_MPS_LOG_DIRECTORY:-/tmp/qzero_mps_log}
        mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
        if [ -e "$CUDA_MPS_PIPE_DIRECTORY/control" ] && pgrep nvidia-cuda-mps >/dev/null && echo get_server_list | nvidia-cuda-mps-control >/dev/null 2>&1; then
            mps=2; echo "CUDA MPS: on (a daemon already running at $CUDA_MPS_PIPE_DIRECTORY; left running at the end)"
        elif nvidia-cuda-mps-control -d && python3 -c "import torch; torch.ones(1, device='cuda').sum().item()"; then
            mps=1; echo "CUDA MPS: on"
        else
            echo "CUDA MPS could not start: the seeds run without it"
            echo quit | nvidia-cuda-mps-control 2>/dev/null
            unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
        fi
    fi
    rc=0
    batch=${SEEDS_AT_ONCE:-0}
    pids=()
    for seed in $SEEDS; do
        SEEDS= SKIP_INSTALL=1 bash "$here/run_convergence.sh" "$out/seed$seed" "$@" --seed "$seed" --threads 1 \
            > "$out/seed$seed.log" 2>&1 &
        pids+=($!)
        sleep 3
        if [ "$batch" -gt 0 ] && [ ${#pids[@]} -ge "$batch" ]; then
            for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
            pids=()
        fi
    done
    for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
    [ $mps = 1 ] && { echo quit | nvidia-cuda-mps-control; }
    dirs=()
    for seed in $SEEDS; do
        tail -n 3 "$out/seed$seed.log"
        [ -f "$out/seed$seed/convergence.json" ] && dirs+=("$out/seed$seed")
    done
    [ ${#dirs[@]} -gt 0 ] && python3 "$here/convergence_seeds.py" "${dirs[@]}" --target "${TARGET:-0.25}" --out "$out/seeds"
    exit $rc
fi
if [ "$world" -gt 1 ]; then
    python3 "$here/convergence.py" --device cuda --out "$out" --world-size "$world" \
        --micro-batch "${MICRO_BATCH:-8}" --time-limit "${TIME_LIMIT:-330}" ${ARMS:+--arms "$ARMS"} "$@"
else
    python3 "$here/convergence.py" --device cuda --out "$out" --time-limit "${TIME_LIMIT:-520}" \
        ${ARMS:+--arms "$ARMS"} ${MICRO_BATCH:+--micro-batch "$MICRO_BATCH"} "$@"
fi
