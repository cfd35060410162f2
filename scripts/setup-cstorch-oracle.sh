#!/usr/bin/env bash
# Create the optional cstorch oracle: a separate venv with the real Cerebras software
# (cerebras-pytorch 2.10.0), used only by tests/test_cstorch_oracle.py in subprocesses to prove
# that real `cstorch.load` reads the Cerebras H5 files ckptconv writes, and that ckptconv reads
# what real `cstorch.save` writes.
#
# cerebras-pytorch pins torch==2.4.0 (and numpy 1.25, h5py 3.13, ...), so it can never be a
# dependency of ckptconv and never goes into the project's venv. The venv lives outside the
# repository: "${CKPTCONV_CSTORCH_VENV:-$HOME/.cache/ckptconv/venv-cstorch}".
#
# Why the install is not a plain `pip install cerebras-pytorch==2.10.0`:
#   PyPI's torch 2.4.0 wheel is the CUDA build. A plain install pulls every nvidia-*-cu12 package,
#   triton, pandas and tensorboard: 55 distributions, about 5.7 GB on disk. On a CPU the oracle
#   needs none of triton (GPU kernel compiler, imported only by torch.compile), pandas or
#   tensorboard (not imported by `import cerebras.pytorch`, save or load), and of the CUDA
#   libraries only those that torch's shared objects name as DT_NEEDED (the dynamic loader
#   refuses to load libtorch without them, even on a CPU): cudart, nvtx, cupti, cudnn, cublas,
#   cusparse (+nvjitlink), cufft, curand, nccl. cusolver and nvrtc are dlopen()ed only on first
#   CUDA use, so they are left out. No CPU build of torch 2.4 is published on PyPI.
#   So: torch, cerebras-pytorch and cerebras-appliance are installed with --no-deps, and their
#   declared requirements (exact pins read from their metadata) minus that skip list are
#   installed normally. Result: about 1 GB smaller than the plain install.
#
# Python: the cerebras-pytorch 2.10.0 wheel is built for CPython 3.11 only
# (override the interpreter with CKPTCONV_CSTORCH_PYTHON).
#
# Usage: scripts/setup-cstorch-oracle.sh   (idempotent: a working venv is left alone;
#        CKPTCONV_CSTORCH_REINSTALL=1 rebuilds it). Prints the venv's python on the last line.
set -euo pipefail

venv="${CKPTCONV_CSTORCH_VENV:-$HOME/.cache/ckptconv/venv-cstorch}"
py="${CKPTCONV_CSTORCH_PYTHON:-python3.11}"
cstorch_version="2.10.0"
torch_version="2.4.0"
# Requirements deliberately not installed (see above).
skip="triton nvidia-cusolver-cu12 nvidia-cuda-nvrtc-cu12 pandas tensorboard"

# A tiny save/load round trip: the oracle is "working" only if this passes.
check='
import os, sys, tempfile
import torch
import cerebras.pytorch as cstorch
assert cstorch.__version__ == sys.argv[1], cstorch.__version__
with tempfile.TemporaryDirectory() as d:
    p = os.path.join(d, "probe.mdl")
    cstorch.save({"w": torch.arange(6, dtype=torch.float32).reshape(2, 3).bfloat16()}, p)
    w = cstorch.load(p)["w"]
    assert w.dtype == torch.bfloat16 and w.float().sum().item() == 15.0
print("cerebras.pytorch", cstorch.__version__, "torch", torch.__version__)
'

works() {
  [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "$check" "$cstorch_version" >/dev/null 2>&1
}

if [ "${CKPTCONV_CSTORCH_REINSTALL:-0}" != "1" ] && works; then
  echo "cstorch oracle already working in $venv; nothing to do"
  echo "$venv/bin/python"
  exit 0
fi

if ! command -v "$py" >/dev/null 2>&1; then
  echo "error: $py not found; cerebras-pytorch $cstorch_version needs CPython 3.11 (set CKPTCONV_CSTORCH_PYTHON)" >&2
  exit 1
fi

start=$(date +%s)
echo "creating $venv with $("$py" --version)"
mkdir -p "$(dirname "$venv")"
"$py" -m venv --clear "$venv"
pip=("$venv/bin/python" -m pip install --quiet --no-cache-dir --disable-pip-version-check)

echo "installing torch==$torch_version cerebras-pytorch==$cstorch_version cerebras-appliance==$cstorch_version (--no-deps)"
"${pip[@]}" "packaging<26"
"${pip[@]}" --no-deps "torch==$torch_version" "cerebras-pytorch==$cstorch_version" "cerebras-appliance==$cstorch_version"

# Their declared requirements, exact specifiers and markers kept, minus the skip list.
mapfile -t reqs < <("$venv/bin/python" - "$skip" <<'EOF'
import sys
from importlib.metadata import requires
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

skip = {canonicalize_name(n) for n in sys.argv[1].split()}
own = {canonicalize_name(n) for n in ("torch", "cerebras-pytorch", "cerebras-appliance")}
# One line per name, every package's specifiers combined (e.g. urllib3: "<3" and "==2.6.3").
specs: dict[str, list[str]] = {}
for dist in ("torch", "cerebras-pytorch", "cerebras-appliance"):
    for line in requires(dist) or []:
        req = Requirement(line)
        name = canonicalize_name(req.name)
        if name in skip or name in own:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        specs.setdefault(name, [])
        specs[name] += [str(s) for s in req.specifier]
for name, parts in specs.items():
    print(name + ",".join(sorted(set(parts))))
EOF
)
echo "installing ${#reqs[@]} requirements (skipped: $skip)"
echo "(pip then reports those skipped requirements as missing: expected, see the top of this script)"
"${pip[@]}" "${reqs[@]}"

if ! works; then
  echo "error: the oracle venv was built but the save/load check fails:" >&2
  "$venv/bin/python" -c "$check" "$cstorch_version" >&2 || true
  exit 1
fi
"$venv/bin/python" -c "$check" "$cstorch_version"
echo "done in $(($(date +%s) - start)) s; disk: $(du -sh "$venv" | cut -f1)"
echo "$venv/bin/python"
