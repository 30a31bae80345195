"""Model fingerprint: a short hash of a model's config and weights that names it everywhere.

The fingerprint covers the architecture-defining config keys and, for each weight, its
name, dtype, shape and the sha256 of its bytes as stored. Runtime settings (dtype the
model is loaded in, attention implementation, transformers version, paths) are left
out, so the same checkpoint gets the same fingerprint on every machine. A tied
`lm_head.weight` is skipped (it is the embedding).
"""

from __future__ import annotations

import hashlib
import json
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
