"""Translator artifacts: `weights.safetensors` + `card.json` in one folder.

The card records the source and target fingerprints, the MoT config (layer map
included), normalisation summary, training data, stages and held-out metrics, and the
`quality` entry that `auto` mode compares with its threshold. Weights are stored in
float16 (normalisation buffers in float32) to keep artifacts small.

Lookup (`find_translator`) scans `$CAGKV_HOME/translators/*/` and the translators shipped
inside the package (`cagkv/translators/*/`), matching both fingerprints.

Example:
    >>> save_artifact(out_dir, mot, card)
    >>> tr = load_translator(out_dir, source.fingerprint, target.fingerprint)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from cagkv.errors import TranslatorError
from cagkv.translate.mot import MoTConfig, MoTTranslator
from cagkv.translate.difficulty import DIFFICULTY_FILE
from cagkv.translate.translator import (Translator, card_attention_bias, card_bias_scope, card_default_refresh, card_peak_z,
                                        card_refresh_scoring)

__all__ = ["save_artifact", "load_translator", "find_translator", "list_translators", "translator_dirs"]

FORMAT = "cagkv.translator"
VERSION = 1
WEIGHTS = "weights.safetensors"
CARD = "card.json"
_FP32_BUFFERS = ("src_mean", "src_std", "tgt_mean", "tgt_std")
_FP32_SUFFIXES = (".mean", ".std")  # replay heads' residual-stream statistics


def quantize_int8(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output column: `t [..., F, O]` -> (q int8, scale [..., 1, O] float32)."""
    scale = t.float().abs().amax(dim=-2, keepdim=True).clamp(min=1e-12) / 127.0
    q = torch.round(t.float() / scale).clamp(-127, 127).to(torch.int8)
    return q, scale


def _int8_candidate(name: str, t: torch.Tensor) -> bool:
    """The linear paths' big matrices (ridge maps and replay heads) go to int8 when asked."""
    return t.is_floating_point() and t.dim() >= 2 and t.numel() >= 65536 and (
        name.startswith(("skip_a", "skip_b")) or (name.startswith("boundary.") and name.endswith((".a", ".b"))))


def save_artifact(path: str | Path, model: MoTTranslator, card: dict[str, Any], dtype: torch.dtype = torch.float16,
                  int8_linear: bool = False) -> Path:
    """Write weights and card into folder `path` (created); returns the folder.

    `int8_linear`: store the linear paths' matrices as int8 with per-column float32 scales
    (`NAME.q8`, `NAME.q8scale`), half the bytes of float16; loading de-quantises them.
    """
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    state = {}
    for name, t in model.state_dict().items():
        t = t.detach().cpu()
        if int8_linear and _int8_candidate(name, t):
            state[f"{name}.q8"], state[f"{name}.q8scale"] = quantize_int8(t)
            continue
        keep32 = name in _FP32_BUFFERS or name.endswith(_FP32_SUFFIXES) or not t.is_floating_point()
        state[name] = t.to(torch.float32 if keep32 else dtype).contiguous()
    card = dict(card)
    card.update(format=FORMAT, version=VERSION, config=model.cfg.to_dict())
    card["weights_dtype"] = str(dtype).replace("torch.", "") + (" (linear paths int8, per-column scales)" if int8_linear else "")
    tmp = out / (WEIGHTS + ".tmp")
    save_file(state, str(tmp), metadata={"format": FORMAT})
    os.replace(tmp, out / WEIGHTS)
    card["size_bytes"] = (out / WEIGHTS).stat().st_size
    (out / CARD).write_text(json.dumps(card, indent=1, sort_keys=True))
    return out


def read_card(path: str | Path) -> dict[str, Any]:
    """The card of an artifact folder; TranslatorError when absent or malformed."""
    p = Path(path) / CARD
    try:
        card = json.loads(p.read_text())
    except FileNotFoundError:
        raise TranslatorError(f"no translator card at {p}") from None
    except json.JSONDecodeError as e:
        raise TranslatorError(f"translator card {p} is not valid JSON: {e}") from None
    if card.get("format") != FORMAT:
        raise TranslatorError(f"{p} is not a cagkv translator card (format {card.get('format')!r})")
    if card.get("version") != VERSION:
        raise TranslatorError(f"translator card {p} has version {card.get('version')!r}, this cagkv reads {VERSION}")
    return card


def add_card_record(path: str | Path, key: str, record: dict[str, Any]) -> dict[str, Any]:
    """Write `record` under `key` into the card of artifact folder `path` (what a fit beside the
    weights, such as a difficulty or bias table, leaves there); returns the card as written."""
    card = read_card(path)
    card[key] = record
    (Path(path) / CARD).write_text(json.dumps(card, indent=1, sort_keys=True) + "\n")
    return card


