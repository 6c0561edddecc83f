#!/usr/bin/env bash
# The GPU check in one call on an offline GPU machine (docs/cluster.md, "The GPU check"; BENCHMARKS.md,
# "GPU claims"). Here, once: `make gpu-wheels` (the wheels that machine lacks, into gpu-wheels/).
# There, from the checkout: `bash benchmarks/gpu_check.sh "$OUT"`: unpacks the wheels into a
# temporary site, runs benchmarks/gpu_check.py with that machine's own python3 and torch under a
# time limit, and leaves gpu_check.json, gpu_check.txt (the claims table) and gpu_check.log in OUT.
#   bash benchmarks/gpu_check.sh OUT [gpu_check.py flags, e.g. --cpu]
#   env: PYTHON (python3), FTREC_GPU_WHEELS (gpu-wheels/), FTREC_GPU_CHECK_LIMIT_S (460)
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${1:-${OUT:-$ROOT/bench-results}}
shift || true
PY=${PYTHON:-python3}
WHEELS=${FTREC_GPU_WHEELS:-$ROOT/gpu-wheels}
LIMIT=${FTREC_GPU_CHECK_LIMIT_S:-460}
SITE=$(mktemp -d "${TMPDIR:-/tmp}/ftrec-gpu-check.XXXXXX") || exit 2
trap 'rm -rf "$SITE"' EXIT
mkdir -p "$OUT" || exit 2
# a wheel is a zip of its site-packages files: unpacking it is installing it (no pip, no network)
"$PY" - "$WHEELS" "$SITE/site" <<'PYEOF' || exit 2
import pathlib, sys, zipfile
src, dst = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
wheels = sorted(src.glob("*.whl")) if src.is_dir() else []
for w in wheels:
    zipfile.ZipFile(w).extractall(dst)
print(f"gpu_check.sh: {len(wheels)} wheel(s) from {src} into a temporary site; python {sys.version.split()[0]}")
PYEOF
export PYTHONPATH="$SITE/site:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
NEED=$(sed -e 's/#.*//' -e 's/[=<>;~ ].*//' "$ROOT/benchmarks/gpu_check_wheels.txt" | grep . | tr '\n' ' ')
if ! "$PY" -c "import sys, importlib; [importlib.import_module(m) for m in sys.argv[1:]]; import torch" $NEED; then
    echo "gpu_check.sh: $PY cannot import one of: torch $NEED; run 'make gpu-wheels' where a package index is reachable and bring $WHEELS along" >&2
    exit 3
fi
timeout -k 15 "$LIMIT" "$PY" "$ROOT/benchmarks/gpu_check.py" --out "$OUT/gpu_check.json" \
    --work "$SITE/work" --budget-s $((LIMIT - 60)) "$@" 2>&1 | tee "$OUT/gpu_check.log"
rc=${PIPESTATUS[0]}
[ "$rc" = 124 ] && echo "gpu_check.sh: the check ran past ${LIMIT}s (FTREC_GPU_CHECK_LIMIT_S) and was ended" >&2
exit "$rc"
