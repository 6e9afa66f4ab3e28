#!/usr/bin/env bash
# bench/gpu_wheels.sh: fetch, here, the wheels the GPU machine's Python 3.12 lacks for longrun's
# trainer-level benches (it has torch, numpy, safetensors, tokenizers, rich, psutil; not
# pydantic or redis), into bench/.gpu-wheels (ignored by git: pass it to the device tool's
# `carry`). The versions are this venv's, so both sides run the same pydantic.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY="$ROOT/.venv/bin/python"
DEST="$ROOT/bench/.gpu-wheels"
mkdir -p "$DEST"
pins=$("$PY" - <<'EOF'
from importlib.metadata import version
print(" ".join(f"{name}=={version(name)}" for name in (
    "pydantic", "pydantic_core", "annotated_types", "typing_inspection", "typing_extensions",
    "redis", "hiredis", "fsspec", "pyyaml", "xxhash")))
EOF
)
# shellcheck disable=SC2086  # one argument per pin; pip's notes on absent local indexes are noise
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    -d "$DEST" $pins 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
ls "$DEST"
