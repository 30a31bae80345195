"""The training run as one resumable flow: prepare -> stages -> evaluate -> artifact.

    run_training(source, target, cfg)
      load models -> samples (corpus.py) -> pairs on disk (pairs.py, cached by content)
      -> norm stats -> regression -> attention -> e2e (each checkpointed, evaluated)
      -> save_artifact(cfg.out) with the card

The card's `quality` is the held-out answer log-likelihood recovery after the last stage;
`auto_threshold` (default 0.5) is what `auto` mode compares it with.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from cagkv.errors import UsageError
from cagkv.translate.artifact import save_artifact
from cagkv.translate.corpus import SPLIT_VERSION, load_documents, make_samples, split_by_document
from cagkv.translate.mot import MoTTranslator, grown_state
from cagkv.translate.pairs import PairSet, build_pairs
from cagkv.translate.train import (
    STAGES,
    Trainer,
    TrainConfig,
    freeze_for,
    make_mot_config,
    make_optimizer,
    stage_steps,
)

__all__ = ["run_training", "AUTO_THRESHOLD"]

AUTO_THRESHOLD = 0.5


def _home() -> Path:
    return Path(os.environ.get("CAGKV_HOME", Path.home() / ".cache" / "cagkv"))


def _say(msg: str) -> None:
    print(f"[cagkv train {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def prepare_pairs(source: Any, target: Any, cfg: TrainConfig) -> tuple[PairSet, PairSet, dict[str, Any]]:
    if cfg.pairs_dir:
        return reuse_pairs(Path(cfg.pairs_dir).expanduser(), source, target)
    extra: list[str] = []
    if cfg.samples_file:
        from cagkv.translate.selfqa import load_samples

        path = Path(cfg.samples_file).expanduser()
        if not path.is_file():
            raise UsageError(f"samples_file {path}: no such file")
        samples = load_samples(path)[: cfg.samples]
        extra = [hashlib.sha256(path.read_bytes()).hexdigest()[:16]]
    else:
        docs = load_documents(cfg.corpora)
        samples = make_samples(docs, cfg.samples, seed=cfg.seed, chars=tuple(cfg.chunk_chars), kinds=tuple(cfg.kinds))
    train_s, held_s = split_by_document(samples, cfg.heldout_share, seed=cfg.seed)
    # The sample count is not part of the key: make_samples draws a prefix-stable sequence and
    # the held-out split depends on the document alone, so a run with more samples extends the
    # folder a smaller run of the same settings wrote (build_pairs resumes), and one with fewer
    # reads its first files. (Dropping it from the list already moved every folder to a new key.)
    key = hashlib.sha256(
        json.dumps([source.fingerprint, target.fingerprint, cfg.corpora, cfg.seed, cfg.topk, cfg.predict,
                    cfg.kinds, cfg.chunk_chars, SPLIT_VERSION, *extra]).encode()
    ).hexdigest()[:12]
    base = _home() / "pairs" / f"{source.name}__{target.name}__{key}".replace("/", "_")
    for name, ss in (("heldout", held_s), ("train", train_s)):
        t0 = time.time()

        def prog(i: int, n: int, name: str = name, t0: float = t0) -> None:
            if i % 10 == 0 or i == n:
                _say(f"pairs {name}: {i}/{n} ({time.time() - t0:.0f}s)")

        build_pairs(source, target, ss, base / name, topk=cfg.topk, predict=cfg.predict, progress=prog)
    data = {
        "corpora": cfg.corpora, **({"samples_file": str(cfg.samples_file)} if cfg.samples_file else {}),
        "chunks_train": len(train_s), "chunks_heldout": len(held_s),
        "documents_train": len({s.source for s in train_s}), "documents_heldout": len({s.source for s in held_s}),
        "chars_train": sum(len(s.text) for s in train_s), "pairs_dir": str(base),
        "continuations": sorted({c.kind for s in samples for c in s.conts}),
    }
    return PairSet(base / "train", range(len(train_s))), PairSet(base / "heldout", range(len(held_s))), data


def reuse_pairs(base: Path, source: Any, target: Any) -> tuple[PairSet, PairSet, dict[str, Any]]:
    """The pairs an earlier run built (`pairs_dir`), checked against these two models, so a
    continued training keeps its held-out documents held out."""
    sets = {}
    for name in ("train", "heldout"):
        if not (base / name / "index.json").is_file():
            raise UsageError(f"pairs_dir {base}: no {name}/index.json (give a folder under $CAGKV_HOME/pairs)")
        sets[name] = PairSet(base / name)
        for role, model in (("source", source), ("target", target)):
            built_for = sets[name].index.get(role, {})
            if built_for.get("fingerprint") != model.fingerprint:
                raise UsageError(f"pairs_dir {base}: built for {role} {built_for.get('name')!r} "
                                 f"({built_for.get('fingerprint')}), not {model.name!r} ({model.fingerprint})")
    data = {"chunks_train": len(sets["train"]), "chunks_heldout": len(sets["heldout"]), "pairs_dir": str(base),
            "pairs_reused": True}
    _say(f"pairs reused from {base}: {data['chunks_train']} train / {data['chunks_heldout']} held-out chunks")
    return sets["train"], sets["heldout"], data


def fit_streaming_ridge(source: Any, target: Any, cfg: TrainConfig, mot_cfg: Any, heldout: PairSet,
                        out: Path) -> tuple[MoTTranslator, dict[str, Any]]:
    """`method="ridge"`: stream corpus chunks (never the held-out documents) into a ridge fit
    (resumable from `out/ridge_fit.pt`) and return the translator it defines."""
    from cagkv.translate.ridge import RidgeFit

    held_docs = {heldout[i]["source"] for i in range(len(heldout))}
    docs = [d for d in load_documents(cfg.corpora) if d[0] not in held_docs]
    n = cfg.ridge_texts or 10**9
    texts = [s.text for s in make_samples(docs, n, seed=cfg.seed + 1, chars=tuple(cfg.ridge_chunk_chars), kinds=("next",))]
    texts = texts or [s.text for s in make_samples(docs, n, seed=cfg.seed + 1, chars=tuple(cfg.ridge_chunk_chars),
                                                   kinds=("blank",))]
    if not texts:
        raise ValueError(f"corpora {cfg.corpora} gave no chunks of {cfg.ridge_chunk_chars} characters")
    path = out / "ridge_fit.pt"
    fit = RidgeFit.load(path) if path.exists() else RidgeFit.new(mot_cfg)
    # fields that do not shape the fit (ranks, the mixture's size) may differ from the saved fit's
    overrides = {k: v for k, v in mot_cfg.to_dict().items() if v != fit.cfg.to_dict().get(k)}
    if fit.texts_done:
        _say(f"ridge fit resumed at {fit.texts_done}/{len(texts)} chunks")
    t0 = time.time()

    def prog(i: int, total: int, tokens: int) -> None:
        if i % 25 == 0 or i == total:
            _say(f"ridge: {i}/{total} chunks, {tokens} target tokens ({time.time() - t0:.0f}s)")

    fit.add_texts(source, target, texts, save_to=path, progress=prog, max_seconds=cfg.ridge_minutes * 60)
    t_solve = time.time()
    mot = fit.to_translator(lam=cfg.ridge_lambda, **overrides)
    info = {"texts": fit.texts_done, "texts_available": len(texts), "tokens": fit.tokens,
            "chunk_chars": cfg.ridge_chunk_chars, "held_out_documents_excluded": len(held_docs),
            "wall_s": round(fit.seconds + time.time() - t_solve, 1), "r2_in_sample": fit.r2(cfg.ridge_lambda)}
    _say(f"ridge solved: {json.dumps(info)}")
    return mot, info


def start_from_artifact(path: str, source: Any, target: Any,
                        mot_cfg: Any) -> tuple[MoTTranslator, dict[str, Any], dict[str, Any]]:
    """`init=PATH`: a translator shaped by `mot_cfg` (the mixture) whose linear path, replay
    heads and normalisation statistics are those of the translator at PATH (same source and
    target, checked by fingerprint). A mixture grown from PATH's (wider experts, more
    `blocks`, or several experts per group where PATH has one: upcycled) starts from PATH's
    weights (`mot.grown_state`) and computes exactly what PATH computes. A mixture that cannot hold PATH's (another `d_model`, a smaller `d_expert`,
    fewer `blocks`: some of PATH's mixture tensors do not fit) starts with zero output heads,
    so it computes PATH's linear path alone; the message and the record say which.
    Returns (translator, the "start" stage record, PATH's card)."""
    from cagkv.translate.artifact import load_translator

    start = load_translator(path, source.fingerprint, target.fingerprint)
    old = start.model.cfg
    cfg = dataclasses.replace(mot_cfg, layer_map=old.layer_map, exact_layers=old.exact_layers,
                              skip_rank=old.skip_rank, boundaries=old.boundaries, boundary_rank=old.boundary_rank)
    mot = MoTTranslator(cfg)
    own = mot.state_dict()
    old_state = start.model.state_dict()
    copied = grown_state(mot, old_state)
    mot.load_state_dict(copied, strict=False)
    # PATH's tensors that this mixture has but cannot take (narrower or reshaped): keeping its
    # heads over fresh experts would start from neither PATH nor its linear path
    unfit = [n for n in old_state if n in own and n not in copied]
    mixture_from = "artifact" if "head_w" in copied and not unfit else "linear path"
    if mixture_from == "linear path":
        with torch.no_grad():
            mot.head_w.zero_()
            mot.head_b.zero_()
    info = {"from": str(path), "tensors_copied": len(copied), "tensors_fresh": len(own) - len(copied),
            "tensors_unfit": len(unfit), "starts_as": mixture_from,
            "start_quality": (start.card.get("quality") or {}).get("value"),
            "default_replay": int(start.card.get("default_replay") or 0)}
    heads = ("mixture heads copied: starts as the artifact" if mixture_from == "artifact" else
             f"{len(unfit)} of its mixture tensors do not fit, mixture heads zero: starts as its linear path")
    _say(f"start from {path}: {len(copied)} tensors copied, {len(own) - len(copied)} fresh ({heads})")
    return mot, info, start.card


def train_replay_heads(trainer: Trainer, cfg: TrainConfig, state: dict[str, Any],
                       replays: list[int] | None = None) -> dict[str, Any]:
    """Per replay head (all, or those of `replays`): optional Context Correction stage
    (gradients into that head only), then held-out metrics with that replay. Returns {r: metrics}."""
    mot, out = trainer.mot, {}
    n_layers = mot.cfg.tgt_layers
    for b in sorted(mot.cfg.boundaries, reverse=True):
        r = n_layers - b
        if replays is not None and r not in replays:
            continue
        if cfg.steps_boundary > 0:
            stage = f"boundary_r{r}"
            opt = torch.optim.Adam(mot.boundary[str(b)].parameters(), lr=cfg.lr_e2e)
            t0 = time.time()
            trainer.cfg.stage_minutes = {**cfg.stage_minutes, stage: cfg.boundary_minutes}
            trainer.begin_stage(stage)
            trainer.steps_done = 0
            trainer.stage_boundary(r, cfg.steps_boundary, opt)
            state["stages"].append({"name": stage, "steps": trainer.steps_done, "planned_steps": cfg.steps_boundary,
                                    "wall_s": round(time.time() - t0, 1)})
        out[str(r)] = trainer.evaluate(replay=r)
        _say(f"replay {r} (boundary layer {b}): held-out answer_ll_recovery {out[str(r)]['answer_ll_recovery']}")
    return out


def run_training(source_name: str, target_name: str, cfg: TrainConfig, progress: bool = True) -> Path:
    from cagkv.models import load

    torch.set_num_threads(max(1, cfg.threads))
    torch.manual_seed(cfg.seed)
    out = Path(os.path.expanduser(cfg.out))
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    source, target = load(source_name), load(target_name)
    _say(f"source {source.name} ({source.fingerprint}), target {target.name} ({target.fingerprint})")
    pairs, heldout, data = prepare_pairs(source, target, cfg)
    data["tokens_train"] = sum(int(pairs[i]["tgt_ids"].numel()) for i in range(len(pairs)))
    prep_s = time.time() - t0
    _say(f"pairs ready: {len(pairs)} train, {len(heldout)} held-out chunks ({prep_s:.0f}s)")
    logf = open(out / "log.jsonl", "a")

    def log(rec: dict[str, Any]) -> None:
        logf.write(json.dumps(rec) + "\n")
        logf.flush()
        if progress:
            _say(" ".join(f"{k}={v}" for k, v in rec.items()))

    mot = MoTTranslator(make_mot_config(source, target, cfg))
    start, start_card = None, {}
    if cfg.init not in ("ridge", "random"):
        mot, start, start_card = start_from_artifact(cfg.init, source, target, mot.cfg)
        data["start"] = {"from": start["from"], "data": start_card.get("data")}
    ckpt_path = out / "ckpt.pt"
    state: dict[str, Any] = {"done": [], "metrics": {}, "stages": []}
    saved: dict[str, Any] = {}
    if cfg.method == "ridge":
        mot, data["ridge"] = fit_streaming_ridge(source, target, cfg, mot.cfg, heldout, out)
    trainer = Trainer(source, target, pairs, heldout, cfg, mot=mot, log=log)
    if cfg.method == "ridge":
        metrics = trainer.evaluate()
        _say(f"after streaming ridge: {json.dumps(metrics)}")
        state["metrics"]["ridge_stream"] = metrics
        state["stages"].append({"name": "ridge_stream", "lambda": cfg.ridge_lambda, "rank": cfg.skip_rank,
                                "texts": data["ridge"]["texts"], "tokens": data["ridge"]["tokens"],
                                "wall_s": data["ridge"]["wall_s"]})
        state["done"].append("ridge_stream")
    elif ckpt_path.exists():
        saved = torch.load(ckpt_path, weights_only=True)
        mot.load_state_dict(saved["model"])
        state = saved["state"]
        _say(f"resumed from {ckpt_path}: done {state['done']}, in {saved.get('stage')} step {saved.get('step')}")
    elif start is not None:
        metrics = trainer.evaluate()
        _say(f"start (= {cfg.init}): {json.dumps(metrics)}")
        state["metrics"]["start"] = metrics
        state["stages"] += [*(start_card.get("stages") or []), {"name": "start", **start}]  # the start's history first
        torch.save({"model": mot.state_dict(), "stage": None, "step": 0, "state": state}, ckpt_path)
    else:
        trainer.fit_stats()
        if cfg.init == "ridge":
            from cagkv.translate.linear import fit_ridge

            t_r = time.time()
            lin = fit_ridge(trainer, lam=cfg.ridge_lambda)
            kept = mot.init_skip_from_ridge(lin.ridge_w, lin.grams)
            _say(f"ridge init: rank {cfg.skip_rank} keeps {kept:.3f} of the fitted values' energy")
            metrics = trainer.evaluate()
            _say(f"after ridge init: {json.dumps(metrics)}")
            state["metrics"]["ridge_init"] = metrics
            state["stages"].append({"name": "ridge_init", "lambda": cfg.ridge_lambda, "rank": cfg.skip_rank,
                                    "energy_kept": round(kept, 4), "wall_s": round(time.time() - t_r, 1)})
            torch.save({"model": mot.state_dict(), "stage": None, "step": 0, "state": state}, ckpt_path)
    if cfg.train_only:
        _say(f"train only the {cfg.train_only}: {freeze_for(mot, cfg.train_only)} trainable parameters")
    steps = stage_steps(cfg) if cfg.method != "ridge" else {s: 0 for s in STAGES}
    for stage in STAGES:
        if stage in state["done"] or steps[stage] <= 0:
            continue
        opt = make_optimizer(mot, stage, cfg)
        start = 0
        if saved.get("stage") == stage and "opt" in saved:
            opt.load_state_dict(saved["opt"])
            start = int(saved["step"])
        t_stage = time.time()

        def ckpt(stage_: str, step: int, opt: torch.optim.Optimizer = opt) -> None:
            tmp = ckpt_path.with_suffix(".tmp")
            torch.save({"model": mot.state_dict(), "opt": opt.state_dict(), "stage": stage_, "step": step,
                        "state": state}, tmp)
            os.replace(tmp, ckpt_path)

        _say(f"stage {stage}: steps {start}..{steps[stage]}")
        trainer.begin_stage(stage)
        trainer.steps_done = start
        getattr(trainer, f"stage_{stage}")(steps[stage], opt, start=start, ckpt=ckpt)
        metrics = trainer.evaluate()
        _say(f"after {stage}: {json.dumps(metrics)}")
        state["done"].append(stage)
        state["metrics"][stage] = metrics
        state["stages"].append({"name": stage, "steps": trainer.steps_done, "planned_steps": steps[stage],
                                "wall_s": round(time.time() - t_stage, 1)})
        torch.save({"model": mot.state_dict(), "stage": None, "step": 0, "state": state}, ckpt_path)
        saved = {}
    last = state["metrics"][state["done"][-1]] if state["done"] else {}
    state["metrics"]["replay"] = train_replay_heads(trainer, cfg, state)
    card = {
        "source": {"name": source.name, "fingerprint": source.fingerprint, "layers": source.spec.num_layers,
                   "kv_heads": source.spec.num_kv_heads, "head_dim": source.spec.head_dim},
        "target": {"name": target.name, "fingerprint": target.fingerprint, "layers": target.spec.num_layers,
                   "kv_heads": target.spec.num_kv_heads, "head_dim": target.spec.head_dim},
        "layer_map": mot.cfg.layer_map,
        "norm_stats": {"stored": "in weights (src_mean, src_std, tgt_mean, tgt_std)",
                       "tgt_std_mean_per_layer": [round(float(x), 4) for x in mot.tgt_std.mean(1)]},
        "train_config": dataclasses.asdict(cfg),
        "data": data,
        "stages": state["stages"],
        "metrics": state["metrics"],
        "quality": {"metric": "answer_ll_recovery", "value": last.get("answer_ll_recovery"),
                    "auto_threshold": AUTO_THRESHOLD,
                    "note": "held-out cloze/what-follows answers on other documents of the training corpora"},
        "replay": {"boundaries": mot.cfg.boundaries,
                   "values": sorted({0, mot.cfg.tgt_layers, *(mot.cfg.tgt_layers - b for b in mot.cfg.boundaries)}),
                   "heads": "closed-form ridge (reduced rank) to the residual stream entering each boundary layer"
                   if cfg.method == "ridge" else f"those of {cfg.init}" if start else "untrained"},
        # set from the measured recovery/TTFT curve (docs/RESULTS.md); a start's value carries over
        "default_replay": start["default_replay"] if start else 0,
        "parameters": mot.num_parameters(),
        "wall_s": round(time.time() - t0, 1),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    save_artifact(out, mot, card, int8_linear=cfg.int8_linear)
    _say(f"artifact written to {out} ({(out / 'weights.safetensors').stat().st_size / 1e6:.1f} MB)")
    return out
