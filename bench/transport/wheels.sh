#!/usr/bin/env bash
# Fill .carry/wheels/ (git-ignored; DEST=... for another folder) with the Python packages that the lent GPU
# machine's image lacks for running this workflow and bench/ there (Python 3.12; torch, peft, tensorboard, pandas,
# pyarrow, tokenizers, ninja, psutil, py-cpuinfo, msgpack, xxhash, huggingface-hub ... are already in the image:
# bench/transport/device_packages.txt lists them, with its source). Run HERE (a machine with PyPI access), from the
# repo root:
#
#   bash bench/transport/wheels.sh           # all of them (54 wheels, 54 MiB: the call carries little else)
#   LEAN=1 bash bench/transport/wheels.sh    # without pulp (Snakemake's ILP scheduler; the cases pass
#                                            # --scheduler greedy) and bitsandbytes (QLoRA, 8-bit states): 34 MiB
#
# bench/transport/setup.sh installs them there with `pip install --no-index --no-deps --target /tmp/site`.
# The versions are the closure of requirements.txt as pip resolved it in .venv; a package that the image
# already has is carried only where our pins need another version than the image's (transformers,
# tokenizers) or where the image's version is unknown and our packages bound it tightly (fsspec <= for
# datasets, typing-extensions >= for pydantic, regex >= for transformers' import-time version check).
# The closure is checked at the end: every Requires-Dist (no extras, markers for CPython 3.12 on Linux)
# of every wheel here must be a wheel here or a package of the image.
set -euo pipefail
cd "$(dirname "$0")/../.."
PIP=${PIP:-.venv/bin/pip}
PY=${PY:-.venv/bin/python}
DEST=${DEST:-.carry/wheels}
mkdir -p "$DEST"
X=$(git rev-parse --git-path info/exclude); grep -qsx "/.carry/" "$X" || echo "/.carry/" >>"$X"  # the carried folders stay untracked

PKGS=(
  # DeepSpeed's missing dependencies (the deepspeed wheel itself is built below)
  hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  typing-extensions==4.16.0
  # snakemake and its closure
  snakemake==9.27.1 snakemake-interface-common==1.23.0 snakemake-interface-executor-plugins==9.4.0
  snakemake-interface-logger-plugins==2.1.0 snakemake-interface-report-plugins==1.3.0
  snakemake-interface-scheduler-plugins==2.0.2 snakemake-interface-storage-plugins==4.4.1
  argparse-dataclass==2.0.0 conda-inject==1.3.2 configargparse==1.9.0
  docutils==0.22.4 dpath==2.2.0 fastjsonschema==2.22.3 gitdb==4.0.12 gitpython==3.2.1 smmap==5.0.3
  humanfriendly==10.0 immutables==0.21 jsonschema==4.26.0 jsonschema-specifications==2025.9.1
  referencing==0.37.0 rpds-py==2026.9.1 jupyter-core==5.9.1 nbformat==5.11.1 traitlets==5.16.1
  platformdirs==4.14.8 smart-open==7.7.1 sqlmodel==0.0.37 sqlalchemy==2.0.58 greenlet==3.5.6
  tenacity==9.2.1 throttler==1.2.3 yte==1.9.4
  pulp==3.3.2  # snakemake's default ILP scheduler (16 MB: it bundles the CBC solver)
  # datasets and its closure
  datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 fsspec==2026.9.0
  # our transformers / tokenizers pins (the image has 5.17.0 / 0.23.2)
  transformers==5.23.0 tokenizers==0.23.3 regex==2026.11.19
  # requirements-kernels.txt (triton comes with the image's CUDA torch)
  liger-kernel==0.8.5
  # bitsandbytes: below (one CUDA library of its 43 MB)
  # bench/throughput/trl_peer.py, the outside reference of bench/throughput/train_throughput.py
  trl==1.16.0
  # snaketune.model.gguf (model.base: a .gguf file)
  gguf==0.19.0
  # train.optimizer_step: in_backward (snaketune.train.backward_step; 3.4 MB, its CUDA extensions unused)
  torchao==0.18.0
)

PLAT=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_24_x86_64
  --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64)
if [ -n "${LEAN:-}" ]; then
  keep=(); for p in "${PKGS[@]}"; do [[ $p == pulp==* ]] || keep+=("$p"); done; PKGS=("${keep[@]}")
  rm -f "$DEST"/pulp-*.whl "$DEST"/bitsandbytes-*.whl
