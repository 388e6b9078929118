#!/usr/bin/env bash
# guidellm (the current `guidellm run` CLI) against a local worker: a synchronous run and a
# concurrent run (4 streams), chat completions streamed with stream_options
# {include_usage, continuous_usage_stats} as guidellm always sends them.
#
#   bash scripts/guidellm_worker.sh            # starts a worker on 127.0.0.1:18431 itself
#   URL=http://127.0.0.1:8000 bash scripts/guidellm_worker.sh
#
# guidellm is a client tool with heavy dependencies of its own, so it lives in its own virtualenv
# (GUIDELLM_VENV, default .guidellm-venv, created on first use). The tokenizer guidellm needs to
# size synthetic prompts is written from the bundled GGUF by transformers (no download). JSON
# results go to OUT (default /tmp/guidellm-out). Exit status: guidellm's; then 0 KV blocks in use
# and no traceback in the worker log are checked.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
GUIDELLM_VENV=${GUIDELLM_VENV:-.guidellm-venv}
OUT=${OUT:-/tmp/guidellm-out}
REQUESTS=${REQUESTS:-16}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

if [ ! -x "$GUIDELLM_VENV/bin/guidellm" ]; then
    python3 -m venv "$GUIDELLM_VENV"
    "$GUIDELLM_VENV/bin/pip" install -q guidellm
fi
"$GUIDELLM_VENV/bin/guidellm" --version

TOK="$OUT/smollm2-tokenizer"
"$PY" - "$TOK" <<'PYEOF'
import sys
sys.path.insert(0, "tests")
from reference_hf import gguf_dir_and_name
from transformers import AutoTokenizer
d, name = gguf_dir_and_name()
AutoTokenizer.from_pretrained(d, gguf_file=name).save_pretrained(sys.argv[1])
PYEOF

WORKER_PID=
if [ -z "${URL:-}" ]; then
    URL=http://127.0.0.1:18431
    OMP_NUM_THREADS=1 "$PY" -m goodput.worker serve --model smollm2 --dtype float32 --max-model-len 512 \
        --kv-cache-memory 64MiB --host 127.0.0.1 --port 18431 > "$OUT/worker.log" 2>&1 &
    WORKER_PID=$!
    trap 'kill $WORKER_PID 2>/dev/null || true' EXIT
    for _ in $(seq 300); do
        curl -sf "$URL/ready" > /dev/null && break
        sleep 1
    done
fi

run() {  # $1: name, rest: profile/constraint arguments
    local name=$1; shift
    "$GUIDELLM_VENV/bin/guidellm" run --backend "kind=openai_http,target=$URL,model=smollm2" \
        --tokenizer "kind=hf_auto,model=$TOK" \
        --data kind=synthetic_text,prompt_tokens=64,output_tokens=32 \
        "$@" --output "kind=json,path=$OUT/$name.json" --disable-progress | tee "$OUT/$name.txt"
}
run synchronous --profile kind=synchronous --constraint "kind=max_requests,count=$((REQUESTS / 2))"
run concurrent --profile kind=concurrent,streams=4 --constraint "kind=max_requests,count=$REQUESTS"

STATE=$(curl -sf "$URL/admin/state")
echo "worker after the runs: $STATE"
"$PY" -c 'import json,sys; s=json.loads(sys.argv[1]); assert s["kv_blocks_used"] == 0 and s["running"] == 0, s' "$STATE"
if [ -n "$WORKER_PID" ] && grep -q Traceback "$OUT/worker.log"; then
    echo "the worker logged a traceback (see $OUT/worker.log)"; exit 1
fi
