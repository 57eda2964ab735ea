#!/usr/bin/env bash
# Clusters on one GPU: the cluster emulator's holds on CUDA, then Qwen3-4B on emulated 8x8 and 2x8 clusters, each
# arm's process on two fabrics (Ethernet: PCIe-class inside, 100 GbE shared; RoCE: NVLink inside, 200G a GPU), then
# the plan beside every arm (benchmarks/scripts/cluster_calibration.py). Every figure is emulated.
# Usage (repository root, one GPU): bash benchmarks/scripts/run_clusters.sh OUT   (about 10 minutes; STEPS, B8)
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 HF_HUB_OFFLINE=1 PYTHONPATH=$PWD/src:$PWD/benchmarks/scripts
W=${1:?usage: bash benchmarks/scripts/run_clusters.sh OUT}; mkdir -p "$W"; T0=$SECONDS
python3 -m pip install -q --no-deps --no-build-isolation -e . > $W/install.log 2>&1 || tail $W/install.log
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
timeout 90 python3 benchmarks/scripts/emulated_cluster.py --check --device cuda > $W/cluster_check.log 2>&1
rc=$?; echo "cluster check rc=$rc at $((SECONDS-T0)) s"; grep -E "PASS|FAIL" $W/cluster_check.log | head -20; tail -3 $W/cluster_check.log
[ $rc -ne 0 ] && { echo "the cluster emulator failed its check on this GPU: no matrix run"; exit 1; }
E="none:ctas=16"; R="none:ctas=16;intra_gbps=290;inter_gbps=25;nic=rail"
Q="quantized=true,overlap=true,zero_quantized_weights_delta=true,zero_quantized_gradients=true,zero_quantized_gradients_format=int4"
common=(--device cuda --presets qwen3-4b --seq-len 2048 --micro-batch 2 --lr 1e-4 --rounds 1 --steps ${STEPS:-5} --warmup 2 --arm-timeout 200 --gpus-per-node 8 --peers fsdp2 --links "$E,$R")
python3 benchmarks/scripts/emulated_matrix.py "${common[@]}" --nodes 8 --allgather-bucket-sizes 2e8 --reduce-bucket-sizes 2.5e7 \
  --arm gpu1:world_size=1 --arm fsdp2:backend=fsdp2 --arm q4_2l8:$Q,zero_quantized_gradients_intra_node=int8 --arm q4_flat:$Q,hierarchical_collectives=false \
  --arm q4_2l:$Q --arm int8_2l:quantized=true,overlap=true --arm q8_2l8:quantized=true,overlap=true,zero_quantized_gradients=true,zero_quantized_gradients_intra_node=int8 \
  --budget ${B8:-340} --out $W/c8x8 > $W/c8x8.log 2>&1
echo "8x8 rc=$? at $((SECONDS-T0)) s"; grep "emulated_matrix:" $W/c8x8.log | tail -32
left=$(( 575 - (SECONDS-T0) ))
python3 benchmarks/scripts/emulated_matrix.py "${common[@]}" --nodes 2 --allgather-bucket-sizes 1e8 --reduce-bucket-sizes 2.5e7 \
  --arm fsdp2:backend=fsdp2 --arm q4_2l8:$Q,zero_quantized_gradients_intra_node=int8 --arm q4_flat:$Q,hierarchical_collectives=false \
  --arm q4_2l8_il:$Q,zero_quantized_gradients_intra_node=int8,flat_order=interleaved --arm int8_2l:quantized=true,overlap=true --budget $left --out $W/c2x8 > $W/c2x8.log 2>&1
echo "2x8 rc=$? at $((SECONDS-T0)) s"; grep "emulated_matrix:" $W/c2x8.log | tail -22
python3 benchmarks/scripts/cluster_calibration.py $W/c8x8 $W/c2x8 --out $W/calibration
