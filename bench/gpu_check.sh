#!/usr/bin/env bash
# GPU check of the Triton attention path, one command on one CUDA GPU (target: one H200, < 8 min):
#   1. the kernel tests (tests/worker/model/attention/test_triton_attention.py) compiled on CUDA instead of the interpreter;
#   2. the engine end to end: greedy tokens of 4 prompts, CUDA fp32/bf16 vs the CPU fp32 reference;
#   3. decode attention kernel at batch 1/16/64/256, context 1k: time vs SDPA on gathered K/V, %HBM;
#   4. whole decode steps of the model runner at the same batches: bytes/step, %HBM;
#   5. the host CPU's C++ kernels (the CPU fp32 reference of step 2 runs through them: fused layer
#      ops in AVX-512 lanes, the block linears of block_linear.cpp — 4-bit rows "lanes = blocks",
#      codes as bfloat16(128 + q) — for steps of <= 5 rows where AVX-512 builds, and the paged
#      decode attention with its prefetch and even split counts): tests/worker/model/test_block_linear.py,
#      test_cpu_layer_ops.py and attention/test_cpu_kernels.py on this machine's CPU.
# Usage: bench/gpu_check.sh            (env: PYTHON=python3, GOODPUT_MODEL=smollm2|PATH.gguf,
#                                        GPU_CHECK_LOG=path of the log, default bench/results/...)
# Needs: torch with CUDA, triton, gguf, tokenizers, jinja2, numpy, prometheus_client, pytest.
# Fails (exit 1) without a CUDA device, on a failing kernel test, on fp32 token mismatch, or when
# the kernel disagrees with SDPA. Timings are printed, never asserted.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD/worker_image:$PWD/bench:$PWD/operator:$PWD/autoscaler${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 HF_HUB_OFFLINE=1
unset TRITON_INTERPRET
MODEL="${GOODPUT_MODEL:-smollm2}"
LOG="${GPU_CHECK_LOG:-bench/results/gpu_check-$(date -u +%Y%m%dT%H%M%SZ).log}"
mkdir -p "$(dirname "$LOG")"
exec > >(tee "$LOG") 2>&1

"$PY" - "$MODEL" <<'PYEOF'
import importlib.util, sys
missing = [m for m in ("torch", "triton", "gguf", "tokenizers", "jinja2", "numpy",
                       "prometheus_client", "pytest") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"GPU CHECK FAILED: missing Python packages: {', '.join(missing)}")
import torch, triton
if not torch.cuda.is_available():
    sys.exit("GPU CHECK FAILED: no CUDA device visible to torch (torch.cuda.is_available() is False)")
p = torch.cuda.get_device_properties(0)
print(f"device {p.name}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB; "
      f"torch {torch.__version__}, triton {triton.__version__}, CUDA {torch.version.cuda}")
from goodput.worker.model.gguf_loader import resolve_model_path
try:
    print("model", resolve_model_path(sys.argv[1]))
except Exception as e:
    sys.exit(f"GPU CHECK FAILED: model {sys.argv[1]!r} not found ({e}); set GOODPUT_MODEL=PATH.gguf")
PYEOF

t0=$SECONDS
echo "== 1/5 kernel tests on CUDA"
GOODPUT_TEST_DEVICE=cuda "$PY" -m pytest -q --noconftest -p no:cacheprovider -o addopts="" \
  tests/worker/model/attention/test_triton_attention.py
echo "== 2/5 engine end to end: greedy tokens vs CPU fp32 ($((SECONDS - t0)) s so far)"
"$PY" -m goodput.bench.gpu_check e2e --model "$MODEL"
echo "== 3/5 decode attention kernel vs SDPA ($((SECONDS - t0)) s so far)"
"$PY" -m goodput.bench.gpu_check kernel-bench
echo "== 4/5 engine decode steps ($((SECONDS - t0)) s so far)"
"$PY" -m goodput.bench.gpu_check decode-bench --model "$MODEL"
echo "== 5/5 host CPU kernels: block linears, fused layer ops, paged decode attention ($((SECONDS - t0)) s so far)"
"$PY" -m pytest -q --noconftest -p no:cacheprovider -o addopts="" -m "not slow" \
  tests/worker/model/test_block_linear.py tests/worker/model/test_cpu_layer_ops.py \
  tests/worker/model/attention/test_cpu_kernels.py
echo "== GPU CHECK PASSED in $((SECONDS - t0)) s; log: $LOG"
