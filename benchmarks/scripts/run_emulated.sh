#!/usr/bin/env bash
# The emulated link on one GPU, calibrated and used, within LIMIT seconds (benchmarks/scripts/emulated_link.py,
# benchmarks/scripts/emulated_matrix.py, benchmarks/scripts/emulated_calibration.py):
#   check      every emulated collective on the GPU; what a resident CTA costs (contention)
#   floor      the 1-GPU step of Qwen3-4B here -> the time scale S against the two-GPU host
#   grid       the seed's 4B PCIe-class arms at several resident-CTA counts (and NVLink) -> the fitted count
#   targets    the other 4B arms at the fitted count, PCIe-class and NVLink
#   slice      the 4B slice of the targets at the fitted count: PCIe-class, NVLink and Ethernet-class links,
#              and a PCIe-class link with PROBE (48) resident CTAs for the arms the fit is most sensitive to
#   ethernet50 the two arms of the committed 4B Ethernet-class result at its 50M/50M buckets
#   lowbit     the 4-bit payloads (INT4 delta weights, INT4 gradients, both) beside INT8 + gather-ahead,
#              INT8 gradients and FSDP2, Ethernet-class, PCIe-class and NVLink
#   kernels    the CUDA kernel tests, and tests/gpu/workers/gpu_check.py with both ranks on this GPU (--share-gpu)
#   sweep      gather-ahead against the synchronous gather at the gather buckets SWEEP_AG (2e7 5e8),
#              and INT8 + gather-ahead against FSDP2 at 5e8/5e7; three links
#   deepspeed  plain DeepSpeed and the DeepSpeed adapter with gather-ahead, alone and with quantized gradients,
#              in one run; PCIe-class, Ethernet-class
#   small      Qwen3-1.7B at 5e8/5e7: plain, INT8, INT8 + gather-ahead, FSDP2; three links
#   lowbit500  the 4-bit payloads at 5e8 gather / 5e7 reduce buckets, LOWBIT500_LINKS (Ethernet-class and PCIe-class)
#   scale      rank 0 of DP-N for N in SCALE_WORLDS (4 8 64): INT8 + gather-ahead, INT8 gradients, the
#              4-bit payloads, FSDP2; Ethernet-class and PCIe-class
#   cluster    emulated clusters (benchmarks/scripts/emulated_cluster.py): for each of CLUSTER_NODES (2) nodes x CLUSTER_GPUS (4),
#              CLUSTER_INTRA_GBPS (25.2) inside a node, CLUSTER_INTER_GBPS (12.5) per NIC, CLUSTER_NIC (shared), and the fabrics
#              of CLUSTER_FABRICS in the same processes (e.g. "none:ctas=16;intra_gbps=290;inter_gbps=25;nic=rail"); the
#              one-GPU floor, FSDP2 and each of CLUSTER_ARMS (int8_ahead delta_ahead_qgrad4_g256) two-level and flat
#              (NAME_flat); at the fitted contention
#   table      the calibration table from everything measured
# Usage (repository root, one GPU): bash benchmarks/scripts/run_emulated.sh OUT [STAGE ...]   (default: all but ethernet)
# Environment: LIMIT (seconds for the whole script, default 550), S and CTAS (skip floor / grid when given),
# STEPS (6), WARMUP (2), ROUNDS (1), LOWBIT_ARMS, LOWBIT_LINKS, LOWBIT500_LINKS, KERNEL_TESTS, SKIP_GPU_CHECK, GRID ("0 4 8 16"), TARGET_ARMS, PROBE, QUICK_CHECK (skip the DP8 check and the CTA costs).
set -u
out=${1:?usage: bash benchmarks/scripts/run_emulated.sh OUT [stage ...]}
shift
stages=" ${*:-check floor grid targets table} "
here=$(cd "$(dirname "$0")" && pwd)
limit=${LIMIT:-550}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 HF_HUB_OFFLINE=1
# this checkout's qzero, installed or not
export PYTHONPATH="$(cd "$here/.." && pwd)/src${PYTHONPATH:+:$PYTHONPATH}"
[ -d .whl ] && bash "$here/install_wheels.sh" .whl > "$out/install.log" 2>&1
common=(--device cuda --world-size 2 --seq-len 2048 --micro-batch 2 --lr 1e-4 --rounds "${ROUNDS:-1}"
        --steps "${STEPS:-6}" --warmup "${WARMUP:-2}" --arm-timeout 240)
