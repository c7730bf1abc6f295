#!/usr/bin/env bash
# The one device check of the accelerator issue, inside a 15-minute lease: BUDGET_S seconds
# (default 570) for all of it, each command cut to what is left, a stage that finds the budget
# spent printed as skipped. Every stage prints its figures and keeps them if another fails;
# the order puts "does it run at all" first:
#   1. compile + first step of `clozax train`, base preset, bf16: empty compilation cache, then
#      warm (once per scan setting in UNROLLS);
#   2. a smoke run of every command on the built-in corpus, exit codes checked: prepare, train
#      (classic and modern), evaluate (both), probe, finetune, embed, retrieval, export --verify,
#      audit;
#   3. each attention path alone (attention_paths.py): forward + backward ms, TFLOP/s on useful
#      FLOPs and temporary memory at 512, 1,024 and 8,192 tokens: rows / packed documents /
#      documents with ±64 windows;
#   4. BERT-base bf16 side by side with HF (compare_hf.py) at seq 128 (batch 256; HF eager, the
#      faster there on 2026-12-04) and seq 512 (batch 64; HF eager and torch.compile, the faster
#      kept): tokens/s, MFU on useful FLOPs against PEAK_TFLOPS, the ratio; clozax's attention
#      auto;
#   5. modern-base bf16 on packed rows (documents of ~512 tokens) with its ±64 windows, side by
#      side with ModernBertForMaskedLM (SDPA, HF_MODERN_COMPILE), at 1,024 (batch 32) and 8,192
#      (batch 4);
#   6. an end-to-end `clozax train` of the base preset: 300 steps with one evaluation and one
#      checkpoint: steady tokens/s and the evaluation / checkpoint / first-step shares of wall;
#   7. (not in the default STAGES: a lease of its own) the device budget of the pretraining
#      issue: each of DEVICE_CANDIDATES (budget.py's: "budget" is the demo's recipe, "modern"
#      the same on modern-small) trained from scratch for DEVICE_MINUTES on the device and
#      fine-tuned on the built-in task with the default protocol (3 seeds, the rate chosen on
#      validation, the random-init control) by budget_curve.py: trained − TF-IDF and trained −
#      random init, each with its interval over seeds.
#
#   benchmarks/gpu_check.sh [OUT_DIR]     # needs CUDA jax, torch and transformers in $PYTHON
#   STAGES=7 BUDGET_S=780 benchmarks/gpu_check.sh [OUT_DIR]   # the device budget alone
#
# Exit 0 when every stage ran and passed; 1 when something failed (the failures listed last);
# 2 when nothing failed but the budget left commands unrun (listed as skipped).
# Environment: PYTHON (default .venv/bin/python, else python3), PEAK_TFLOPS (989: dense bf16,
# H100/H200), BUDGET_S (570), STAGES ("1 2 3 4 5 6"), UNROLLS ("default"), PRESET (base),
# BATCH (128, stages 1 and 6), COMPARE_SHAPE (base), MODERN_SHAPE (modern-base),
# HF_MODERN_COMPILE (off: torch.compile of ModernBERT at 8,192 would not fit the budget),
# DEVICE_CANDIDATES ("budget modern"), DEVICE_MINUTES (4: both fit one 15-minute lease).
# QUICK=1: the same logic at tiny shapes, a dry run on a CPU (tests/test_gpu_check.py runs it in
# the suite); its figures mean nothing.
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
OUT=${1:-runs/gpu-check}
PEAK=${PEAK_TFLOPS:-989}
BUDGET=${BUDGET_S:-570}
STAGES=${STAGES:-1 2 3 4 5 6}
UNROLLS=${UNROLLS:-default}
PRESET=${PRESET:-base}
BATCH=${BATCH:-128}
QUICK=${QUICK:-}
COMPARE_SHAPE=${COMPARE_SHAPE:-base}
MODERN_SHAPE=${MODERN_SHAPE:-modern-base}
HF_MODERN_COMPILE=${HF_MODERN_COMPILE:-off}
STEPS=300 BLOCKS=3 SPB=10 SMOKE_STEPS=10 SMOKE_PRESET=small SMOKE_MODERN=modern-small
CLASSIC_RUNS="128:256:off 512:64:best" MODERN_RUNS="1024:32 8192:4" DOCUMENTS=512
DEVICE_CANDIDATES=${DEVICE_CANDIDATES:-budget modern}
DEVICE_MINUTES=${DEVICE_MINUTES:-4}
DEVICE_ARGS=()  # budget_curve.py's protocol: its defaults
# 16,384 tokens a call: the dense paths' f32 scores at 8,192 are then 6.4 GB a tensor
PATH_ARGS=(--seqs 512,1024,8192 --dtype bfloat16 --batch-tokens 16384 --reps 5)
PREPARE=(--vocab-size 8192 --seq-len 128)
if [ -n "$QUICK" ]; then
  PRESET=tiny BATCH=8 STEPS=6 BLOCKS=1 SPB=1 SMOKE_STEPS=2 SMOKE_PRESET=tiny
  SMOKE_MODERN=modern-tiny COMPARE_SHAPE=tiny MODERN_SHAPE=modern-tiny
  CLASSIC_RUNS="64:8:off" MODERN_RUNS="128:4" DOCUMENTS=32
  PATH_ARGS=(--seqs 128 --heads 2 --head-dim 16 --batch-tokens 512 --reps 1 --interpret)
  PREPARE=(--vocab-size 1024 --seq-len 64)
  DEVICE_CANDIDATES=modern DEVICE_MINUTES=1  # the one recipe: the script is the same for both
  DEVICE_ARGS=(--steps-per-minute 3 --seeds 1 --epochs 1 --max-train 40 --lr 1e-3)
