#!/usr/bin/env bash
# The GPU checks and benchmarks, in one go, on a machine with a CUDA GPU and no network.
#
#   bash scripts/gpu_check.sh OUT_DIR
#
# 1. the CUDA tests (tests/unit/test_device.py: translation, prefill, assembly and the fused
#    question forward on the GPU against the CPU; every dispatch implementation),
# 2. benchmarks/dispatch.py on large token batches (bfloat16),
# 3. benchmarks/ttft_device.py: translate (r = 0, and the card's default refresh 0.5) against native prefill, SmolLM2-135M ->
#    Qwen2.5-0.5B, 512 to 32k tokens.
#
# Where cagkv is not installed (a bare machine with its own torch), the package is laid out
# under /tmp/cagkv_pkg from this checkout, and wheels in .whl/ (transformers and the rest of
# what the image lacks) are installed under /tmp/cagkv_site. `bash scripts/gpu_prepare.sh`
# fetches the wheels and the model folders beforehand. Models: the folders in
# .gpu/models/NAME (config and tokenizer only, tokenizer.json may be gzipped; random
# weights: see ttft_device.py) or, when present, the zoo's converted models (real weights).
set -uo pipefail
out=${1:?usage: bash scripts/gpu_check.sh OUT_DIR}
mkdir -p "$out"
repo=$(cd "$(dirname "$0")/.." && pwd)
models=$repo/.gpu/models
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

if ls "$repo"/.whl/*.whl >/dev/null 2>&1; then
    $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/cagkv_site "$repo"/.whl/*.whl || exit 1
    export PYTHONPATH=/tmp/cagkv_site${PYTHONPATH:+:$PYTHONPATH}
fi
if ! $py -c "import cagkv.stores" 2>/dev/null; then  # the source tree maps stores/ and cli/ into cagkv at install
    pkg=/tmp/cagkv_pkg
    rm -rf "$pkg" && mkdir -p "$pkg"
    cp -r "$repo"/cagkv "$repo"/tests "$repo"/benchmarks "$repo"/examples "$repo"/pyproject.toml "$pkg"/
    cp -r "$repo"/stores "$pkg"/cagkv/stores && cp -r "$repo"/cli "$pkg"/cagkv/cli
    export PYTHONPATH=$pkg:${PYTHONPATH:-}
    repo=$pkg
fi
cd "$repo" || exit 1
for gz in "$models"/*/tokenizer.json.gz; do [ -f "$gz" ] && gunzip -kf "$gz"; done

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv 2>&1 | tee "$out/gpu.txt"
$py -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())" 2>&1 | tee -a "$out/gpu.txt"

echo "== CUDA tests"
$py -m pytest -q -p no:cacheprovider tests/unit/test_device.py 2>&1 | tee "$out/pytest_device.log" | tail -15

echo "== dispatch"
[ -n "${SKIP_DISPATCH:-}" ] || for n in 16384 262144; do
    $py benchmarks/dispatch.py --tokens $n --grid 4:1,4:2,8:1,8:2 --impls dense,loop,bmm,grouped --repeats 20 \
        --out "$out/dispatch_cuda_$n.json" --markdown "$out/dispatch_cuda_$n.md" 2>&1 | tail -18
done

echo "== ttft"
if [ -d "$models/smollm2-135m" ]; then
    src=$models/smollm2-135m tgt=$models/qwen2.5-0.5b weights=--random-weights
else
    src=smollm2-135m tgt=qwen2.5-0.5b weights=
fi
$py benchmarks/ttft_device.py --canonical "$src" --target "$tgt" $weights \
    --translator cagkv/translators/smollm2-135m__qwen2.5-0.5b --lengths ${LENGTHS:-512,2048,8192,32768} \
    --refresh ${REFRESH:-0,0.5} --repeats ${REPEATS:-10} --out "$out/ttft_device_smollm2_qwen25.json" --markdown "$out/ttft_device_smollm2_qwen25.md" --profile "$out/profile_translate.txt" 2>&1 | tail -12