spec() { python3 -c "import sys; sys.path.insert(0, '$here'); import emulated_calibration as c; print(c.arm_spec('$1'))"; }
arms() { local a; for a in "$@"; do printf -- '--arm\n%s\n' "$(spec "$a")"; done; }
left() { echo $(( limit - SECONDS - ${1:-30} )); }
has() { [[ "$stages" == *" $1 "* ]]; }
links_of() { local l s=""; for l in "$@"; do s+="${s:+,}$l:$k"; done; echo "$s"; }  # REGIME ... -> --links, at $k

if has check; then
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv > "$out/check.log" 2>&1
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$out/check.log" 2>&1
    timeout 120 python3 "$here/emulated_link.py" --check >> "$out/check.log" 2>&1
    if [ -z "${QUICK_CHECK:-}" ]; then
        timeout 120 python3 "$here/emulated_link.py" --check --world 8 >> "$out/check.log" 2>&1
        timeout 90 python3 "$here/emulated_calibration.py" contention --out "$out/contention.json" > "$out/contention.log" 2>&1
    fi
fi
S=${S:-}
if has floor; then  # the 1-GPU step here (and S from it, unless given)
    mapfile -t a < <(arms gpu1)
    python3 "$here/emulated_matrix.py" "${common[@]}" --presets qwen3-4b --allgather-bucket-sizes 5e7 --reduce-bucket-sizes 2.6e7 \
        --links none "${a[@]}" --budget "$(left 300)" --out "$out/floor_4b" > "$out/floor_4b.log" 2>&1
    [ -n "$S" ] || S=$(python3 "$here/emulated_calibration.py" scale "$out/floor_4b" 2>>"$out/floor_4b.log")
fi
S=${S:-1}
echo "time scale S=$S"
CTAS=${CTAS:-}
if [ -z "$CTAS" ] && has grid; then
    links=""
    for k in ${GRID:-0 4 8 16}; do links+="${links:+,}pcie:ctas=$k;time_scale=$S"; done
    for k in ${GRID:-0 4 8 16}; do links+=",nvlink:ctas=$k;time_scale=$S"; done
    mapfile -t a < <(arms int8_ahead fsdp2 plain_ahead plain int8)
    python3 "$here/emulated_matrix.py" "${common[@]}" --presets qwen3-4b --allgather-bucket-sizes 5e7 --reduce-bucket-sizes 2.6e7 \
        --links "$links" "${a[@]}" --reference plain --budget "$(left 200)" --out "$out/grid_4b" > "$out/grid_4b.log" 2>&1
    CTAS=$(python3 "$here/emulated_calibration.py" fit "$out/floor_4b" "$out/grid_4b" --scale "$S" \
        --out "$out/fit.json" 2>>"$out/grid_4b.log")
fi
CTAS=${CTAS:-0}
echo "resident CTAs CTAS=$CTAS"
if has targets; then  # the other 4B arms at the fitted count, PCIe-class and NVLink
    mapfile -t a < <(arms ${TARGET_ARMS:-int8_ahead_qgrad fsdp2_rs fsdp2_rs_gint8 ds_int8_ahead deepspeed fsdp2_rs_int8})
    python3 "$here/emulated_matrix.py" "${common[@]}" --presets qwen3-4b --allgather-bucket-sizes 5e7 --reduce-bucket-sizes 2.6e7 \
        --links "pcie:ctas=$CTAS;time_scale=$S,nvlink:ctas=$CTAS;time_scale=$S" "${a[@]}" \
        --budget "$(left 25)" --out "$out/targets_4b" > "$out/targets_4b.log" 2>&1
fi
k="ctas=$CTAS;time_scale=$S"
if has slice; then  # the 4B slice of the targets, every link, in one machine's processes
    mapfile -t a < <(arms int8_ahead int8 plain fsdp2)
    python3 "$here/emulated_matrix.py" "${common[@]}" --presets qwen3-4b --allgather-bucket-sizes 5e7 --reduce-bucket-sizes 2.6e7 \
        --links "pcie:$k,nvlink:$k,ethernet:$k,pcie:ctas=${PROBE:-48};time_scale=$S,pcie:ctas=32;spin=1;time_scale=$S" "${a[@]}" --reference plain \
        --peers fsdp2 --budget "$(left 230)" --out "$out/slice_4b" > "$out/slice_4b.log" 2>&1
    mapfile -t a < <(arms int8_ahead_qgrad plain_ahead fsdp2_rs_gint8 fsdp2_rs)
    python3 "$here/emulated_matrix.py" "${common[@]}" --presets qwen3-4b --allgather-bucket-sizes 5e7 --reduce-bucket-sizes 2.6e7 \
        --links "pcie:$k,nvlink:$k,ethernet:$k" "${a[@]}" --budget "$(left 80)" \
        --out "$out/slice2_4b" > "$out/slice2_4b.log" 2>&1
    mapfile -t a < <(arms ds_int8_ahead)
    python3 "$here/emulated_matrix.py" "${common[@]}" --presets qwen3-4b --allgather-bucket-sizes 5e7 --reduce-bucket-sizes 2.6e7 \
        --links "pcie:$k,nvlink:$k" "${a[@]}" --budget "$(left 45)" \
        --out "$out/slice3_4b" > "$out/slice3_4b.log" 2>&1
