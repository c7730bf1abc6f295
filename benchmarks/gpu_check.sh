#!/usr/bin/env bash
# The one GPU check (issue 15), meant to finish in ~6 minutes on an H200; prints every figure:
#   1. cold and warm-cache compile + first step of `clozax train` (base preset, bf16), once per
#      scan setting in UNROLLS (the default, every block unrolled, first);
#   2. an end-to-end `clozax train` of the base preset on the built-in corpus: 300 steps with one
#      evaluation and one checkpoint — steady tokens/s and the eval / checkpoint / first-step
#      shares of the command's wall time (warm cache);
#   3. the side-by-side benchmark (compare_hf.py) at seq 128 (batch 256) and seq 512 (batch 64):
#      tokens/s, MFU against PEAK_TFLOPS and the ratio to HF at its best honest configuration
#      (SDPA attention, fused AdamW, eager or torch.compile, whichever is faster).
#
#   benchmarks/gpu_check.sh [OUT_DIR]     # needs CUDA jax, torch and transformers in $PYTHON
#
# Every stage has its own timeout, so one failing stage leaves the others' figures. Environment:
# PYTHON (default .venv/bin/python, else python3), PEAK_TFLOPS (989: dense bf16, H100/H200),
# UNROLLS ("default 1"), PRESET (base), BATCH (128, the end-to-end run), STAGES ("1 2 3"),
# COMPARE_SHAPE (base).
# A CPU dry run of the script's logic: PRESET=tiny BATCH=8 QUICK=1 benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
OUT=${1:-runs/gpu-check}
PEAK=${PEAK_TFLOPS:-989}
UNROLLS=${UNROLLS:-default 1}
PRESET=${PRESET:-base}
BATCH=${BATCH:-128}
STAGES=${STAGES:-1 2 3}
QUICK=${QUICK:-}
COMPARE_SHAPE=${COMPARE_SHAPE:-base}
STEPS=300 BLOCKS=4 SPB=10
[ -n "$QUICK" ] && STEPS=6 BLOCKS=1 SPB=1 COMPARE_SHAPE=small
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export CLOZAX_COMPILATION_CACHE="$OUT/jax-cache"
CLOZAX=("$PY" -m clozax.cli)
TRAIN=(--preset "$PRESET" --set 'model.compute_dtype="bfloat16"' --set "train.batch_size=$BATCH")

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total \
  --format=csv | tee "$OUT/gpu.txt"
"$PY" -c "import jax, torch, transformers; print('jax', jax.__version__, jax.devices()); \
print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"

[ -f "$OUT/data/manifest.json" ] || timeout 120 "${CLOZAX[@]}" prepare --corpus stdlib \
  --out "$OUT/data" --quiet --overwrite

first_step() {  # the seconds a run printed for compiling and running its first step
  grep -o "first step in [0-9.]* s" "$1" | head -1 | grep -o "[0-9.]*" | head -1
}

if [[ " $STAGES " == *" 1 "* ]]; then
  echo "== 1. compile time: cold cache, then warm =="
  for unroll in $UNROLLS; do
    set_unroll=(); [ "$unroll" = default ] || set_unroll=(--set "model.unroll=$unroll")
    rm -rf "$CLOZAX_COMPILATION_CACHE"
    for cache in cold warm; do
      run="$OUT/compile-$unroll-$cache"; rm -rf "$run"
      timeout 300 "${CLOZAX[@]}" train --data "$OUT/data" --out "$run" --steps 1 \
        --set train.eval_every=1000 "${TRAIN[@]}" "${set_unroll[@]}" > "$run.log" 2>&1 \
        || echo "FAILED (see $run.log)"
      echo "unroll $unroll, $cache cache: compile + first step $(first_step "$run.log") s"
    done
  done | tee "$OUT/compile.txt"
fi

if [[ " $STAGES " == *" 2 "* ]]; then
  echo "== 2. end to end: $STEPS steps, one evaluation, one checkpoint (warm cache) =="
  run="$OUT/train"; rm -rf "$run"
  start=$(date +%s.%N)
  timeout 300 "${CLOZAX[@]}" train --data "$OUT/data" --out "$run" --steps "$STEPS" \
    --set "train.eval_every=$STEPS" --set "train.save_every=$STEPS" "${TRAIN[@]}" \
    > "$run.log" 2>&1 || echo "FAILED (see $run.log)"
  wall=$("$PY" -c "import sys; print(float(sys.argv[1]) - float(sys.argv[2]))" "$(date +%s.%N)" "$start")
  "$PY" benchmarks/run_summary.py "$run" --wall "$wall" --first-step "$(first_step "$run.log")" \
    | head -1 | tee "$OUT/train.txt"
fi

if [[ " $STAGES " == *" 3 "* ]]; then
  for shape in "128 256" "512 64"; do
    set -- $shape; seq=$1 batch=$2
    [ -n "$QUICK" ] && batch=8
    echo "== 3. side by side, seq $seq, batch $batch =="
    timeout 240 "$PY" benchmarks/compare_hf.py --shape "$COMPARE_SHAPE" --dtype bf16 --synthetic \
      --seq "$seq" --batch "$batch" --peak-tflops "$PEAK" --hf-compile best --warmup 3 \
      --blocks "$BLOCKS" --steps-per-block "$SPB" \
      2>&1 | tee "$OUT/compare-seq$seq.txt" | grep -v "^WARNING" || echo "FAILED: seq $seq"
  done
fi
