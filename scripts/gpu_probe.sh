#!/usr/bin/env bash
# One GPU sitting's probe (issues 43/44), under 7 minutes: versions; the kernels' tests natively; the
# linear kernel's configurations against cuBLAS at the 8B shapes (gpu_probe.py linear); where a plain
# step's time goes (gpu_probe.py profile); then `gpu-kit --exact` for the 1B shape in what is left.
# Results in $OUT (or ./gpu-probe/). Usage, from the checkout's root: bash scripts/gpu_probe.sh [SECONDS]
set -u -o pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
out=${OUT:-gpu-probe}
total=${1:-400}
mkdir -p "$out"
start=$SECONDS
for m in click:click onnx_ir:onnx_ir pytest:pytest pluggy:pluggy iniconfig:iniconfig; do  # pure-Python wheels carried along
    python3 -c "import ${m%%:*}" 2>/dev/null || python3 -m pip install -q --no-deps --no-index .gpu-wheels/${m##*:}*.whl 2>&1 | tail -1
done
{ python3 -c "
import torch, triton
assert torch.cuda.is_available(), 'no CUDA GPU'
print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0), 'python', __import__('sys').version.split()[0])
"; nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv; } 2>&1 | tee "$out/versions.txt"

timeout 150 python3 -m pytest tests/test_kernels.py -q -p no:cacheprovider --noconftest -o addopts="" -x \
    2>&1 | tail -25 | tee "$out/kernels.txt"
echo "kernels' tests: after $((SECONDS - start)) s" | tee -a "$out/kernels.txt"

timeout 170 python3 scripts/gpu_probe.py linear --budget-s 140 2>&1 | tee "$out/linear.txt"
echo "linear probe: after $((SECONDS - start)) s" | tee -a "$out/linear.txt"

timeout 100 python3 scripts/gpu_probe.py profile 2>&1 | tee "$out/profile.txt"
echo "profile: after $((SECONDS - start)) s" | tee -a "$out/profile.txt"

left=$((total - (SECONDS - start)))
if [ "$left" -gt 60 ]; then
    timeout "$left" python3 -c "from eagle_export.cli import main; main()" gpu-kit --exact --shapes llama-3.2-1b \
        --budget-s $((left - 45)) --report "$out/kit-exact.json" --plot "" 2>&1 | tee "$out/kit.txt"
fi
echo "done after $((SECONDS - start)) s" | tee -a "$out/kit.txt"