fi
if has ethernet50; then  # the committed 4B Ethernet-class results' buckets
    mapfile -t a < <(arms fsdp2 int8_ahead_qgrad)
    python3 "$here/emulated_matrix.py" "${common[@]}" --presets qwen3-4b --allgather-bucket-sizes 5e7 --reduce-bucket-sizes 5e7 \
        --links "ethernet:$k" "${a[@]}" --budget "$(left 15)" --out "$out/ethernet50_4b" > "$out/ethernet50_4b.log" 2>&1
fi
if has lowbit; then  # the 4-bit payloads, every link
    mapfile -t a < <(arms ${LOWBIT_ARMS:-delta_ahead_qgrad4 int8_ahead_qgrad4 delta_ahead int8_ahead_qgrad int8_ahead fsdp2})
    lk=$(links_of ${LOWBIT_LINKS:-ethernet pcie nvlink})
    python3 "$here/emulated_matrix.py" "${common[@]}" --presets qwen3-4b --allgather-bucket-sizes 5e7 --reduce-bucket-sizes 2.6e7 \
        --links "$lk" "${a[@]}" --budget "$(left 15)" --out "$out/lowbit_4b" > "$out/lowbit_4b.log" 2>&1
fi
if has kernels; then  # the CUDA kernels and the gather engine's streams on this GPU
    t0=$SECONDS
    tests=()
    for t in ${KERNEL_TESTS:-test_triton test_delta_kernels test_grad_quant test_engine_streams}; do tests+=("$here/../../tests/$t.py"); done
    reserve=200; [ -n "${SKIP_GPU_CHECK:-}" ] && reserve=${TESTS_RESERVE:-15}
    timeout "$(left $reserve)" python3 -m pytest -q -p no:cacheprovider -W ignore::FutureWarning "${tests[@]}" \
        > "$out/kernel_tests.log" 2>&1
    echo "kernel tests: rc=$? in $((SECONDS - t0)) s: $(tail -n 1 "$out/kernel_tests.log")"
    if [ -z "${SKIP_GPU_CHECK:-}" ]; then
        t0=$SECONDS
        timeout "$(left 10)" python3 -m torch.distributed.run --nproc_per_node=2 "$here/../../tests/gpu/workers/gpu_check.py" --share-gpu ${CHECK_ARGS:---delays} \
            > "$out/gpu_check.log" 2>&1
        echo "gpu_check --share-gpu: rc=$? in $((SECONDS - t0)) s, $(grep -c '^PASS' "$out/gpu_check.log") PASS, $(grep -c '^FAIL' "$out/gpu_check.log") FAIL"
    fi
fi
if has sweep; then  # gather-ahead against the synchronous gather at other gather buckets; FSDP2 at 5e8/5e7
    mapfile -t a < <(arms int8_ahead int8)
    python3 "$here/emulated_matrix.py" "${common[@]}" --presets qwen3-4b --allgather-bucket-sizes "$(echo ${SWEEP_AG:-2e7 5e8} | tr ' ' ,)" \
        --reduce-bucket-sizes 2.6e7 --links "pcie:$k,ethernet:$k,nvlink:$k" "${a[@]}" --reference int8 \
        --budget "$(left 130)" --out "$out/sweep_4b" > "$out/sweep_4b.log" 2>&1
    mapfile -t a < <(arms int8_ahead fsdp2)
    python3 "$here/emulated_matrix.py" "${common[@]}" --presets qwen3-4b --allgather-bucket-sizes 5e8 --reduce-bucket-sizes 5e7 \
        --links "pcie:$k,ethernet:$k" "${a[@]}" --peers fsdp2 --budget "$(left 15)" --out "$out/ag5e8_rs5e7_4b" > "$out/ag5e8_rs5e7_4b.log" 2>&1