fi
mkdir -p "$OUT"
rm -f "$OUT/failed.txt" "$OUT/skipped.txt"
fail() { echo "FAILED: $*"; echo "$*" >> "$OUT/failed.txt"; }  # also from pipelines' subshells
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
within() {  # within SECONDS CMD...: CMD under a timeout of SECONDS or what the budget has left
  # Started only with at least a minute (or its whole cap) left; a command the budget then
  # cuts is listed as cut, not failed (exit 0), and gets 20 s after SIGTERM to save and exit.
  local cap=$1 rest code; shift
  rest=$(left)
  if [ "$rest" -lt "$cap" ] && [ "$rest" -lt 60 ]; then  # not run: listed, not a failure
    echo "skipped: ${SKIP_NAME:-$*} (the check's ${BUDGET} s budget is spent)" \
      | tee -a "$OUT/skipped.txt"
    return 0
  fi
  local cut=0
  [ "$rest" -lt "$cap" ] && cap=$rest cut=1
  timeout -k 20 "$cap" "$@"
  code=$?
  if [ "$cut" = 1 ] && { [ "$code" = 124 ] || [ "$code" = 137 ] || [ "$code" = 143 ]; }; then
    echo "cut: ${SKIP_NAME:-$*} at the budget's end ($cap s)" | tee -a "$OUT/skipped.txt"
    return 0
  fi
  return "$code"
}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export CLOZAX_COMPILATION_CACHE="$OUT/jax-cache"
CLOZAX=("$PY" -m clozax.app.cli)
TRAIN=(--preset "$PRESET" --set 'model.compute_dtype="bfloat16"' --set "train.batch_size=$BATCH")

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total \
  --format=csv | tee "$OUT/gpu.txt"
"$PY" -c "import jax, torch, transformers; print('jax', jax.__version__, jax.devices()); \
print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
[ -f "$OUT/data/manifest.json" ] || SKIP_NAME=prepare within 300 "${CLOZAX[@]}" prepare --corpus stdlib \
  --out "$OUT/data" --quiet --overwrite "${PREPARE[@]}" || fail "prepare $OUT/data"

