#!/usr/bin/env bash
# BERT-base shapes, bf16 compute, cuDNN fused attention on one NVIDIA GPU: clozax tokens/s and
# MFU against the dense bf16 peak (989 TFLOP/s on H100/H200), with HF transformers side by side
# (torch.autocast bf16, its default SDPA attention) in the same process, alternating blocks.
#
#   benchmarks/gpu.sh [OUT_DIR]          # python3 must have CUDA jax, torch and transformers
#
# Environment: PYTHON (default python3), BATCHES (default "256 512"), SHAPE (default base),
# ATTENTIONS (default "cudnn xla": cuDNN with per-row lengths vs XLA's masked attention),
# PEAK_TFLOPS (default 989). Results go to OUT_DIR (default runs/gpu-bench) and stdout.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${1:-runs/gpu-bench}
SHAPE=${SHAPE:-base}
BATCHES=${BATCHES:-256 512}
ATTENTIONS=${ATTENTIONS:-cudnn xla}
PEAK_TFLOPS=${PEAK_TFLOPS:-989}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# JAX and torch share the GPU in one process: JAX takes half, torch the rest.
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.5}

if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv \
    | tee "$OUT/gpu.txt"
fi
"$PY" -c "import jax, torch, transformers; print('jax', jax.__version__, jax.devices()); \
print('torch', torch.__version__, 'cuda' if torch.cuda.is_available() else 'cpu', \
'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"

# Order: the headline configuration first, then the attention comparison, then larger batches.
first_attn=${ATTENTIONS%% *} first_batch=${BATCHES%% *}
runs="$first_attn:$first_batch"
for attn in $ATTENTIONS; do [ "$attn" = "$first_attn" ] || runs="$runs $attn:$first_batch"; done
for batch in $BATCHES; do [ "$batch" = "$first_batch" ] || runs="$runs $first_attn:$batch"; done
for run in $runs; do
  attn=${run%%:*} batch=${run##*:}
  echo "== $SHAPE bf16, attention $attn, batch $batch =="
  # One failing configuration (say, no cuDNN attention on this GPU) does not stop the others.
  if ! "$PY" benchmarks/compare_hf.py --shape "$SHAPE" --dtype bf16 --synthetic \
      --batch "$batch" --set "model.attention=\"$attn\"" --peak-tflops "$PEAK_TFLOPS" \
      --warmup 3 --blocks 4 --steps-per-block 10 2>&1 | tee "$OUT/$SHAPE-bf16-$attn-b$batch.txt"
  then
    echo "FAILED: $SHAPE bf16, attention $attn, batch $batch (see the lines above)"
  fi
done
