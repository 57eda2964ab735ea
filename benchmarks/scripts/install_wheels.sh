#!/usr/bin/env bash
# Install DeepSpeed and its non-torch dependencies offline from the wheelhouse .whl/.
# Usage (repository root, on a machine without network): bash benchmarks/scripts/install_wheels.sh [WHEELDIR]
#
# For every project in WHEELDIR the wheel that fits this python3 (tags checked as pip
# does) is installed with --no-index --no-deps; wheels for other Python versions are
# ignored. A project already installed at the same or a newer version is left alone
# (DeepSpeed only at the same version; pydantic and pydantic-core are decided together:
# pydantic pins its core exactly).
set -u
cd "$(dirname "$0")/.."
whl=${1:-.whl}
if [ ! -d "$whl" ]; then echo "install_wheels: no wheelhouse at $whl"; exit 1; fi

mapfile -t wheels < <(python3 - "$whl" <<'EOF'
import glob, os, sys
from importlib import metadata
try:
    from packaging.tags import sys_tags
    from packaging.utils import canonicalize_name, parse_wheel_filename
    from packaging.version import Version
except ImportError:  # pip always carries its own copy
    from pip._vendor.packaging.tags import sys_tags
    from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename
    from pip._vendor.packaging.version import Version

rank = {t: i for i, t in enumerate(sys_tags())}  # lower = preferred by this interpreter
best = {}
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.whl"))):
    try:
        name, version, _, tags = parse_wheel_filename(os.path.basename(path))
    except Exception as e:
        print(f"install_wheels: skipping {path}: {e}", file=sys.stderr)
        continue
    score = min((rank[t] for t in tags if t in rank), default=None)
    if score is None:
        continue  # another Python version or platform
    if name not in best or (version, -score) > (best[name][1], -best[name][2]):
        best[name] = (path, version, score)

def installed(name):
    try:
        return Version(metadata.version(name))
    except metadata.PackageNotFoundError:
        return None
    except Exception:
        return None

chosen = {}
for name, (path, version, _) in best.items():
    have = installed(name)
    exact = name == "deepspeed"  # qzero's adapter supports one release line: install exactly this one
    if have is not None and (have == version if exact else have >= version):
        print(f"install_wheels: {name} {have} already installed (wheel {version}), kept", file=sys.stderr)
    else:
        chosen[name] = path
# pydantic pins pydantic-core exactly: install both or neither
pair = [canonicalize_name("pydantic"), canonicalize_name("pydantic-core")]
if any(n in chosen for n in pair):
    for n in pair:
        if n in best:
            chosen[n] = best[n][0]
for path in chosen.values():
    print(path)
EOF
)

if [ ${#wheels[@]} -eq 0 ]; then
    echo "install_wheels: nothing to install"
else
    echo "install_wheels: ${wheels[*]}"
    if ! python3 -m pip install -q --no-index --find-links "$whl" --no-deps "${wheels[@]}"; then
        echo "install_wheels: installing together failed; one at a time"
        for w in "${wheels[@]}"; do
            python3 -m pip install -q --no-index --find-links "$whl" --no-deps "$w" || echo "install_wheels: FAILED $w"
        done
    fi
fi
python3 -c "import deepspeed, pydantic; print('deepspeed', deepspeed.__version__, 'pydantic', pydantic.VERSION)"
