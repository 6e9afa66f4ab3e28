#!/usr/bin/env bash
# bench/gpu_session.sh: issue 40's GPU measurements as one prepared run, for the minutes a GPU
# machine is lent (docs/benchmarks.md keeps what earlier runs measured).
#
#   bench/gpu_wheels.sh                       here, once: the wheels the GPU machine's Python lacks
#   bench/gpu_session.sh                      there, through the device tool, with
#                                             carry [bench/.gpu-wheels]; results under $OUT
#   GPU_SESSION_DRY=1 bench/gpu_session.sh    here: every command on the CPU with a tiny model
#                                             (the script's own check, not a measurement)
#
# The GPU machine has a python3 with torch (not our pin) and most of what longrun imports, but no
# Ray, no Redis and no pydantic: the trainer-level benches need none of the first two, and the
# wheels bench/gpu_wheels.sh fetched supply the rest. `longrun` is importable through a folder
# on PYTHONPATH whose `longrun` entry links to platform/ (GUIDE.md). Each measurement runs under
# its own `timeout`, writes its JSON (the bench's last stdout line) and its log under $OUT, and
# a failure or timeout of one does not stop the others. Ordered by what issue 40 needs most:
#   1. compiled blocks, no activation checkpointing, 8192 x 4: the 50% MFU target's figure
#   2. the same at 16384 x 2 (the shape that reached 48.6% in the first probe)
#   3. activation checkpointing full, budget 0.5, selective, budget 0.3: the 0.9-of-no-AC target
#   4. checkpoints on the GPU (blocking, commit and restore vs torch.save/load and DCP)
#   5. the CP block kernel: flash vs today's math kernel, 8K and 32K tokens, rings of 2-8
# About 8 minutes on an H200 (compilation is most of each run); SESSION_BUDGET_S caps the total:
# a step that would start with less than its own timeout left is skipped and says so.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
OUT=${OUT:-$ROOT/gpu-session-out}
mkdir -p "$OUT"
BUDGET=${SESSION_BUDGET_S:-540}
START=$(date +%s)
PY=${PYTHON:-python3}
DRY=${GPU_SESSION_DRY:-}

if [ -n "$DRY" ]; then
    PY=${PYTHON:-$ROOT/.venv/bin/python}
    TINY=(--device cpu --tiny)
    export PYTHONPATH="$ROOT/bench${PYTHONPATH:+:$PYTHONPATH}"
else
    TINY=()
    # longrun importable without installing it; the wheels the machine's Python lacks beside it.
    LIB=$(mktemp -d /tmp/longrun-gpu.XXXXXX)
    ln -s "$ROOT/platform" "$LIB/longrun"
    for wheel in bench/.gpu-wheels/*.whl; do  # one at a time: a wheel this Python cannot take skips alone
        [ -e "$wheel" ] || { echo "[gpu] no wheels in bench/.gpu-wheels (run bench/gpu_wheels.sh here first)"; break; }
        "$PY" -m pip install -q --no-deps --no-index --target "$LIB/deps" "$wheel" >> "$OUT/setup.log" 2>&1 \
            || echo "[gpu] $(basename "$wheel") not installed: see setup.log"
    done
    export PYTHONPATH="$LIB:$LIB/deps:$ROOT/bench${PYTHONPATH:+:$PYTHONPATH}"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.csv" 2>&1
    "$PY" -c "import torch, longrun.trainer; print(torch.__version__, torch.cuda.get_device_name())" \
        > "$OUT/env.txt" 2>&1 || { echo "[gpu] longrun does not import: see env.txt"; cat "$OUT/env.txt"; }
fi

# run NAME TIMEOUT_S CMD...: the bench's last stdout line to NAME.json, everything to NAME.log.
run() {
    local name=$1 limit=$2
    shift 2
    local left=$((BUDGET - ($(date +%s) - START)))
    if [ "$left" -lt "$limit" ]; then
        echo "[gpu] $name skipped: ${left}s of the session's ${BUDGET}s left, it may take ${limit}s"
        return
    fi
    local t0=$(date +%s)
    timeout "$limit" "$PY" "$@" > "$OUT/$name.out" 2> "$OUT/$name.log"
    local rc=$?
    tail -n 1 "$OUT/$name.out" > "$OUT/$name.json"
    echo "[gpu] $name rc=$rc $(( $(date +%s) - t0 ))s: $(cut -c1-300 "$OUT/$name.json")"
}

MFU=(bench/mfu_gpu.py --quick "${TINY[@]}")
run mfu-blocks           150 "${MFU[@]}" --compile blocks
run mfu-blocks-16k       150 "${MFU[@]}" --compile blocks --tokens 16384 --grad-accum 2
run mfu-ac-full          150 "${MFU[@]}" --compile blocks --ac full
run mfu-ac-budget-0.5    150 "${MFU[@]}" --compile blocks --ac budget --ac-budget 0.5
run mfu-ac-selective     150 "${MFU[@]}" --compile blocks --ac selective
run mfu-ac-budget-0.3    150 "${MFU[@]}" --compile blocks --ac budget --ac-budget 0.3
if [ -n "$DRY" ]; then
    run checkpoint       300 bench/checkpoint.py --quick --device cpu
    run cp-kernel        120 bench/cp_kernel.py --device cpu --tokens 256 --ring 2 --reps 1
else
    run checkpoint       150 bench/checkpoint.py --quick --device cuda
    run cp-kernel        120 bench/cp_kernel.py --reps 3
fi
echo "[gpu] done in $(( $(date +%s) - START ))s; results in $OUT"
