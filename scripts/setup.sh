#!/usr/bin/env bash
# Create .venv (once) and install ckptconv with the given extras into it, from the dependency lock:
# requirements-test.lock for the test extra (what CI tests), requirements.lock without extras.
# Every package comes pinned with its hashes (scripts/lock.sh, `make lock`, regenerates the locks),
# so a fresh machine gets exactly what was tested; torch is the CPU wheel 2.13.0+cpu.
# Usage: scripts/setup.sh [extras]   e.g. scripts/setup.sh test
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
py="${PYTHON:-python3}"
case "$extras" in
  "") lock=requirements.lock ;;
  test) lock=requirements-test.lock ;;
  *) echo "setup.sh: no lock for the extra '$extras' (use test, or none)" >&2; exit 2 ;;
esac
if [ ! -x .venv/bin/python ]; then
  "$py" -m venv .venv
fi
stamp=".venv/.ckptconv-installed-${extras:-base}"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ "$lock" -nt "$stamp" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet --require-hashes -r "$lock"
  # The project itself: its dependencies are all in the lock, and so is the build backend.
  .venv/bin/python -m pip install --quiet --no-deps --no-build-isolation -e .
  touch "$stamp"
fi
# Byte-compile the project as installing a package does: where PYTHONDONTWRITEBYTECODE is set, every
# command would otherwise compile all its modules again (a fifth of a second per CLI run). A module
# edited afterwards is compiled in memory on each import until the next setup compiles it here.
.venv/bin/python -m compileall -q ckptconv service worker >/dev/null
