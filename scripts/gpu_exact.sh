#!/usr/bin/env bash
# Exact mode on one GPU (issues 43/44), the one script a GPU sitting runs; under 7 minutes on an H200:
#   1. torch sees the GPU and Triton imports (versions recorded)
#   2. the kernels' accuracy and invariance tests natively (tests/test_kernels.py with the
#      interpreter off): bf16 and fp16 tl.dot on tensor cores, checkable only here
#   3. the linear kernel beside cuBLAS at the 8B shapes, M = 1, 16, 80: its chosen configuration and
#      the probe's grid, larger row tiles included (scripts/gpu_probe.py linear)
#   4. `gpu-kit --exact --steps lossless,cost`: bf16 speculative == plain on every prompt (batch 1/4/16,
#      random drafter and synthetic 0.7/0.9, chain and dynamic tree, CUDA graphs) and the exact plain
#      step beside the cuBLAS + torch-attention one at batch 1 and 16, for SHAPES (default Qwen3-8B,
#      the one shape not yet run, then Llama-3.1-8B)
#   5. `gpu-kit --exact --steps costs,sweep` on Llama-3.1-8B: the cost curves and the plain step's
#      bandwidth through the kernels, and the bf16 sweep at acceptance 0 and vLLM CI's profile
# Each kit run stops starting steps when its budget runs out. Results in $OUT (the device machine's
# return folder) or ./gpu-exact/. Needs torch with CUDA and triton; click, onnx_ir and pytest are
# installed from ./.gpu-wheels when missing. Usage: bash scripts/gpu_exact.sh [SECONDS [SHAPES]]
set -u -o pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
out=${OUT:-gpu-exact}
total=${1:-400}
shapes=${2:-qwen3-8b,llama-3.1-8b}
sweep_tokens=${SWEEP_TOKENS:-64}   # the kit's trusted cell is 16 prompts x 128 tokens x 2 repeats (~4 min a batch on 8B)
sweep_repeats=${SWEEP_REPEATS:-1}
mkdir -p "$out"
start=$SECONDS
for m in click onnx_ir pytest pluggy iniconfig; do
    python3 -c "import $m" 2>/dev/null || python3 -m pip install -q --no-deps --no-index .gpu-wheels/$m*.whl 2>&1 | tail -1
done
python3 -c "
import torch, triton
assert torch.cuda.is_available(), 'no CUDA GPU'
print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0))
" 2>&1 | tee "$out/versions.txt" || exit 1

timeout 120 python3 -m pytest tests/test_kernels.py -q -p no:cacheprovider --noconftest -o addopts="" \
    2>&1 | tail -15 | tee "$out/kernels.txt"
echo "kernels' tests: after $((SECONDS - start)) s" | tee -a "$out/kernels.txt"

timeout 120 python3 scripts/gpu_probe.py linear --budget-s 90 2>&1 | tee "$out/linear.txt"

left=$((total - (SECONDS - start)))
timeout $((left * 2 / 3)) python3 -m eagle_export.cli gpu-kit --exact --plot "" --shapes "$shapes" --steps lossless,cost --new-tokens 16 \
    --budget-s $((left * 2 / 3 - 60)) --report "$out/kit-lossless.json" 2>&1 | tee "$out/kit-lossless.txt"
echo "lossless and cost: after $((SECONDS - start)) s" | tee -a "$out/kit-lossless.txt"

left=$((total - (SECONDS - start)))
timeout "$left" python3 -m eagle_export.cli gpu-kit --exact --plot "" --shapes llama-3.1-8b --steps costs,sweep --sweep 0 --new-tokens "$sweep_tokens" --repeats "$sweep_repeats" \
    --budget-s $((left - 50)) --report "$out/kit-sweep.json" 2>&1 | tee "$out/kit-sweep.txt"
echo "done after $((SECONDS - start)) s" | tee -a "$out/kit-sweep.txt"
