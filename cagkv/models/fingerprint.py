"""Model fingerprint: a short hash of a model's config and weights that names it everywhere.

The fingerprint covers the architecture-defining config keys and, for each weight, its
name, dtype, shape and the sha256 of its bytes as stored. Runtime settings (dtype the
model is loaded in, attention implementation, transformers version, paths) are left
out, so the same checkpoint gets the same fingerprint on every machine. A tied
`lm_head.weight` is skipped (it is the embedding).

The tokenizer is not part of the fingerprint (translator cards record fingerprints);
`tokenizer_hash` names it separately, and a store records both.
"""

from __future__ import annotations

import hashlib
import json
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

if TYPE_CHECKING:
    import torch

# Config keys that do not change what the model computes.
_VOLATILE = {
    "transformers_version", "_name_or_path", "name_or_path", "dtype", "torch_dtype",
    "quantization_config", "use_cache", "_attn_implementation", "_attn_implementation_autoset",
    "attn_implementation", "output_attentions", "output_hidden_states", "return_dict",
    "_commit_hash", "gradient_checkpointing", "architectures", "auto_map", "use_return_dict",
    "torchscript", "chunk_size_feed_forward", "tie_encoder_decoder", "problem_type",
    "_output_attentions", "_experts_implementation",
}


def config_dict(config: Any) -> dict[str, Any]:
    """The architecture-defining part of an HF config (object or dict), JSON-ready."""
    data = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    return {k: v for k, v in sorted(data.items()) if k not in _VOLATILE and not k.startswith("_")}


def tensor_digest(tensor: "torch.Tensor") -> str:
    """sha256 of a tensor's raw bytes (any dtype, bf16 included)."""
    import torch

    flat = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()


def model_fingerprint(config: Any, state_dict: Mapping[str, "torch.Tensor"]) -> str:
    """16 hex characters identifying (config, weights). See the module docstring."""
    return _fingerprint(config, state_dict.keys(), state_dict.__getitem__)


def _fingerprint(config: Any, names: Iterable[str], get: Callable[[str], "torch.Tensor"]) -> str:
    cfg = config_dict(config)
    text_cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    tied = bool(getattr(text_cfg, "tie_word_embeddings", cfg.get("tie_word_embeddings", False)))
    h = hashlib.sha256()
    h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
    for name in sorted(names):
        if tied and name == "lm_head.weight":
            continue
        t = get(name)  # one tensor at a time: a folder is never held in memory whole
        h.update(f"\n{name}|{str(t.dtype)}|{tuple(t.shape)}|".encode())
        h.update(tensor_digest(t).encode())
    return h.hexdigest()[:16]


def folder_fingerprint(path: str | Path) -> str:
    """Fingerprint of a model folder (config.json + *.safetensors), read as stored on disk.

    A zoo model records it in `cagkv.json` at conversion; `load` reuses that record.
    """
    from safetensors import safe_open
    from transformers import AutoConfig

    folder = Path(path)
    config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {folder}")
    handles = [safe_open(str(file), framework="pt") for file in files]
    where = {key: h for h in handles for key in h.keys()}
    return _fingerprint(config, list(where), lambda key: where[key].get_tensor(key))


# Tokenized by `tokenizer_hash`: the ids capture normalizer / pre-tokenizer behaviour
# (spaces, digits, case, unicode) without hashing their version-dependent serialisation.
_PROBE = (
    " Hello  world!\n\tThe year 1987: 3.14159, $42.00 & 100%.\n\nCAPS caps Ca-ps don't "
    "naïve café Ångström ß 東京 😀 <b>x</b> {\"k\": [1, 2]}   end "
)
_TOKENIZER_HASHES: weakref.WeakKeyDictionary[Any, tuple[int, str]] = weakref.WeakKeyDictionary()


def tokenizer_hash(tokenizer: Any) -> str:
    """16 hex characters identifying how a tokenizer maps text to ids (cached per object).

    Covers the vocabulary, BPE merges, added and special tokens, the chat template (it
    makes the context prefix) and the ids of a fixed probe text. Serialisation details
    that change with the `tokenizers` version (option fields, JSON layout) are left out.
    """
    try:
        cached = _TOKENIZER_HASHES.get(tokenizer)
    except TypeError:  # not weak-referenceable: computed every time
        return _tokenizer_hash(tokenizer)
    if cached is not None and cached[0] == len(tokenizer):  # another length: tokens were added
        return cached[1]
    digest = _tokenizer_hash(tokenizer)
    _TOKENIZER_HASHES[tokenizer] = (len(tokenizer), digest)
    return digest


def _tokenizer_hash(tokenizer: Any) -> str:
    added = [[i, str(t), bool(getattr(t, "special", False))] for i, t in tokenizer.added_tokens_decoder.items()]
    state = {
        "model": _tokenizer_model(tokenizer),
        "added": sorted(added),
        "special": tokenizer.special_tokens_map,
        "chat_template": getattr(tokenizer, "chat_template", None),
        "probe": list(tokenizer.encode(_PROBE, add_special_tokens=False)),
    }
    return hashlib.sha256(json.dumps(state, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _tokenizer_model(tokenizer: Any) -> dict[str, Any]:
    """Type, vocabulary and merges of a fast tokenizer's model (the vocabulary of a slow one)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return {"vocab": tokenizer.get_vocab()}
    model = json.loads(backend.to_str()).get("model", {})
    # merges are "a b" strings in older `tokenizers` releases, [a, b] pairs in newer ones
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    return {"type": model.get("type"), "vocab": model.get("vocab"), "merges": merges}
