#!/usr/bin/env bash
# The main demo, on a fresh machine: start the service (API + one worker) on this machine with a
# local directory as storage, submit a conversion of a tiny safetensors checkpoint to Cerebras H5
# over HTTP, follow it to the end, print the result, and stop everything it started.
#
# Usage: scripts/demo.sh            (REDIS_URL picks the Redis; one is started if none answers)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh

PY=.venv/bin/python
CKPTCONV=.venv/bin/ckptconv
DEMO_DIR="$PWD/.demo"
RUN_DIR="$DEMO_DIR/runs/$(date +%Y%m%d-%H%M%S)-$$"
mkdir -p "$RUN_DIR"
REDIS_URL="${REDIS_URL:-redis://127.0.0.1:6379/0}"
PORT="$($PY -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
URL="http://127.0.0.1:$PORT"

pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  # The demo's keys in Redis (its own prefix); the converted files stay in .demo/.
  "$PY" - "$REDIS_URL" "$CKPTCONV_REDIS_PREFIX" <<'PYEOF' 2>/dev/null || true
import sys, redis
r = redis.Redis.from_url(sys.argv[1], socket_connect_timeout=1)
keys = list(r.scan_iter(match=sys.argv[2] + "*", count=1000))
for i in range(0, len(keys), 500):
    r.delete(*keys[i : i + 500])
PYEOF
}
trap cleanup EXIT

redis_answers() {
  "$PY" -c "import redis, sys; redis.Redis.from_url(sys.argv[1], socket_connect_timeout=1).ping()" "$REDIS_URL" 2>/dev/null
}
if ! redis_answers; then
  if ! command -v redis-server >/dev/null; then
    echo "demo: no Redis answers at $REDIS_URL and redis-server is not installed (apt-get install redis-server)" >&2
    exit 1
  fi
  redis_port="$($PY -c 'import sys; from urllib.parse import urlsplit; print(urlsplit(sys.argv[1]).port or 6379)' "$REDIS_URL")"
  echo "demo: starting redis-server on port $redis_port"
  redis-server --port "$redis_port" --bind 127.0.0.1 --save '' --appendonly no >"$RUN_DIR/redis.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 100); do redis_answers && break; sleep 0.1; done
  redis_answers || { echo "demo: redis-server did not start (see $RUN_DIR/redis.log)" >&2; exit 1; }
fi

export CKPTCONV_ENVIRONMENT=development
export CKPTCONV_REDIS_URL="$REDIS_URL"
export CKPTCONV_REDIS_PREFIX="ckptconv-demo-$$:"
export CKPTCONV_STORAGE_PROBE_URI="$DEMO_DIR/"

echo "demo: starting the API on $URL (development mode: no API keys), a conversion worker and an interactive one"
"$CKPTCONV" serve --dev --port "$PORT" --log-level warning >"$RUN_DIR/api.log" 2>&1 &
pids+=($!)
"$CKPTCONV" worker --queues jobs --loglevel warning >"$RUN_DIR/worker.log" 2>&1 &
pids+=($!)
# Plans, inspections and webhooks have their own consumer: they never wait behind a conversion.
"$CKPTCONV" worker --interactive --loglevel warning >"$RUN_DIR/interactive.log" 2>&1 &
pids+=($!)
for _ in $(seq 300); do
  "$PY" -c "import httpx, sys; httpx.get(sys.argv[1] + '/readyz', timeout=1).raise_for_status()" "$URL" 2>/dev/null && break
  sleep 0.1
done

echo "demo: writing a tiny checkpoint to $RUN_DIR/tiny.safetensors"
"$PY" - "$RUN_DIR/tiny.safetensors" <<'PYEOF'
import sys
import torch
from safetensors.torch import save_file

torch.manual_seed(0)
tensors = {f"model.layers.{i}.mlp.weight": torch.randn(64, 64, dtype=torch.bfloat16) for i in range(4)}
tensors["model.embed_tokens.weight"] = torch.randn(128, 64, dtype=torch.bfloat16)
save_file(tensors, sys.argv[1])
PYEOF

echo "demo: submitting its conversion to cs-h5 and waiting for it"
"$CKPTCONV" submit "$RUN_DIR/tiny.safetensors" "$RUN_DIR/tiny.mdl" --to cs-h5 --label demo=yes --url "$URL" --wait

echo
echo "demo: jobs on this service"
"$CKPTCONV" jobs --url "$URL"
echo
echo "demo: outputs in $RUN_DIR:"
ls -l "$RUN_DIR" | grep -v '\.log$'
