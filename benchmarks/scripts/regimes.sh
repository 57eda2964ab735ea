#!/usr/bin/env bash
# The link regimes and the install step shared by the bench scripts (one place for both).
#
# Two GPUs of one host are joined by NVLink; slower links are emulated by pushing NCCL onto
# other transports:
#
#   regime     NCCL settings                            the bytes travel over
#   nvlink     (defaults)                               NVLink, GPU to GPU
#   pcie       NCCL_P2P_DISABLE=1                       host shared memory, over each GPU's PCIe link
#   ethernet   NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1    NCCL's sockets over the host's loopback
#
# NVLink SHARP (NCCL_NVLS_ENABLE) is off in every regime.
#
# Sourced by the scripts (`. benchmarks/scripts/regimes.sh`): defines REGIMES, regime_env NAME (sets the
# array REGIME_ENV, or fails naming the regime) and qzero_install (the wheelhouse .whl/ if
# there is one, then this checkout, editable, without touching torch; SKIP_INSTALL=1 skips it).
# Run directly, it runs a command in one regime:
#   bash benchmarks/scripts/regimes.sh pcie python3 -m torch.distributed.run --nproc_per_node=2 benchmarks/scripts/step_profile.py
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 HF_HUB_OFFLINE=1
REGIMES=(nvlink pcie ethernet)

regime_env() {
    case $1 in
        nvlink) REGIME_ENV=(NCCL_NVLS_ENABLE=0) ;;
        pcie) REGIME_ENV=(NCCL_NVLS_ENABLE=0 NCCL_P2P_DISABLE=1) ;;
        ethernet) REGIME_ENV=(NCCL_NVLS_ENABLE=0 NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1) ;;
        *) echo "unknown link regime '$1' (one of: ${REGIMES[*]})" >&2; return 2 ;;
    esac
}

qzero_install() {
    [ -n "${SKIP_INSTALL:-}" ] && return 0
    local root log
    root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
    log=$(mktemp)
    if [ -d "$root/.whl" ]; then bash "$root/benchmarks/scripts/install_wheels.sh" "$root/.whl" >>"$log" 2>&1; fi
    if ! python3 -m pip install -q --no-deps --no-build-isolation -e "$root" >>"$log" 2>&1; then
        echo "installing qzero from $root failed:"; tail "$log"; rm -f "$log"; return 1
    fi
    rm -f "$log"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then  # run, not sourced
    set -u
    regime_env "${1:?usage: bash benchmarks/scripts/regimes.sh REGIME COMMAND [ARGS...]}" || exit 2
    shift
    exec env "${REGIME_ENV[@]}" "$@"
fi
