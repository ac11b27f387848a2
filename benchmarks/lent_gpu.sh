#!/usr/bin/env bash
# One prepared run of the benchmarks on a lent GPU machine (the `device` tool's `run`), in at most
# BUDGET seconds (default 570). Results go to $OUT (JSON + logs). Sections, most wanted first, each
# cut off at its share of what is left so that a slow one cannot starve the rest:
#   1. serve    benchmarks.serve on SmolLM2-135M's shape twin (its config + tokenizer, random weights:
#               the 98 MB GGUF cannot travel) vs transformers generate on CUDA (issue 15)
#   2. break_even and kernels: benchmarks.kernels on the GPU: GAE scan vs associative, fractions of the
#               device's bandwidth (14)
#   3. learner  benchmarks.learner, flat vs tree-packed rows (14)
#   4. patr     benchmarks.serve's PaTR rollouts with the prefix cache on vs off (15)
# Measured on an H200 (2026-12-04): serve 168 s, break_even ~60 s, kernels at 3 sizes 72 s; the
# PaTR warm start did not finish in 158 s. Use BUDGET=540 and the run's timeout_s 590.
#
# Before the call, here (see the device README for the wheel command):
#   python -m benchmarks.shape_twin smollm2-135m .gpu/smollm2-135m-shape --no-weights
#   pip download ... -d .whl  fastapi starlette pydantic pydantic_core annotated-types typing-inspection
#                             typing_extensions uvicorn httptools gguf omegaconf tensorboardX opentelemetry-api
# and call run with carry [".whl", ".gpu"] and command `bash benchmarks/lent_gpu.sh`.
set -u
OUT=${OUT:-$PWD/gpu_out}
BUDGET=${BUDGET:-570}
mkdir -p "$OUT"
LOG=$OUT/log.txt  # every section's output (what comes back is at most 8 files: this log and 5 JSON)
START=$(date +%s)
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=3 HF_HUB_OFFLINE=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.5}  # leave room for torch
PY=${PY:-python3}

if [ -d .whl ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=$PYTHONPATH:/tmp/site
fi

left() { echo $((BUDGET - ($(date +%s) - START))); }
# section NAME SHARE CMD...: run CMD with a timeout of SHARE percent of the time left (at least 20 s)
section() {
  local name=$1 share=$2; shift 2
  local t=$(( $(left) * share / 100 ))
  if [ "$t" -lt 20 ]; then echo "== $name: skipped, $(left) s left" | tee -a "$LOG"; return; fi
  echo "== $name: up to $t s: $*" | tee -a "$LOG"
  local t0=$(date +%s)
  timeout -k 5 "$t" "$@" > "/tmp/$name.log" 2>&1
  local rc=$?
  cat "/tmp/$name.log" >> "$LOG"
  echo "== $name: rc $rc in $(( $(date +%s) - t0 )) s" | tee -a "$LOG"
  tail -n 40 "/tmp/$name.log"
}

{
  nvidia-smi -L
  $PY -c "import jax, jaxlib, flax, optax, torch, transformers; print('jax', jax.__version__, jax.devices()); \
print('flax', flax.__version__, 'optax', optax.__version__, 'torch', torch.__version__, torch.cuda.is_available(), \
'transformers', transformers.__version__)"
  $PY -c "import jaxprm.serve, jaxprm.train, benchmarks.serve; print('imports ok')"
} 2>&1 | tee -a "$LOG"

TWIN=/tmp/smollm2-135m-twin
$PY -m benchmarks.shape_twin .gpu/smollm2-135m-shape $TWIN 2>&1 | tail -n 2 | tee -a "$LOG"

section serve 45 $PY -m benchmarks.serve --models $TWIN --hf-model $TWIN --concurrency 1,8,32,64 \
  --no-cache-levels 1,32 --hf-batches 1,8,32,64 --max-tokens 64 --requests-per-client 2 --skip-patr \
  --json "$OUT/serve_gpu.json"
section break_even 15 $PY -m benchmarks.kernels --break-even --repeats 10 --json "$OUT/gae_break_even_gpu.json"
section kernels 30 $PY -m benchmarks.kernels --sizes 256x512,256x8192,1024x8192 --repeats 5 \
  --kernels gae,compute,policy,ceiling --json "$OUT/kernels_gpu.json"
section learner 40 $PY -m benchmarks.learner --repeats 3 --json "$OUT/learner_gpu.json"
# last: the tiny policy's warm start alone took over 158 s on the H200 (2026-12-04)
section patr 95 $PY -m benchmarks.serve --models "" --skip-hf --patr-rounds 3 --json "$OUT/serve_patr_gpu.json"
echo "done in $(( $(date +%s) - START )) s" | tee -a "$LOG"
