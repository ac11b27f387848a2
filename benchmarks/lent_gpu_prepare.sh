#!/usr/bin/env bash
# Make, here, what benchmarks/lent_gpu.sh needs on a lent GPU machine (the `device` tool's `run`),
# and print the two calls. Run it from the repository root with the project's venv active:
#
#   bash benchmarks/lent_gpu_prepare.sh
#
# What a call sends is the working tree plus `carry`, at most 64 MiB, and no .git. So:
#   .gpu/     SmolLM2-135M's config and tokenizer (its shape twin, no weights), the GGUF's sha256,
#             and COMMIT, the commit the tree was copied from (results JSON record it: JAXPRM_COMMIT)
#   .gpu_a/   the first half of the 98 MB SmolLM2-135M-Instruct GGUF   (carried by call 1)
#   .gpu_b/   the second half                                         (carried by call 2)
#   .whl/     wheels of the few packages the machine's image lacks (Python 3.12)
# Call 1 stashes its half in /tmp and runs the kernel/serve/learner sections; call 2, made at once
# (a machine goes back 30 s after a call), joins the halves, checks the sha256 and runs the SmolLM2
# flat-vs-PaTR comparison. If the machine went back between the calls, call 2 says so and stops.
set -euo pipefail
PY=${PY:-python}
cd "$(git rev-parse --show-toplevel)"
for d in .gpu .gpu_a .gpu_b .whl; do
  grep -qxF "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >> .git/info/exclude
done
rm -rf .gpu .gpu_a .gpu_b && mkdir -p .gpu .gpu_a .gpu_b

if [ -n "$(git status --porcelain --untracked-files=no)" ]; then
  echo "warning: the tree has uncommitted changes; results will name $(git rev-parse --short HEAD) all the same" >&2
fi
git rev-parse HEAD > .gpu/COMMIT

$PY -m benchmarks.shape_twin smollm2-135m .gpu/smollm2-135m-shape --no-weights

GGUF=$($PY -c "from jaxprm.models import smollm2_gguf_path; print(smollm2_gguf_path())")
$PY -m benchmarks.gpu_halves split "$GGUF" .gpu_a .gpu_b .gpu/smollm2.gguf.sha256

# the packages the image lacks (device KINDS.md), as manylinux wheels for its Python 3.12, at the
# versions installed here
WHEELS="fastapi starlette pydantic pydantic_core annotated-types typing-inspection typing_extensions uvicorn
httptools gguf omegaconf antlr4-python3-runtime tensorboardX opentelemetry-api importlib_metadata"
rm -rf .whl && mkdir .whl
for w in $WHEELS; do
  v=$($PY -m pip show "$w" 2>/dev/null | awk '/^Version:/ {print $2}' || true)
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "$w${v:+==$v}" 2>/dev/null || echo "warning: no wheel for $w${v:+==$v}" >&2
done

du -sh .gpu .gpu_a .gpu_b .whl
cat <<EOF
Now, one right after the other:
  run(command="BUDGET=150 bash benchmarks/lent_gpu.sh", carry=[".whl", ".gpu", ".gpu_a"], timeout_s=200)
  run(command="SECTIONS=smollm2 BUDGET=480 bash benchmarks/lent_gpu.sh", carry=[".whl", ".gpu", ".gpu_b"], timeout_s=530)
(about 13 of the 15 device minutes with the machine's start; call 1's sections were measured on an
H200 before, so it is the one to cut)
EOF
