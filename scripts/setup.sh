#!/usr/bin/env bash
# Create .venv (once) and install ckptconv with the given extras into it.
# Usage: scripts/setup.sh [extras]   e.g. scripts/setup.sh test
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
py="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$py" -m venv .venv
fi
# Pin torch first: the CPU build is what this project runs on; a range would pull CUDA wheels.
stamp=".venv/.ckptconv-installed-${extras:-base}"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet "torch==2.13.0"
  if [ -n "$extras" ]; then
    .venv/bin/python -m pip install --quiet -e ".[$extras]"
  else
    .venv/bin/python -m pip install --quiet -e .
  fi
  touch "$stamp"
fi
