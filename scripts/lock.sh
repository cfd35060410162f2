#!/usr/bin/env bash
# Regenerate the dependency locks from pyproject.toml: every package pinned, with its sha256 hashes.
#   requirements.lock       what the service and workers run (the Dockerfile installs it)
#   requirements-test.lock  the same plus the test extra (make setup and CI install it)
#   tests/tf_oracle/requirements.lock  the TensorFlow the tests use as their oracle (.venv-tf)
# Pins already in a lock are kept; to move one, edit pyproject.toml or delete the lock line, then rerun.
# torch is pinned in pyproject.toml (2.13.0); on the project's machines that is the local CPU wheel
# torch 2.13.0+cpu, which is what the locks record.
# Usage: scripts/lock.sh   (make lock)
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python3}"
venv=".venv-lock"
if [ ! -x "$venv/bin/pip-compile" ]; then
  "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet "pip-tools==7.6.2"
fi
common=(--quiet --generate-hashes --allow-unsafe --strip-extras --no-emit-index-url --no-emit-find-links --newline=lf)
# --all-build-deps: the build backend (setuptools) too, since the project installs without build isolation.
project=("${common[@]}" --all-build-deps)
"$venv/bin/pip-compile" "${project[@]}" --extra test --output-file requirements-test.lock pyproject.toml
# The runtime lock starts from the test lock's pins, so both name the same version of every package they share.
cp requirements-test.lock requirements.lock
"$venv/bin/pip-compile" "${project[@]}" --output-file requirements.lock pyproject.toml
"$venv/bin/pip-compile" "${common[@]}" --output-file tests/tf_oracle/requirements.lock tests/tf_oracle/requirements.in
