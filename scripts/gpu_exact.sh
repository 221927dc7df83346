#!/usr/bin/env bash
# Exact mode on one GPU (issue 43), the one script a GPU sitting runs; under 9 minutes on one H100.
#   1. torch sees the GPU and Triton imports (versions recorded)
#   2. the kernels' accuracy and invariance tests natively (tests/test_kernels.py with the
#      interpreter off): bf16 and fp16 tl.dot on tensor cores, checkable only here; the planted
#      split-K-by-M and KV-split-by-count variants must still fail there
#   3. `gpu-kit --exact`: bf16 speculative == plain on every prompt (batch 1/4/16, random drafter and
#      synthetic 0.7/0.9, chain and dynamic tree, eager and CUDA graphs) and the exact plain step
#      beside the cuBLAS + torch-attention one at batch 1 and 16, for Llama-3.2-1B then Llama-3.1-8B
#      (random weights made on the GPU); the kit stops starting steps when its budget runs out.
# Results in $OUT (the device machine's return folder) or ./gpu-exact/: versions.txt, kernels.txt,
# kit.txt and gpu-exact.json (written after every step, so a run cut short keeps what it measured).
# Needs on the machine: torch with CUDA, triton, pytest, click (nothing of this package installed:
# it runs from the checkout). Usage, from the checkout's root: bash scripts/gpu_exact.sh
set -u -o pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
out=${OUT:-gpu-exact}
mkdir -p "$out"
start=$SECONDS

python3 -c "
import torch, triton
assert torch.cuda.is_available(), 'no CUDA GPU'
print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0))
" 2>&1 | tee "$out/versions.txt" || exit 1
git log -1 --format='commit %H' 2>/dev/null | tee -a "$out/versions.txt"

# --noconftest: the suite's conftest sets the interpreter on and loads build-time modules; these tests need neither
timeout 180 python3 -m pytest tests/test_kernels.py -q -p no:cacheprovider --noconftest -o addopts="" \
    2>&1 | tee "$out/kernels.txt"
echo "kernels' tests: exit $? after $((SECONDS - start)) s" | tee -a "$out/kernels.txt"

left=$((530 - (SECONDS - start)))
timeout "$left" python3 -c "from eagle_export.cli import main; main()" gpu-kit --exact \
    --shapes llama-3.2-1b,llama-3.1-8b --budget-s $((left - 200)) --report "$out/gpu-exact.json" --plot "" \
    2>&1 | tee "$out/kit.txt"
echo "gpu-kit --exact: exit $? after $((SECONDS - start)) s" | tee -a "$out/kit.txt"
