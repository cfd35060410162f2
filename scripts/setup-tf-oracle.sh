#!/usr/bin/env bash
# Create .venv-tf: a separate venv with tensorflow-cpu, used only as a test oracle.
#
# ckptconv reads and writes TensorFlow checkpoints without TensorFlow. The tests prove the
# format against the real library, run in subprocesses from this venv. It is separate because
# installing tensorflow-cpu into .venv would change packages ckptconv pins (h5py, and it brings
# protobuf); nothing in .venv-tf is imported by ckptconv itself.
# Usage: scripts/setup-tf-oracle.sh   (idempotent; prints the venv's python on success)
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python3}"
venv=".venv-tf"
stamp="$venv/.tf-oracle-installed"
if [ ! -f "$stamp" ] || [ tests/tf_oracle/requirements.lock -nt "$stamp" ]; then
  if [ ! -x "$venv/bin/python" ]; then
    "$py" -m venv "$venv"
  fi
  "$venv/bin/python" -m pip install --quiet --upgrade pip
  # The version CI tested, every package hashed (tests/tf_oracle/requirements.lock, from scripts/lock.sh).
  "$venv/bin/python" -m pip install --quiet --require-hashes -r tests/tf_oracle/requirements.lock
  "$venv/bin/python" -c "import tensorflow as tf; print('tensorflow', tf.__version__)" >/dev/null 2>&1
  touch "$stamp"
fi
echo "$venv/bin/python"