fi
"$PIP" download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --abi cp312 --abi abi3 --abi none "${PLAT[@]}" -d "$DEST" "${PKGS[@]}"

# connection-pool 0.0.3 (snakemake) is an sdist only, pure Python: build its wheel.
if ! ls "$DEST"/connection_pool-0.0.3-*.whl >/dev/null 2>&1; then
  "$PIP" wheel -q --no-deps -w "$DEST" connection-pool==0.0.3
fi

# deepspeed 0.19.8 is an sdist only: a pure-Python wheel (no prebuilt ops; they JIT-compile on first use,
# and this workflow needs none on GPU: torch's fused AdamW, NCCL). setup.py imports torch at build time.
if ! ls "$DEST"/deepspeed-0.19.8-*.whl >/dev/null 2>&1; then
  DS_BUILD_OPS=0 "$PIP" wheel -q --no-deps --no-build-isolation -w "$DEST" deepspeed==0.19.8
fi

# bitsandbytes (QLoRA, 8-bit Adam states) ships one library per CUDA/ROCm/XPU version: 43 MB. The device's torch
# is a CUDA 13.0 build (the device tool's notes), so keep libbitsandbytes_cuda130.so and the CPU one and drop the rest from the
# wheel and its RECORD: 4 MB that travel.
BNB=bitsandbytes-0.50.2-py3-none-manylinux_2_24_x86_64.whl
if [ -z "${LEAN:-}" ] && ! [ -f "$DEST/$BNB" ]; then
  tmp=$(mktemp -d)
  "$PIP" download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi none \
    --platform manylinux_2_24_x86_64 -d "$tmp" bitsandbytes==0.50.2
  "$PY" - "$tmp/$BNB" "$DEST/$BNB" <<'PY'
import re, sys, zipfile
src, dst = sys.argv[1:]
keep = re.compile(r"bitsandbytes/libbitsandbytes_(cuda130|cpu)\.so$")
drop = lambda n: n.startswith("bitsandbytes/libbitsandbytes_") and not keep.search(n)
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
    for item in zin.infolist():
        if drop(item.filename):
            continue
        data = zin.read(item.filename)
        if item.filename.endswith(".dist-info/RECORD"):
            lines = [l for l in data.decode().splitlines() if not drop(l.split(",", 1)[0])]
            data = ("\n".join(lines) + "\n").encode()
        zout.writestr(item, data)
PY
  rm -rf "$tmp"
fi

# One version of each package (two stop the whole install there).
"$PY" - "$DEST" <<'EOF'
import collections, os, pathlib, re, sys, zipfile
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name as cn, parse_wheel_filename

dest = pathlib.Path(sys.argv[1])
listed = pathlib.Path("bench/transport/device_packages.txt").read_text().splitlines()
device = {cn(line.strip()) for line in listed if line.strip() and not line.startswith("#")}
env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
       "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
       "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}
wheels = {}
for w in sorted(dest.glob("*.whl")):
    name, ver, _, _ = parse_wheel_filename(w.name)
    wheels.setdefault(name, []).append((str(ver), w))
dupes = {n: v for n, v in wheels.items() if len(v) > 1}
if dupes:
    sys.exit(f"more than one version in {dest}: {dupes}")
missing = collections.defaultdict(list)
for name, [(ver, w)] in wheels.items():
    with zipfile.ZipFile(w) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        for line in z.read(meta).decode().splitlines():
            if not line.startswith("Requires-Dist:"):
                continue
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker and not req.marker.evaluate(env):
                continue
            dep = cn(req.name)
            # LEAN: snakemake imports pulp only for its ILP scheduler, which the cases do not use (--scheduler greedy)
            if dep not in wheels and dep not in device and not (os.environ.get("LEAN") and dep == "pulp"):
                missing[dep].append(f"{name}=={ver}")
if missing:
    sys.exit(f"dependencies neither in {dest} nor on the device: {dict(missing)}")
total = sum(w.stat().st_size for [(v, w)] in wheels.values())
print(f"{len(wheels)} wheels, {total / 2**20:.1f} MiB in {dest}; closure complete")
if total > 60 * 2**20:
    sys.exit("too large: .whl travels with the working tree (64 MiB in all)")
EOF