fi
if has deepspeed; then  # DeepSpeed and the adapter (with and without quantized gradients) in one run
    mapfile -t a < <(arms ds_int8_ahead ds_int8_ahead_qgrad deepspeed)
    python3 "$here/emulated_matrix.py" "${common[@]}" --presets qwen3-4b --allgather-bucket-sizes 5e7 --reduce-bucket-sizes 2.6e7 \
        --links "pcie:$k,ethernet:$k" "${a[@]}" --reference deepspeed --budget "$(left 15)" \
        --out "$out/deepspeed_4b" > "$out/deepspeed_4b.log" 2>&1
fi
if has small; then  # Qwen3-1.7B at the buckets of its real results
    mapfile -t a < <(arms int8_ahead plain int8 fsdp2)
    python3 "$here/emulated_matrix.py" "${common[@]}" --presets qwen3-1.7b --allgather-bucket-sizes 5e8 --reduce-bucket-sizes 5e7 \
        --links "pcie:$k,ethernet:$k,nvlink:$k" "${a[@]}" --reference plain --peers fsdp2 --budget "$(left 15)" \
        --out "$out/small_1.7b" > "$out/small_1.7b.log" 2>&1
fi
if has lowbit500; then  # the 4-bit payloads at the larger buckets
    mapfile -t a < <(arms ${LOWBIT_ARMS:-delta_ahead_qgrad4 int8_ahead_qgrad4 delta_ahead int8_ahead_qgrad int8_ahead})
    lk=$(links_of ${LOWBIT500_LINKS:-ethernet pcie})
    python3 "$here/emulated_matrix.py" "${common[@]}" --presets qwen3-4b --allgather-bucket-sizes 5e8 --reduce-bucket-sizes 5e7 \
        --links "$lk" "${a[@]}" --budget "$(left 15)" --out "$out/lowbit500_4b" > "$out/lowbit500_4b.log" 2>&1
fi
if has scale; then  # DP-N: rank 0's shard and ring bytes (N-1)/N of a larger world
    for n in ${SCALE_WORLDS:-4 8 64}; do
        mapfile -t a < <(arms ${SCALE_ARMS:-int8_ahead fsdp2 int8_ahead_qgrad delta_ahead_qgrad4})
        python3 "$here/emulated_matrix.py" "${common[@]}" --presets qwen3-4b --allgather-bucket-sizes 5e7 \
            --reduce-bucket-sizes 2.6e7 --links "ethernet:$k,pcie:$k" "${a[@]}" --world-size "$n" --budget "$(left 15)" \
            --out "$out/dp${n}_4b_scale" > "$out/dp${n}_4b_scale.log" 2>&1
    done
fi
if has cluster; then  # every collective charged by the cluster cost model for the whole group
    for nodes in ${CLUSTER_NODES:-2}; do
        a=(--arm "$(spec gpu1)" --arm "$(spec fsdp2)")
        for n in ${CLUSTER_ARMS:-int8_ahead delta_ahead_qgrad4_g256}; do
            a+=(--arm "$(spec "$n")" --arm "$(spec "$n" | sed 's/^\([^:]*\):/\1_flat:/'),hierarchical_collectives=false")
        done
        python3 "$here/emulated_matrix.py" "${common[@]}" --world-size "$(( nodes * ${CLUSTER_GPUS:-4} ))" --presets qwen3-4b \
            --allgather-bucket-sizes 5e7 --reduce-bucket-sizes 2.6e7 --nodes "$nodes" --gpus-per-node "${CLUSTER_GPUS:-4}" \
            --intra-gbps "${CLUSTER_INTRA_GBPS:-25.2}" --inter-gbps "${CLUSTER_INTER_GBPS:-12.5}" --nic "${CLUSTER_NIC:-shared}" \
            --links "none:$k${CLUSTER_FABRICS:+,$CLUSTER_FABRICS}" "${a[@]}" --peers fsdp2 --budget "$(left 15)" \
            --out "$out/cluster_${nodes}x${CLUSTER_GPUS:-4}" > "$out/cluster_${nodes}x${CLUSTER_GPUS:-4}.log" 2>&1
    done
fi
if has table; then
    dirs=()
    for d in "$out"/*_4b "$out"/*_1.7b; do [ -d "$d" ] && dirs+=("$d"); done
    if [ ${#dirs[@]} -gt 0 ]; then
        python3 "$here/emulated_calibration.py" table "${dirs[@]}" --scale "$S" --ctas "$CTAS" --out "$out/calibration"
    else
        echo "table: no stage folder with results in $out" >&2
    fi
fi
exit 0
