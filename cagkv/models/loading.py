"""Load a model by zoo name, local folder or hub id: model, tokenizer, spec, fingerprint.

Loaded models are cached per process, keyed by (resolved path, dtype, attention
implementation, device), so every module that asks for the same model shares one copy.
Parameters are frozen (`requires_grad=False`) and the model is in eval mode. Nothing is
printed (a zoo model that is not pulled yet is pulled first, with progress on stderr).

Example:
    >>> lm = load("smollm2-135m", dtype=torch.bfloat16)       # doctest: +SKIP
    >>> lm.spec.num_layers, lm.fingerprint
    (30, '5e1bad61c77ddcae')
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from cagkv.errors import ModelNotFoundError, UsageError
from cagkv.models import zoo
from cagkv.models.fingerprint import folder_fingerprint, model_fingerprint
from cagkv.models.spec import SUPPORTED_FAMILIES, ModelSpec


@dataclass
class LoadedModel:
    """A loaded model and its facts. `spec` is None for encoders (e.g. minilm-l6)."""

    model: Any
    tokenizer: Any
    spec: ModelSpec | None
    fingerprint: str
    name: str
    config: Any
    path: str = ""
    dtype: torch.dtype = torch.float32

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


_CACHE: dict[tuple[str, str, str | None, str], LoadedModel] = {}
_LOCK = threading.Lock()


def parse_device(device: torch.device | str | None) -> torch.device:
    """None / "cpu" / "cuda" / "cuda:N" / "auto" (the first GPU where there is one, else the
    CPU) -> a device this process can use; a GPU asked for where there is none is a UsageError."""
    if device is None:
        return torch.device("cpu")
    if isinstance(device, str) and device.strip().lower() == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise UsageError(f"unknown device {device!r}: expected cpu, cuda, cuda:N or auto") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"device {device!r} asked for, but this torch sees no CUDA GPU (use cpu or auto)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UsageError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    elif dev.type != "cpu":
        raise UsageError(f"device {device!r}: cagkv runs on cpu or cuda")
    return dev


def load(
    name_or_path: str | os.PathLike[str],
    dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = None,
    device: torch.device | str | None = None,
) -> LoadedModel:
    """Load (or fetch from the per-process cache) a zoo model, a local folder or a hub id,
    on `device` (default the CPU; see `parse_device`)."""
    target = zoo.resolve(name_or_path)
    dev = parse_device(device)
    key = (target, str(dtype), attn_implementation, str(dev))
    with _LOCK:
        if key not in _CACHE:
            _CACHE[key] = _load(str(name_or_path), target, dtype, attn_implementation, dev)
        return _CACHE[key]


def unload(name_or_path: str | os.PathLike[str], dtype: torch.dtype = torch.float32) -> None:
    """Forget one loaded model (every attention implementation and device of it) in this process."""
    target = zoo.resolve(name_or_path) if str(name_or_path) not in zoo.ZOO else str(zoo.model_path(str(name_or_path)))
    with _LOCK:
        for key in [k for k in _CACHE if k[0] == target and k[1] == str(dtype)]:
            del _CACHE[key]


def clear_cache() -> None:
    """Forget every loaded model (frees memory once no one else holds them)."""
    with _LOCK:
        _CACHE.clear()


def _offline() -> bool:
    return any(os.environ.get(v, "") not in ("", "0") for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence transformers' logging and progress bars while loading."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _load(asked: str, target: str, dtype: torch.dtype, attn: str | None,
          device: torch.device = torch.device("cpu")) -> LoadedModel:
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

    local = Path(target).is_dir()
    kwargs: dict[str, Any] = {"local_files_only": local or _offline()}
    try:
        with _quiet():
            config = AutoConfig.from_pretrained(target, **kwargs)
            causal = _is_causal(config)
            cls = AutoModelForCausalLM if causal else AutoModel
            extra = {"attn_implementation": attn} if attn else {}
            model = cls.from_pretrained(target, dtype=dtype, **kwargs, **extra)
            tokenizer = AutoTokenizer.from_pretrained(target, **kwargs)
    except (OSError, ValueError) as err:
        where = "the local folder" if local else (
            "the local Hugging Face cache (offline)" if _offline() else "the Hugging Face hub"
        )
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ModelNotFoundError(f"cannot load model {asked!r} from {where}: {first}") from err
    model.eval()
    model.requires_grad_(False)
    if device.type != "cpu":
        model.to(device)
    spec = ModelSpec.from_config(config, tokenizer) if causal else None
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        spec=spec,
        fingerprint=_fingerprint(target, config, model),
        name=_display_name(asked, target),
        config=config,
        path=target,
        dtype=dtype,
    )


def _is_causal(config: Any) -> bool:
    archs = getattr(config, "architectures", None) or []
    return getattr(config, "model_type", None) in SUPPORTED_FAMILIES or any(
        a.endswith("ForCausalLM") or a.endswith("LMHeadModel") for a in archs
    )


def _display_name(asked: str, target: str) -> str:
    if asked in zoo.ZOO:
        return asked
    path = Path(target)
    return path.name if path.is_dir() else target


def _fingerprint(target: str, config: Any, model: Any) -> str:
    """From the zoo manifest, a per-home record for other folders, or the hub snapshot."""
    folder = Path(target)
    if not folder.is_dir():
        folder = _hub_snapshot(target) or folder
    if not folder.is_dir() or not list(folder.glob("*.safetensors")):
        return model_fingerprint(config, model.state_dict())
    manifest = folder / zoo.MANIFEST
    if manifest.is_file():
        fp = json.loads(manifest.read_text()).get("fingerprint")
        if fp:
            return str(fp)
    return _recorded_fingerprint(folder)


def _hub_snapshot(repo_id: str) -> Path | None:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # noqa: BLE001 - no local snapshot: fall back to hashing the loaded weights
        return None


def _recorded_fingerprint(folder: Path) -> str:
    """folder_fingerprint, remembered in $CAGKV_HOME/fingerprints.json by path, sizes and mtimes."""
    stamp = ";".join(
        f"{p.name}:{p.stat().st_size}:{int(p.stat().st_mtime)}"
        for p in sorted(folder.glob("*.safetensors")) + [folder / "config.json"]
        if p.exists()
    )
    record = zoo.home() / "fingerprints.json"
    known: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        known = json.loads(record.read_text())
    entry = known.get(str(folder.resolve()))
    if entry and entry.get("stamp") == stamp:
        return str(entry["fingerprint"])
    fp = folder_fingerprint(folder)
    known[str(folder.resolve())] = {"stamp": stamp, "fingerprint": fp}
    with contextlib.suppress(OSError):
        record.parent.mkdir(parents=True, exist_ok=True)
        tmp = record.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, indent=1))
        os.replace(tmp, record)
    return fp
