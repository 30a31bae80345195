"""KV-cache translation between heterogeneous models (the Mixture-of-Translators).

Public API:
    Translator                       translate(block, target) -> target KVBlock
    load_translator(path, src_fp, tgt_fp)
    find_translator(src_fp, tgt_fp)  -> Translator | None  ($CAGKV_HOME/translators, shipped)
    list_translators()
"""

from __future__ import annotations

from cagkv.translate.artifact import find_translator, list_translators, load_translator, save_artifact
from cagkv.translate.translator import Translator

__all__ = ["Translator", "find_translator", "list_translators", "load_translator", "save_artifact"]
