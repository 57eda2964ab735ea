#!/usr/bin/env bash
# Build the wheelhouse .whl/ that benchmarks/scripts/install_wheels.sh installs on a GPU host without a
# package index: DeepSpeed (built from its source release, pure Python) and the packages it
# needs that a CUDA/PyTorch image usually lacks (hjson, pydantic and its core, annotated-types,
# typing-inspection), the binary ones for the GPU host's Python (PY, default 3.12, x86-64).
# Usage (repository root, on a machine that reaches the package index): bash benchmarks/scripts/make_wheelhouse.sh [DIR]
set -eu
dir=${1:-.whl}
py=${PY:-3.12}
mkdir -p "$dir"
pip download -q --no-deps -d "$dir" "deepspeed==${DEEPSPEED:-0.19.8}" hjson "pydantic==${PYDANTIC:-2.13.4}" \
    annotated-types typing-inspection
pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dir" "pydantic-core==${PYDANTIC_CORE:-2.46.4}"
for sdist in "$dir"/deepspeed-*.tar.gz; do
    [ -e "$sdist" ] || continue
    pip wheel -q --no-deps -w "$dir" "$sdist" && rm -f "$sdist"
done
ls "$dir"