first_step() {  # the seconds a run printed for compiling and running its first step
  grep -o "first step in [0-9.]* s" "$1" | head -1 | grep -o "[0-9.]*" | head -1
}
stage() { [[ " $STAGES " == *" $1 "* ]]; }

if stage 1; then
  echo "== 1. compile time: cold cache, then warm =="
  for unroll in $UNROLLS; do
    set_unroll=(); [ "$unroll" = default ] || set_unroll=(--set "model.unroll=$unroll")
    rm -rf "$CLOZAX_COMPILATION_CACHE"
    for cache in cold warm; do
      run="$OUT/compile-$unroll-$cache"; rm -rf "$run"
      SKIP_NAME="compile, $cache cache" within 300 "${CLOZAX[@]}" train --data "$OUT/data" \
        --out "$run" --steps 1 \
        --set train.eval_every=1000 "${TRAIN[@]}" "${set_unroll[@]}" > "$run.log" 2>&1 \
        || fail "compile, unroll $unroll, $cache cache (see $run.log)"
      seconds=$(first_step "$run.log")
      echo "unroll $unroll, $cache cache: compile + first step ${seconds:-not measured}${seconds:+ s}"
    done
  done | tee "$OUT/compile.txt"
fi

smoke() {  # smoke NAME ARGS...: one clozax command, its exit code and seconds
  local name=$1 started code; shift
  if [ "$(left)" -lt 60 ]; then
    echo "smoke: $name skipped (the check's ${BUDGET} s budget is spent)" \
      | tee -a "$OUT/skipped.txt"
    return
  fi
  started=$(date +%s)
  SKIP_NAME="smoke $name" within 240 "${CLOZAX[@]}" "$@" > "$OUT/smoke-$name.log" 2>&1
  code=$?
  echo "smoke: $name exit $code ($(( $(date +%s) - started )) s)"
  [ $code = 0 ] || fail "smoke $name (see $OUT/smoke-$name.log)"
}

if stage 2; then
  echo "== 2. every command on the built-in corpus =="
  S="$OUT/smoke"; rm -rf "$S"; mkdir -p "$S"
  bf16=(--set 'model.compute_dtype="bfloat16"')
  {
    smoke prepare prepare --corpus stdlib --out "$S/data" --quiet "${PREPARE[@]}"
    smoke train train --data "$S/data" --out "$S/run" --steps "$SMOKE_STEPS" \
      --preset "$SMOKE_PRESET" "${bf16[@]}" --set train.batch_size=16
    smoke train-modern train --data "$S/data" --out "$S/modern" --steps "$SMOKE_STEPS" \
      --preset "$SMOKE_MODERN" "${bf16[@]}" --set train.batch_size=16
    smoke evaluate evaluate "$S/run"
    smoke evaluate-modern evaluate "$S/modern"
    smoke probe probe "$S/run"
    smoke finetune finetune "$S/run" --seeds 1 --epochs 1 --max-train 200 --max-len 64 \
      --no-control
    smoke embed embed "$S/run" --out "$S/embed" --steps "$SMOKE_STEPS" --batch-size 16 \
      --seq-len 64
    smoke retrieval retrieval "$S/run" --seeds 1 --steps "$SMOKE_STEPS" --batch-size 16 \
      --seq-len 64 --max-queries 50 --out "$S/retrieval.json"
    smoke export export "$S/run" "$S/hf" --verify
    smoke audit audit "$S/run"
  } | tee "$OUT/smoke.txt"
fi

if stage 3; then
  echo "== 3. attention paths alone =="
  SKIP_NAME="attention paths" within 200 "$PY" benchmarks/attention_paths.py "${PATH_ARGS[@]}" 2>&1 \
    | grep -v "^WARNING" | tee "$OUT/attention-paths.txt" || fail "attention paths"
  if grep -q FAILED "$OUT/attention-paths.txt"; then  # out of memory is a figure, not this
    fail "an attention path (see attention-paths.txt)"
  fi
