#!/usr/bin/env bash
# Run the images that `bash images/build.sh` wrote (runc: non-root, read-only root, tmpfs /tmp, host
# network): the control plane's entry points, the worker serving a real chat completion, the pause
# image. `bash images/smoke.sh [control-plane|worker|pause ...]`; exit 0 when every check passes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
exec "$PY" images/smoke.py "$@"
