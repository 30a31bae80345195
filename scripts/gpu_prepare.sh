#!/usr/bin/env bash
# Prepare the baggage scripts/gpu_check.sh needs on a bare GPU machine with no network
# (run here, where the package registries and the pulled models are):
#
#   bash scripts/gpu_prepare.sh
#
# .whl/        wheels the lent machine's image lacks (its torch stays): transformers in the
#              range this project tests, and what it and the store import that the image
#              does not have at the versions needed (CPython 3.12, manylinux x86-64)
# .gpu/models/ config and (gzipped) tokenizer of SmolLM2-135M and Qwen2.5-0.5B, from the
#              pulled zoo models: ttft_device.py --random-weights builds the models from them
#
# Both folders are meant to be ignored (add `/.whl/` and `/.gpu/` to .git/info/exclude) and
# carried with the call. Together with the repository they must stay under the lent
# machine's 64 MiB: move docs/results and the translators not measured aside for the call.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
py=${PYTHON:-python3}
home=${CAGKV_HOME:-$HOME/.cache/cagkv}
mkdir -p .whl .gpu/models
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
$py -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" -d .whl \
    transformers==5.25.0 huggingface_hub==2.4.0 kernels==0.19.1 httpx2==2.16.2 httpcore2==2.16.2 click==8.5.1 \
    tomlkit==0.15.3 truststore==0.10.5 regex==2026.11.19 sqlalchemy==2.1.9
for name in smollm2-135m qwen2.5-0.5b; do
    src=$home/models/$name
    [ -d "$src" ] || { echo "model $name not pulled: cagkv models pull $name" >&2; exit 1; }
    mkdir -p ".gpu/models/$name"
    for f in config.json tokenizer_config.json generation_config.json chat_template.jinja special_tokens_map.json; do
        [ -f "$src/$f" ] && cp "$src/$f" ".gpu/models/$name/"
    done
    gzip -c "$src/tokenizer.json" > ".gpu/models/$name/tokenizer.json.gz"
done
du -sh .whl .gpu