fi

side_by_side() {  # side_by_side NAME SHAPE SEQ BATCH HF_COMPILE [compare_hf args...]
  local name=$1 shape=$2 seq=$3 batch=$4 compile=$5; shift 5
  echo "== $name: $shape, seq $seq, batch $batch =="
  SKIP_NAME="$name seq $seq" within 240 "$PY" benchmarks/compare_hf.py --shape "$shape" --dtype bf16 --synthetic \
    --seq "$seq" --batch "$batch" --peak-tflops "$PEAK" --hf-compile "$compile" --warmup 3 \
    --blocks "$BLOCKS" --steps-per-block "$SPB" "$@" \
    2>&1 | tee "$OUT/${name#* }-seq$seq.txt" | grep -v "^WARNING" || fail "$name seq $seq"
}

if stage 4; then
  for run in $CLASSIC_RUNS; do
    IFS=: read -r seq batch compile <<< "$run"
    side_by_side "4. classic" "$COMPARE_SHAPE" "$seq" "$batch" "$compile"
  done
fi

if stage 5; then
  for run in $MODERN_RUNS; do
    side_by_side "5. modern" "$MODERN_SHAPE" "${run%%:*}" "${run##*:}" "$HF_MODERN_COMPILE" \
      --documents "$DOCUMENTS"
  done
fi

if stage 6; then
  echo "== 6. end to end: $STEPS steps, one evaluation, one checkpoint (warm cache) =="
  run="$OUT/train"; rm -rf "$run"
  start=$(date +%s.%N)
  SKIP_NAME="end to end" within 240 "${CLOZAX[@]}" train --data "$OUT/data" --out "$run" \
    --steps "$STEPS" \
    --set "train.eval_every=$STEPS" --set "train.save_every=$STEPS" "${TRAIN[@]}" \
    > "$run.log" 2>&1 || fail "end to end (see $run.log)"
  wall=$("$PY" -c "import sys; print(float(sys.argv[1]) - float(sys.argv[2]))" "$(date +%s.%N)" "$start")
  if [ -f "$run/run.json" ]; then
    "$PY" -c "import json, sys; print('attention', json.load(open(sys.argv[1]))['attention'])" \
      "$run/run.json"
    "$PY" benchmarks/run_summary.py "$run" --wall "$wall" --first-step "$(first_step "$run.log")" \
      > "$OUT/train-summary.txt" || fail "the end-to-end run's summary"
    head -1 "$OUT/train-summary.txt" | tee "$OUT/train.txt"
  fi
fi

if stage 7; then
  echo "== 7. the device budget: from scratch for $DEVICE_MINUTES minutes, fine-tuned =="
  for candidate in $DEVICE_CANDIDATES; do
    SKIP_NAME="device budget $candidate" within $(( DEVICE_MINUTES * 60 + 240 )) \
      "$PY" benchmarks/budget_curve.py --minutes "$DEVICE_MINUTES" --candidate "$candidate" \
      --out "$OUT/device-budget/$candidate" "${DEVICE_ARGS[@]}" 2>&1 | grep -v "^WARNING" \
      | tee "$OUT/device-budget-$candidate.txt" \
      || fail "device budget $candidate (see device-budget-$candidate.txt)"
  done
fi

echo "gpu_check: $(( $(date +%s) - T0 )) s of the ${BUDGET} s budget"
[ -s "$OUT/skipped.txt" ] && echo "$(wc -l < "$OUT/skipped.txt") command(s) skipped for the budget"
if [ -s "$OUT/failed.txt" ]; then
  echo "$(wc -l < "$OUT/failed.txt") check(s) failed:"; sed 's/^/  /' "$OUT/failed.txt"
  exit 1
fi
if [ -s "$OUT/skipped.txt" ]; then exit 2; fi
echo "gpu_check: every stage ran and passed"
