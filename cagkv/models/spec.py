"""ModelSpec: the facts about a causal LM that KV caching needs, read from its HF config.

Supported families: `llama`, `qwen2`, `gemma3_text` (RoPE, possibly per layer type and
scaled) and `gpt2` (learned absolute positions: keys carry no rotation, blocks keep
their positions). Shapes use L layers, H kv heads, D head_dim.

Example:
    >>> from transformers import AutoConfig
    >>> spec = ModelSpec.from_config(AutoConfig.from_pretrained(path))   # doctest: +SKIP
    >>> spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.sliding_window[0]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cagkv.errors import UsageError
from cagkv.models.rope import RopeLayer, rope_layer_from_config

if TYPE_CHECKING:
    from transformers import PretrainedConfig

SUPPORTED_FAMILIES = ("llama", "qwen2", "gemma3_text", "gpt2")


class UnsupportedModelError(UsageError):
    """A model family whose cache layout cagkv does not know."""


@dataclass(frozen=True)
class ModelSpec:
    """Cache-relevant facts of one model.

    rope[i] is layer i's RoPE (None: learned positions); sliding_window[i] is layer i's
    window in tokens (None: full attention). Keys in an HF cache are
    `[B, H, T, D]`, after k-norm (when has_k_norm) and after RoPE.
    """

    family: str
    num_layers: int
    num_kv_heads: int
    num_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    rope: list[RopeLayer | None]
    sliding_window: list[int | None]
    layer_types: list[str]
    has_k_norm: bool
    bos_token_id: int | None
    eos_token_ids: list[int]
    learned_positions: bool
    max_position_embeddings: int | None
    tie_word_embeddings: bool
    adds_bos_token: bool | None = None  # tokenizer facts (None when no tokenizer was given)
    has_chat_template: bool | None = None
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def kv_dim(self) -> int:
        """H * D: the width of one layer's keys (or values) per token."""
        return self.num_kv_heads * self.head_dim

    @property
    def is_hybrid(self) -> bool:
        """True when some layers slide and others attend to everything (Gemma-3)."""
        return len({w is None for w in self.sliding_window}) > 1

    def bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """L * 2 * H * D * bytes: the size of one token's cache."""
        return self.num_layers * 2 * self.kv_dim * dtype_bytes

    @classmethod
    def from_config(cls, config: "PretrainedConfig", tokenizer: Any = None) -> "ModelSpec":
        """Read a spec from an HF config (a multimodal config contributes its text config)."""
        config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        family = getattr(config, "model_type", None)
        if family not in SUPPORTED_FAMILIES:
            raise UnsupportedModelError(
                f"unsupported model family {family!r}: expected one of {', '.join(SUPPORTED_FAMILIES)}"
            )
        if family == "gpt2":
            spec = _gpt2(config)
        else:
            spec = _rotary(config, family)
        if tokenizer is not None:
            spec = _with_tokenizer(spec, tokenizer)
        return spec


def _eos_ids(config: Any) -> list[int]:
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, (list, tuple)) else [int(eos)]


def _rotary(config: Any, family: str) -> ModelSpec:
    num_layers = config.num_hidden_layers
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    layer_types = list(getattr(config, "layer_types", None) or ["full_attention"] * num_layers)
    assert len(layer_types) == num_layers, (len(layer_types), num_layers)
    window = getattr(config, "sliding_window", None)
    sliding = [window if t == "sliding_attention" and window else None for t in layer_types]
    per_type = {t: rope_layer_from_config(config, t) for t in sorted(set(layer_types))}
    return ModelSpec(
        family=family,
        num_layers=num_layers,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        num_heads=heads,
        head_dim=head_dim,
        hidden_size=config.hidden_size,
        vocab_size=config.vocab_size,
        rope=[per_type[t] for t in layer_types],
        sliding_window=sliding,
        layer_types=layer_types,
        has_k_norm=family in ("gemma3_text",),
        bos_token_id=getattr(config, "bos_token_id", None),
        eos_token_ids=_eos_ids(config),
        learned_positions=False,
        max_position_embeddings=getattr(config, "max_position_embeddings", None),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
    )


def _gpt2(config: Any) -> ModelSpec:
    heads = config.n_head
    return ModelSpec(
        family="gpt2",
        num_layers=config.n_layer,
        num_kv_heads=heads,
        num_heads=heads,
        head_dim=config.n_embd // heads,
        hidden_size=config.n_embd,
        vocab_size=config.vocab_size,
        rope=[None] * config.n_layer,
        sliding_window=[None] * config.n_layer,
        layer_types=["full_attention"] * config.n_layer,
        has_k_norm=False,
        bos_token_id=getattr(config, "bos_token_id", None),
        eos_token_ids=_eos_ids(config),
        learned_positions=True,
        max_position_embeddings=config.n_positions,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", True)),
    )


def _with_tokenizer(spec: ModelSpec, tokenizer: Any) -> ModelSpec:
    from dataclasses import replace

    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else spec.bos_token_id
    adds_bos = bool(ids) and bos is not None and ids[0] == bos
    return replace(
        spec,
        adds_bos_token=adds_bos,
        has_chat_template=bool(getattr(tokenizer, "chat_template", None)),
    )