def load_translator(path: str | Path, source_fp: str | None = None, target_fp: str | None = None) -> Translator:
    """Load an artifact folder; refuses fingerprints that differ from the card's, naming which."""
    from safetensors.torch import load_file

    card = read_card(path)
    for side, fp in (("source", source_fp), ("target", target_fp)):
        want = card.get(side, {}).get("fingerprint")
        if fp is not None and fp != want:
            raise TranslatorError(f"translator at {path} was trained for {side} model {want}, got {fp}")
    try:
        cfg = MoTConfig.from_dict(card["config"])
    except (KeyError, TypeError, ValueError) as e:
        raise TranslatorError(f"translator card at {path} has a bad config: {e}") from None
    model = MoTTranslator(cfg)
    wfile = Path(path) / WEIGHTS
    if not wfile.exists():
        raise TranslatorError(f"translator weights missing: {wfile}")
    try:
        raw = load_file(str(wfile))
    except Exception as e:  # noqa: BLE001 - truncated / not safetensors: safetensors raises several types
        raise TranslatorError(f"translator weights at {wfile} are unreadable: {str(e).splitlines()[0]}") from None
    state = _dequantize(raw, wfile)
    expected = model.state_dict()
    wrong = [f"{k} {tuple(v.shape)} (config wants {tuple(expected[k].shape)})"
             for k, v in state.items() if k in expected and v.shape != expected[k].shape]  # fmt: skip
    if wrong:
        raise TranslatorError(f"translator weights at {wfile} do not fit its card's config: {', '.join(wrong[:3])}")
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise TranslatorError(f"translator weights at {wfile} do not fit its config: missing {missing[:3]}, unexpected {unexpected[:3]}")
    bad = [k for k, v in state.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if bad:
        raise TranslatorError(f"translator weights at {wfile} hold NaN or Inf: {bad[:3]}")
    return Translator(model, card, path=str(path))


def _dequantize(raw: dict[str, torch.Tensor], wfile: Path) -> dict[str, torch.Tensor]:
    """float32 state dict from stored tensors (`NAME.q8` + `NAME.q8scale` pairs de-quantised)."""
    state: dict[str, torch.Tensor] = {}
    for k, v in raw.items():
        if k.endswith(".q8scale"):
            continue
        if k.endswith(".q8"):
            name, scale = k[: -len(".q8")], raw.get(k + "scale")
            if scale is None or v.dtype != torch.int8 or scale.shape[-1] != v.shape[-1]:
                raise TranslatorError(f"translator weights at {wfile}: {k} has no matching int8 scale")
            state[name] = v.float() * scale.float()
        else:
            state[k] = v.float()
    return state


def translator_dirs() -> list[Path]:
    """Folders searched for artifacts: `$CAGKV_HOME/translators` then the package's shipped ones."""
    home = Path(os.environ.get("CAGKV_HOME", Path.home() / ".cache" / "cagkv"))
    return [home / "translators", Path(__file__).resolve().parent.parent / "translators"]


def list_translators(dirs: list[Path] | None = None) -> list[dict[str, Any]]:
    """One row per readable artifact: path, source/target names and fingerprints, quality, and
    what `ask` does with it when nothing is asked (its card's refresh share and scoring, and
    whether it has a difficulty table, with the threshold of its "adaptive" switch, and its
    attention bias on the tokens left translated)."""
    rows = []
    for base in dirs if dirs is not None else translator_dirs():
        if not base.is_dir():
            continue
        for sub in sorted(p for p in base.iterdir() if (p / CARD).exists()):
            try:
                card = read_card(sub)
            except TranslatorError:
                continue
            q = card.get("quality", {})
            has_table = (sub / DIFFICULTY_FILE).exists()
            rows.append(
                {
                    "path": str(sub),
                    "source": card.get("source", {}).get("name"),
                    "target": card.get("target", {}).get("name"),
                    "source_fingerprint": card.get("source", {}).get("fingerprint"),
                    "target_fingerprint": card.get("target", {}).get("fingerprint"),
                    "experts": card.get("config", {}).get("experts"),
                    "top_k": card.get("config", {}).get("top_k"),
                    "quality": q.get("value"),
                    "auto_threshold": q.get("auto_threshold"),
                    "size_bytes": card.get("size_bytes"),
                    "has_weights": (sub / WEIGHTS).exists(),
                    "default_refresh": card_default_refresh(card),
                    "default_refresh_scoring": card_refresh_scoring(card, has_table),
                    "difficulty_table": has_table,
                    "peak_z": card_peak_z(card) if has_table else None,
                    "attention_bias": card_attention_bias(card),
                    "attention_bias_r0": card_attention_bias(card, "attention_bias_r0"),
                    "attention_bias_scope": card_bias_scope(card, "attention_bias"),
                    "attention_bias_r0_scope": card_bias_scope(card, "attention_bias_r0"),
                }
            )
    return rows


def find_translator(source_fp: str, target_fp: str, dirs: list[Path] | None = None) -> Translator | None:
    """The best-quality artifact for this fingerprint pair, or None when there is none."""
    rows = [
        r for r in list_translators(dirs)
        if r["source_fingerprint"] == source_fp and r["target_fingerprint"] == target_fp and r["has_weights"]
    ]
    if not rows:
        return None
    rows.sort(key=lambda r: -(r["quality"] if r["quality"] is not None else -1e9))
    return load_translator(rows[0]["path"], source_fp, target_fp)
