#!/usr/bin/env bash
# On a machine with one CUDA GPU, from the repo root: install the carried wheels (ci/gpu/README.md), then
# the GPU runs in order of importance, each with its own time limit inside a total one.
#   bash ci/gpu/run.sh [TOTAL_SECONDS] [RUN ...]   RUN: llama glue gpt2 dolly (default: all, in that order)
# Results: $OUT (default ./gpu-out): <notebook>.json per run, runs.log with everything printed. A run that
# finished is kept in $STATE and not run again by the next call on the same machine.
set -u
OUT=${OUT:-$PWD/gpu-out}
STATE=${STATE:-/tmp/gpu-state}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT" "$STATE"
total=${1:-560}
shift || true
runs=${*:-llama glue gpt2 dolly}
start=$(date +%s)
log=$OUT/runs.log
WHEELS=${WHEELS:-.whl}  # carried wheels, if any
if [ -d "$WHEELS" ]; then
    if [ ! -d /tmp/site/ray ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$WHEELS"/*.whl || exit 1
        tar xJf "$WHEELS"/ray-*.tar.xz -C /tmp/site || exit 1
    fi
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$log"
$PYTHON -c "import ray, torch, transformers, deepspeed, lightning; print('ray', ray.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__, 'deepspeed', deepspeed.__version__, 'lightning', lightning.__version__)" 2>&1 | tail -3 | tee -a "$log"
echo "installed in $(($(date +%s) - start)) s" | tee -a "$log"
declare -A limit=([llama]=300 [dolly]=200 [gpt2]=170 [glue]=90)
for run in $runs; do
    if [ -f "$STATE/$run.done" ]; then
        cp "$STATE"/*.json "$OUT"/ 2>/dev/null
        echo "$run: done in an earlier call" | tee -a "$log"
        continue
    fi
    left=$((total - ($(date +%s) - start) - 5))
    budget=$((left < ${limit[$run]} ? left : ${limit[$run]}))
    if [ "$budget" -lt 30 ]; then
        echo "$run: skipped, ${left} s left of ${total}" | tee -a "$log"
        continue
    fi
    t0=$(date +%s)
    echo "== $run (limit ${budget} s)" >>"$log"
    case $run in dolly | gpt2) inner="--budget $((budget - 15))" ;; *) inner="" ;; esac
    timeout -k 5 "$budget" $PYTHON -m "ci.gpu.$run" --out "$OUT" $inner ${RUN_ARGS:-} >>"$log" 2>&1
    code=$?
    echo "$run: exit $code after $(($(date +%s) - t0)) s" | tee -a "$log"
    cp "$OUT"/*.json "$STATE"/ 2>/dev/null
    [ $code -eq 0 ] && touch "$STATE/$run.done"
done
grep -E "s/step|samples/s|generation|FAILED|Error|exit [0-9]|skipped|done in|installed|^ray |^NVIDIA" "$log" | grep -v Warning | tail -60
