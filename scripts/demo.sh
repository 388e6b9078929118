#!/usr/bin/env bash
# The main job (README command 1): set up .venv with the runtime only (scripts/setup.sh; the test
# clients are the test command's), start a goodput worker with the bundled SmolLM2-135M-Instruct on
# 127.0.0.1, ask it a real chat question on its OpenAI-compatible API, print the answer, stop it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
PORT=${PORT:-8000}
LOG=$(mktemp -t goodput-demo.XXXXXX.log)
goodput-worker serve --model smollm2 --host 127.0.0.1 --port "$PORT" >"$LOG" 2>&1 &
PID=$!
trap 'kill $PID 2>/dev/null; wait $PID 2>/dev/null || true' EXIT
echo "worker pid $PID, log $LOG; waiting for /ready ..."
for _ in $(seq 1 240); do
  if curl -sf "http://127.0.0.1:$PORT/ready" >/dev/null; then break; fi
  kill -0 $PID 2>/dev/null || { cat "$LOG"; exit 1; }
  sleep 0.5
done
grep -iE "kv cache|capacity" "$LOG" || true
# POST /v1/chat/completions as any OpenAI client sends it (httpx: a runtime dependency)
python - "$PORT" <<'PY'
import sys
import httpx
question = "What is the capital of France?"
r = httpx.post(f"http://127.0.0.1:{sys.argv[1]}/v1/chat/completions", timeout=120, json={
    "model": "smollm2", "messages": [{"role": "user", "content": question}], "max_tokens": 48, "temperature": 0})
r.raise_for_status()
reply = r.json()
print(f"Q: {question}\nA: {reply['choices'][0]['message']['content']}")
print(f"usage: {reply['usage']}")
PY
