"""ModelSpec read from HF configs of every supported family."""

from __future__ import annotations

import pytest
from transformers import BertConfig, Gemma3TextConfig, Qwen2Config

from cagkv.models import ModelSpec, UnsupportedModelError

from tiny_lms import tiny, tiny_config


def test_llama_spec():
    s = tiny("llama").spec
    assert (s.family, s.num_layers, s.num_kv_heads, s.num_heads, s.head_dim) == ("llama", 3, 2, 4, 16)
    assert s.sliding_window == [None] * 3 and not s.is_hybrid
    assert not s.has_k_norm and not s.learned_positions
    assert [r.base for r in s.rope] == [10000.0] * 3
    assert s.kv_dim == 32 and s.bytes_per_token(2) == 3 * 2 * 32 * 2


def test_gemma3_spec_is_hybrid_with_two_bases():
    s = tiny("gemma3_text").spec
    assert s.has_k_norm and s.is_hybrid
    assert s.sliding_window == [8, 8, None, 8]
    assert [r.base for r in s.rope] == [1e4, 1e4, 1e6, 1e4]


def test_gemma3_default_pattern_matches_real_model_layout():
    # Gemma-3-270M: 18 layers, full attention at 5, 11, 17, window 512, θ 10k local / 1M global.
    cfg = Gemma3TextConfig(num_hidden_layers=18, sliding_window=512, head_dim=256, num_key_value_heads=1,
                           num_attention_heads=4, hidden_size=640, intermediate_size=2048, vocab_size=1000)
    s = ModelSpec.from_config(cfg)
    assert [i for i, w in enumerate(s.sliding_window) if w is None] == [5, 11, 17]
    assert {w for w in s.sliding_window if w} == {512}
    assert s.rope[5].base == 1e6 and s.rope[0].base == 1e4


def test_qwen2_sliding_layers_follow_max_window_layers():
    cfg = Qwen2Config(**{**tiny_config("qwen2").to_dict(), "use_sliding_window": True, "sliding_window": 16,
                         "max_window_layers": 1, "layer_types": None})
    s = ModelSpec.from_config(cfg)
    assert s.sliding_window == [None, 16, 16]
    assert ModelSpec.from_config(tiny_config("qwen2")).sliding_window == [None] * 3


def test_gpt2_spec_has_learned_positions():
    s = tiny("gpt2").spec
    assert s.learned_positions and s.rope == [None, None]
    assert (s.num_layers, s.num_kv_heads, s.head_dim) == (2, 4, 16)
    assert s.max_position_embeddings == 256


def test_unsupported_family_is_a_clear_error():
    with pytest.raises(UnsupportedModelError, match="expected one of llama, qwen2, gemma3_text, gpt2"):
        ModelSpec.from_config(BertConfig())


def test_eos_ids_are_a_list():
    cfg = tiny_config("llama", eos_token_id=[5, 7], bos_token_id=1)
    s = ModelSpec.from_config(cfg)
    assert s.eos_token_ids == [5, 7] and s.bos_token_id == 1


def _tokenizer(bos_first: bool, template: str | None):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "a": 3, "b": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if bos_first:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = template
    return fast


@pytest.mark.parametrize("bos_first", [True, False])
def test_tokenizer_facts(bos_first):
    s = ModelSpec.from_config(tiny_config("llama", bos_token_id=1),
                              _tokenizer(bos_first, "{{ messages }}" if bos_first else None))
    assert s.adds_bos_token is bos_first
    assert s.has_chat_template is bos_first
    assert ModelSpec.from_config(tiny_config("llama")).adds_bos_token is None
