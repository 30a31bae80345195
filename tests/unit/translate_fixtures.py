"""Tiny random model pairs with two different tokenizers, for translator tests (no files)."""

from __future__ import annotations

import functools

import torch

from cagkv.align import token_offsets
from cagkv.kv import KVBlock
from cagkv.models.cache import extract_kv, full_cache
from cagkv.models.fingerprint import model_fingerprint
from cagkv.models.loading import LoadedModel
from cagkv.models.spec import ModelSpec

CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun all day.",
    "Naïve café owners in Zürich sell crème brûlée; they open at nine and close at five.",
    "Rivers flow to the sea. The sea is salty because rivers carry minerals from rocks.",
    "Python lists are mutable sequences. Tuples are immutable. Sets hold unique items.",
    "Question: what follows? Answer: the text. Context: a chunk of a document.",
] * 3

FAMILIES = ("llama", "gemma3", "qwen2")


@functools.lru_cache(maxsize=None)
def tokenizer(kind: str):
    """'bl': byte-level BPE (SmolLM/Qwen style); 'sp': Metaspace BPE with byte fallback (Gemma style)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if kind == "bl":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            special_tokens=["<eos>"], show_progress=False,
        )
    else:
        tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        specials = ["<unk>", "<eos>", *[f"<0x{i:02X}>" for i in range(256)]]
        trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=specials, show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>" if kind == "sp" else None)


def _config(family: str, layers: int):
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config

    common = dict(vocab_size=512, max_position_embeddings=512, attn_implementation="sdpa")
    if family == "llama":
        return LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, **common)
    if family == "qwen2":
        return Qwen2Config(hidden_size=48, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=12, **common)
    if family == "gemma3":
        types = ["sliding_attention" if (i + 1) % 3 else "full_attention" for i in range(layers)]
        return Gemma3TextConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=2,
                                num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32, sliding_window=64,
                                layer_types=types, **common)
    raise ValueError(family)


@functools.lru_cache(maxsize=None)
def tiny_model(family: str, layers: int = 4, seed: int = 0, tok: str | None = None) -> LoadedModel:
    """A random tiny causal LM of `family`, frozen, in eval mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = _config(family, layers)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # random k/q-norm weights so the norm's scale matters in tests
        for name, p in model.named_parameters():
            if name.endswith(("k_norm.weight", "q_norm.weight")):
                p.normal_(0.0, 0.3)
    for p in model.parameters():
        p.requires_grad_(False)
    tokz = tokenizer(tok or ("sp" if family == "gemma3" else "bl"))
    fp = model_fingerprint(cfg, model.state_dict())
    return LoadedModel(model=model, tokenizer=tokz, spec=ModelSpec.from_config(cfg), fingerprint=fp,
                       name=f"tiny-{family}-{layers}", config=cfg)


def chunk_block(loaded: LoadedModel, text: str) -> KVBlock:
    """The model's own position-free block of `text`, prefilled alone (no prefix) at positions 0.."""
    ids, offs = token_offsets(loaded.tokenizer, text)
    with torch.no_grad():
        out = loaded.model(input_ids=ids[None], cache=full_cache(), use_cache=True)
    k, v = extract_kv(out.cache, loaded.spec, torch.arange(ids.numel()))
    return KVBlock(k, v, ids, offs, text, loaded.fingerprint)


def saved_translator(folder):
    """A random tiny translator (llama 4 layers -> gemma3 6 layers) saved as an artifact in
    `folder`: returns the source, the target, its network and the artifact folder."""
    from cagkv.translate.artifact import save_artifact
    from cagkv.translate.mot import MoTTranslator
    from cagkv.translate.train import TrainConfig, make_mot_config

    src, tgt = tiny_model("llama", 4), tiny_model("gemma3", 6)
    torch.manual_seed(0)
    mot = MoTTranslator(make_mot_config(src, tgt, TrainConfig(d_model=24, d_expert=32, experts=2, top_k=1,
                                                              init="random"))).eval()
    card = {"source": {"fingerprint": src.fingerprint}, "target": {"fingerprint": tgt.fingerprint}}
    return src, tgt, mot, save_artifact(folder, mot, card, dtype=torch.float32)
