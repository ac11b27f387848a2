#!/usr/bin/env bash
# One prepared run of the benchmarks on a lent GPU machine (the `device` tool's `run`), in at most
# BUDGET seconds (default 570). Results go to $OUT (JSON + logs). SECTIONS (default: all but
# smollm2) picks what runs, in this order, each cut off at its share of what is left so that a slow
# one cannot starve the rest:
#   serve       benchmarks.serve on SmolLM2-135M's shape twin (its config + tokenizer, random
#               weights) vs transformers generate on CUDA (issue 15)
#   break_even, kernels: benchmarks.kernels on the GPU: GAE scan vs associative, fractions of the
#               device's bandwidth (14)
#   learner     benchmarks.learner, flat vs tree-packed rows (14)
#   patr        benchmarks.serve's PaTR rollouts with the prefix cache on vs off (15)
#   smollm2     the real SmolLM2-135M-Instruct on FrozenLake: flat GRPO vs PaTR, 2 seeds, the four
#               runs at once on the one GPU, benchmarks.recipe over configs/smollm2_frozenlake.yaml
#               with a run's steps cut to fit (issue 39); JSON + every run's metrics
# Measured on an H200 (2026-12-04): serve 168 s, break_even ~60 s, kernels at 3 sizes 72 s; the
# PaTR warm start did not finish in 158 s. The smollm2 section has not run on a GPU yet. Both of its
# arms start from configs/smollm2_frozenlake.yaml's cached LoRA SFT warm start (its first run pays
# it; the untuned instruct model answered invalidly on every turn of a 2026-12-07 CPU dry run).
#
# The 98 MB GGUF is over what one call carries (64 MiB with the tree), so it travels in two halves
# in two calls made one right after the other; `bash benchmarks/lent_gpu_prepare.sh` makes
# everything (.gpu, .gpu_a, .gpu_b, .whl) and prints the two calls. A call carrying .gpu_a stashes
# that half in /tmp; the smollm2 section joins it with .gpu_b's and checks the sha256.
set -u
OUT=${OUT:-$PWD/gpu_out}
BUDGET=${BUDGET:-570}
mkdir -p "$OUT"
LOG=$OUT/log.txt  # every section's output (what comes back is at most 8 files: this log and 5 JSON)
START=$(date +%s)
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=3 HF_HUB_OFFLINE=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.5}  # leave room for torch
PY=${PY:-python3}
SECTIONS=${SECTIONS:-serve break_even kernels learner patr}
wants() { case " $SECTIONS " in *" $1 "*) return 0;; esac; return 1; }
# the tree came without .git: the commit it was copied from, for every results JSON
[ -f .gpu/COMMIT ] && export JAXPRM_COMMIT=$(cat .gpu/COMMIT)
STASH=/tmp/jaxprm-gguf
# a call carrying .gpu_a keeps that half here for the next call's .gpu_b (benchmarks/gpu_halves.py)
if [ -d .gpu_a ]; then mkdir -p $STASH && cp .gpu_a/* $STASH/ && echo "stashed $(ls .gpu_a) in $STASH"; fi

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
if wants serve || wants patr; then
  $PY -m benchmarks.shape_twin .gpu/smollm2-135m-shape $TWIN 2>&1 | tail -n 2 | tee -a "$LOG"
fi

# SmolLM2 on FrozenLake, flat GRPO vs PaTR (the config's estimator for both), 2 seeds, all four runs
# at once (16 cores, one GPU: each process takes a fifth of its memory); a run's steps and evals are
# cut so that the four finish inside the section's share
# a dry run on a CPU: SMOLLM2_STEPS=1 SMOLLM2_SEEDS=0 SMOLLM2_PARALLEL=1 SMOLLM2_EXTRA=key=value,key=value
SMOLLM2_STEPS=${SMOLLM2_STEPS:-12} SMOLLM2_SEEDS=${SMOLLM2_SEEDS:-0 1} SMOLLM2_PARALLEL=${SMOLLM2_PARALLEL:-4}
if wants smollm2; then
  if GGUF=$($PY -m benchmarks.gpu_halves join $STASH .gpu_b .gpu/smollm2.gguf.sha256 /tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf 2>>"$LOG"); then
    CUT="model.name=$GGUF,steps=$SMOLLM2_STEPS,eval.every_steps=4,eval.num_tasks=32,checkpoint.every_steps=1000${SMOLLM2_EXTRA:+,$SMOLLM2_EXTRA}"
    section smollm2 95 env XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 $PY -m benchmarks.recipe \
      --config configs/smollm2_frozenlake.yaml --seeds $SMOLLM2_SEEDS --parallel $SMOLLM2_PARALLEL --out /tmp/smollm2_runs \
      --variant "flat=$CUT,rollout.strategy=flat" --variant "patr=$CUT,rollout.strategy=patr" --json "$OUT/smollm2_gpu.json"
    # every run's metrics, also when the section was cut off before its JSON (not its checkpoints)
    (cd /tmp && find smollm2_runs \( -name metrics.jsonl -o -name config.yaml -o -name summary.json \) -print \
      | tar czf "$OUT/smollm2_runs.tgz" -T -)
  else
    echo "== smollm2: skipped: $(tail -n 1 "$LOG")" | tee -a "$LOG"
  fi
fi
wants serve && section serve 45 $PY -m benchmarks.serve --models $TWIN --hf-model $TWIN --concurrency 1,8,32,64 \
  --no-cache-levels 1,32 --hf-batches 1,8,32,64 --max-tokens 64 --requests-per-client 2 --skip-patr \
  --json "$OUT/serve_gpu.json"
wants break_even && section break_even 15 $PY -m benchmarks.kernels --break-even --repeats 10 \
  --json "$OUT/gae_break_even_gpu.json"
wants kernels && section kernels 30 $PY -m benchmarks.kernels --sizes 256x512,256x8192,1024x8192 --repeats 5 \
  --kernels gae,compute,policy,ceiling --json "$OUT/kernels_gpu.json"
wants learner && section learner 40 $PY -m benchmarks.learner --repeats 3 --json "$OUT/learner_gpu.json"
# last: the tiny policy's warm start alone took over 158 s on the H200 (2026-12-04)
wants patr && section patr 95 $PY -m benchmarks.serve --models "" --skip-hf --patr-rounds 3 \
  --json "$OUT/serve_patr_gpu.json"
echo "done in $(( $(date +%s) - START )) s" | tee -a "$LOG"
