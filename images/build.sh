#!/usr/bin/env bash
# Build goodput's images (control-plane, worker, pause) offline into OCI archives:
#   bash images/build.sh            -> ${GOODPUT_IMAGES:-~/.cache/goodput/images}/{control-plane,worker,pause}.oci.tar
#                                      and images.env (the names and tags)
# From Debian's packages (mmdebstrap) and wheels (pip); no container registry. Cached under
# ~/.cache/goodput/images-cache: a second run with no change takes seconds. See docs/images.md.
set -euo pipefail
cd "$(dirname "$0")/.."
need=()
for tool in mmdebstrap:mmdebstrap buildah:buildah runc:runc skopeo:skopeo; do
  command -v "${tool%%:*}" >/dev/null || need+=("${tool#*:}")
done
if [ ${#need[@]} -gt 0 ]; then
  echo "images: installing ${need[*]} (apt)" >&2
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
# the images' Python is Debian bookworm's 3.11: the wheels come from a 3.11 pip (the venv's, else python3)
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
exec "$PY" images/build.py "$@"
