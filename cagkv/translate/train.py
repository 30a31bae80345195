"""Staged translator training, ending in the target's behaviour.

    prepare   corpus -> samples -> paired features on disk (pairs.py) -> norm statistics
    stage 1   regression:  normalised MSE of translated K/V (warm start)
    stage 2   attention:   under the target's own continuation queries, attention output
                           over translated chunk K/V matches the output over native K/V
    stage 3   e2e:         the frozen target continues (QA-shaped and plain) from prefix +
                           translated chunk; KL to its own-prefill next-token distribution,
                           weighted toward tokens the document changes; back-propagated
                           through the frozen target into the translator
    evaluate  held-out (other documents): per-layer R^2, attention error, weighted KL,
              answer log-likelihood recovery and answer top-1 agreement

Every stage checkpoints (`ckpt.pt`) and resumes; `log.jsonl` gets one line per log step.

Example:
    >>> cfg = TrainConfig(out="~/.cache/cagkv/translators/a__b")
    >>> train("smollm2-135m", "gemma3-270m", cfg)
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn.functional as F

from cagkv.align import align_tokens
from cagkv.config import strict_from_dict
from cagkv.errors import TranslatorError
from cagkv.models.cache import build_cache
from cagkv.models.rope import rotate
from cagkv.translate.features import TargetSide, running_stats, source_features
from cagkv.translate.layermap import layer_map
from cagkv.translate.mot import MoTConfig, MoTTranslator
from cagkv.translate.pairs import PairSet
from cagkv.translate.translator import assemble_kv

if TYPE_CHECKING:
    from cagkv.models import LoadedModel

__all__ = ["TrainConfig", "Trainer", "train", "make_mot_config", "kl_topk"]

STAGES = ("regression", "attention", "e2e")
MIX_DRAWS = ("random", "difficulty")  # TrainConfig.refresh_mix_by: how the native share is drawn
MIX_SHARES = ("fixed", "uniform")  # TrainConfig.refresh_mix_share: how large each chunk's native share is


@dataclass
class TrainConfig:
    out: str = ""
    corpora: list[str] = field(default_factory=lambda: ["lee", "pydoc"])
    kinds: list[str] = field(default_factory=lambda: ["follows", "blank"])
    chunk_chars: list[int] = field(default_factory=lambda: [300, 520])
    predict: int = 16  # teacher predictions kept per continuation (its last tokens)
    samples: int = 72
    pairs_dir: str = ""  # reuse the train/heldout pairs of an earlier run (its split) instead of building
    samples_file: str = ""  # build the pairs from these samples (selfqa.save_samples JSON lines), not the corpora
    heldout_share: float = 0.1
    seed: int = 0
    layer_nearest: int = 2
    experts: int = 4
    top_k: int = 2
    d_model: int = 128
    d_expert: int = 256
    group_size: int = 3
    blocks: int = 1  # rounds of (sequence mixing + experts) per group
    mixing: str = "conv+attn"
    steps_regression: int = 0
    steps_attention: int = 0
    steps_e2e: int = 400
    batch: int = 8
    e2e_accum: int = 2
    lr: float = 1e-3
    lr_e2e: float = 2e-4
    aux_weight: float = 0.01
    anchor_weight: float = 0.05  # regression term kept during stages 2-3
    kl_positions: int = 16
    key_weight: float = 0.0  # e2e: weight of the attention KL of native queries over translated vs native keys
    key_logit_weight: float = 0.0  # e2e: weight of the dense attention-logit error of every chunk key (E35)
    answer_weight: float = 1.0  # e2e KL: the answer tokens' share, against 1 for the document-changed tokens
    refresh_mix: float = 0.0  # e2e: this share of each chunk's tokens (drawn per step) gets native K/V in the
    # Context Correction cache, as question-time refresh leaves them; the loss reaches the rest only (E63)
    refresh_mix_by: str = "random"  # which tokens: "random", or "difficulty", the share the init translator's
    # difficulty table ranks hardest, as the "difficulty" refresh scoring would choose them (E74)
    refresh_mix_share: str = "fixed"  # "fixed": every chunk gets refresh_mix; "uniform": each chunk's share is
    # drawn from [0, refresh_mix), so wholly or mostly translated chunks stay in the mix (E101)
    native_below: int = 0  # >0: the target computes its layers below this one over the chunk; the mixture
    # reads its residual stream there (MoTConfig.native_below, E66)
    topk: int = 32
    eval_samples: int = 10
    log_every: int = 10
    ckpt_every: int = 20
    threads: int = 1
    max_minutes: float = 0.0  # >0: stop training early once this much wall time is spent
    stage_minutes: dict[str, float] = field(default_factory=dict)  # per-stage wall budgets
    skip_rank: int = 128  # >0: low-rank linear path per layer
    init: str = "ridge"  # "ridge": closed-form ridge start (needs skip_rank); "random"; or a translator folder
    train_only: str = ""  # "mixture": gradient stages leave the linear path and replay heads as they are;
    # "streams": they train only the layer streams; "key_scale": only the keys' per-layer scales
    layer_streams: list[int] = field(default_factory=list)  # target layers given a path of their own
    stream_d: int = 256
    key_scale: bool = False  # a learned scale per layer on the translated keys (MoTConfig.key_scale)
    ridge_lambda: float = 30.0
    method: str = "staged"  # "staged": pairs + stages; "ridge": streaming closed-form fit (ridge.py)
    ridge_texts: int = 0  # "ridge": chunks streamed (0: as many as the corpora give)
    ridge_chunk_chars: list[int] = field(default_factory=lambda: [500, 1100])
    ridge_minutes: float = 0.0  # "ridge": stop streaming after this many minutes (0: no limit)
    boundaries: list[int] = field(default_factory=list)  # replay heads, as target layers L - r
    replay: list[int] = field(default_factory=list)  # replay heads, as replay counts r (0 < r < L)
    steps_boundary: int = 0  # Context Correction steps per replay head (0: heads stay closed-form)
    boundary_minutes: float = 0.0  # wall budget per replay head's stage (0: none)
    int8_linear: bool = False  # store the linear paths' matrices as int8 (half the bytes of float16)
    boundary_rank: int = 128

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        return strict_from_dict(cls, data, "training options")


def make_mot_config(source: LoadedModel, target: LoadedModel, cfg: TrainConfig) -> MoTConfig:
    s, t = source.spec, target.spec
    return MoTConfig(
        src_layers=s.num_layers, src_kv_dim=s.kv_dim, tgt_layers=t.num_layers, tgt_kv_heads=t.num_kv_heads,
        tgt_head_dim=t.head_dim, tgt_embed_dim=int(target.config.hidden_size),
        layer_map=layer_map(s.num_layers, t.num_layers, cfg.layer_nearest), exact_layers=[0],
        tgt_k_norm=bool(t.has_k_norm), group_size=cfg.group_size, d_model=cfg.d_model, d_expert=cfg.d_expert,
        experts=cfg.experts, top_k=cfg.top_k, mixing=cfg.mixing, blocks=cfg.blocks, tgt_hidden=int(target.config.hidden_size),
        skip_rank=cfg.skip_rank, boundary_rank=cfg.boundary_rank, layer_streams=list(cfg.layer_streams),
        stream_d=cfg.stream_d, key_scale=cfg.key_scale, native_below=cfg.native_below,
        boundaries=sorted(set(cfg.boundaries) | {t.num_layers - r for r in cfg.replay if 0 < r < t.num_layers}),
    )


def kl_topk(logq: torch.Tensor, topi: torch.Tensor, topv: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row with p known on its top-K ids plus one 'rest' bucket.

    logq `[N, V]` student log-probs; topi/topv `[N, K]` teacher ids / log-probs.
    """
    lq = logq.gather(1, topi.long())  # [N, K]
    p = topv.exp()
    rest_p = (1 - p.sum(1)).clamp(min=1e-8)
    rest_q = (1 - lq.exp().sum(1)).clamp(min=1e-8)
    return (p * (topv - lq)).sum(1) + rest_p * (rest_p.log() - rest_q.log())


class Trainer:
    """Holds models, data and the translator; each stage is a method. See module doc."""

    def __init__(self, source: LoadedModel, target: LoadedModel, pairs: PairSet, heldout: PairSet,
                 cfg: TrainConfig, mot: MoTTranslator | None = None, log: Callable[[dict], None] | None = None):
        self.source, self.target, self.cfg = source, target, cfg
        self.pairs, self.heldout = pairs, heldout
        for p in target.model.parameters():
            p.requires_grad_(False)
        self.ts = TargetSide(target.model)
        self.mot = mot if mot is not None else MoTTranslator(make_mot_config(source, target, cfg))
        self.log = log or (lambda rec: None)
        self.rng = random.Random(cfg.seed)
        self._mix_rng = random.Random(cfg.seed + 1)  # refresh_mix's draws leave the records' draws as they were
        self._mix_table: torch.Tensor | None = None  # refresh_mix_by="difficulty": mix_table()
        if cfg.refresh_mix_by not in MIX_DRAWS:
            raise TranslatorError(f"refresh_mix_by must be one of {', '.join(MIX_DRAWS)}, got {cfg.refresh_mix_by!r}")
        if cfg.refresh_mix_share not in MIX_SHARES:
            raise TranslatorError(f"refresh_mix_share must be one of {', '.join(MIX_SHARES)}, "
                                  f"got {cfg.refresh_mix_share!r}")
        self.P = int(pairs.prefix_ids.numel())
        self.t_start = time.time()
        self.replay = 0  # > 0: translate_batch recomputes the top `replay` layers (replay heads)
        self._key_logit_w: torch.Tensor | None = None  # key_logit_weights(), computed once

    # ------------------------------------------------------------------ data
    def fit_stats(self, n: int = 64) -> None:
        """Per-channel statistics of the source features and target K/V from training pairs."""
        used, mot = self.mot.cfg.used_src, self.mot
        src, tgt = [], [[] for _ in range(mot.cfg.tgt_layers)]
        for i in range(min(n, len(self.pairs))):
            rec = self.pairs[i]
            src.append(source_features(rec["src_k"], rec["src_v"], used))
            for l in range(mot.cfg.tgt_layers):
                k = rec["tgt_k"][l].float().permute(1, 0, 2).reshape(-1, mot.cfg.tgt_kv_dim)  # [T, H*D]
                v = rec["tgt_v"][l].float().permute(1, 0, 2).reshape(-1, mot.cfg.tgt_kv_dim)
                tgt[l].append(torch.cat([k, v], -1))
        mot.src_mean.copy_(running_stats(src)[0])
        mot.src_std.copy_(running_stats(src)[1])
        for l in range(mot.cfg.tgt_layers):
            m, s = running_stats(tgt[l])
            mot.tgt_mean[l].copy_(m)
            mot.tgt_std[l].copy_(s)

    def batch(self, recs: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        """Pad a list of pair records into translator inputs and regression targets."""
        cfg = self.mot.cfg
        used = cfg.used_src
        lengths = [int(r["tgt_ids"].numel()) for r in recs]
        t_max, b = max(lengths), len(recs)
        src = torch.zeros(b, t_max, len(used) * 2 * cfg.src_kv_dim)
        ids = torch.zeros(b, t_max, dtype=torch.int64)
        tk = torch.zeros(b, cfg.tgt_layers, t_max, cfg.tgt_kv_dim)
        tv = torch.zeros_like(tk)
        for i, r in enumerate(recs):
            n = lengths[i]
            feats = source_features(r["src_k"], r["src_v"], used)
            src[i, :n] = align_tokens(r["src_off"], r["tgt_off"]) @ feats
            ids[i, :n] = r["tgt_ids"]
            tk[i, :, :n] = r["tgt_k"].float().permute(0, 2, 1, 3).reshape(cfg.tgt_layers, n, -1)  # [L, T, H*D]
            tv[i, :, :n] = r["tgt_v"].float().permute(0, 2, 1, 3).reshape(cfg.tgt_layers, n, -1)
        mask = torch.arange(t_max)[None, :] < torch.tensor(lengths)[:, None]
        return {"src": src, "ids": ids, "tk": tk, "tv": tv, "mask": mask, "lengths": torch.tensor(lengths)}

    def translate_batch(self, bt: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """Differentiable translation: keys/values `[B, L, H, T, D]` and the MoT output.
        With `self.replay = r > 0` the top r layers are recomputed by the frozen target
        from the replay head's residual stream (as `Translator.translate_many` does)."""
        below = self.mot.cfg.native_below
        with torch.no_grad():
            emb = self.ts.embed(bt["ids"]).float()
            residual = self.lower_residual(bt, emb) if below else None
        out = self.mot(bt["src"], emb, bt["mask"], residual)
        keys, values = assemble_kv(self.mot, self.ts, out, emb)
        if below:  # the layers the target computes itself: its native K/V (the pairs hold them)
            keys = torch.cat([self.native_keys(bt)[:, :below].to(keys.dtype), keys[:, below:]], 1)
            values = torch.cat([self.native_keys(bt, "tv")[:, :below].to(values.dtype), values[:, below:]], 1)
        if self.replay:
            keys, values = self.replay_kv(bt, emb, keys, values, out.hidden)
        return keys, values, out

    def lower_residual(self, bt: dict[str, torch.Tensor], emb: torch.Tensor) -> torch.Tensor:
        """The target's residual stream entering layer `native_below` over each chunk (after the
        shared prefix, at positions P..), `[B, T, hidden]`, zero on padding."""
        from cagkv.models.layers import run_layers

        dtype = next(self.target.model.parameters()).dtype
        out = emb.new_zeros(*emb.shape[:2], int(self.target.config.hidden_size))
        for i, n in enumerate(bt["lengths"].tolist()):
            cache = build_cache(self.target.config, self.target.spec, self.pairs.prefix_k.float(),
                                self.pairs.prefix_v.float(), torch.arange(self.P), dtype=dtype)
            positions = torch.arange(self.P, self.P + n)[None]
            out[i, :n] = run_layers(self.target.model, emb[i : i + 1, :n].to(dtype), positions, cache, 0,
                                    stop=self.mot.cfg.native_below)[0].float()
        return out

    def replay_kv(self, bt: dict[str, torch.Tensor], emb: torch.Tensor, keys: torch.Tensor,
                  values: torch.Tensor, hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Replace layers L-r.. of each chunk by the target's recomputation (differentiable)."""
        from cagkv.models.cache import extract_kv
        from cagkv.models.layers import run_layers

        spec, n_layers = self.target.spec, self.mot.cfg.tgt_layers
        start = n_layers - self.replay
        dtype = next(self.target.model.parameters()).dtype
        out_k, out_v = [], []
        for i, n in enumerate(bt["lengths"].tolist()):
            cache = build_cache(self.target.config, spec, self.pairs.prefix_k.float(), self.pairs.prefix_v.float(),
                                torch.arange(self.P), dtype=dtype)
            x = emb[i : i + 1, :n] if start == 0 else self.mot.boundary_hidden(
                bt["src"][i : i + 1, :n], emb[i : i + 1, :n], start, None if hidden is None else hidden[:, i : i + 1, :n])
            positions = torch.arange(self.P, self.P + n)
            run_layers(self.target.model, x.to(dtype), positions[None], cache, start)
            k_new, v_new = extract_kv(cache, spec, positions, dtype=torch.float32, layers=range(start, n_layers))
            # recomputed layers over the real tokens, the batch's padding kept as it was
            out_k.append(torch.cat([keys[i, :start], torch.cat([k_new, keys[i, start:, :, n:]], 2)], 0))
            out_v.append(torch.cat([values[i, :start], torch.cat([v_new, values[i, start:, :, n:]], 2)], 0))
        return torch.stack(out_k), torch.stack(out_v)

    def regression_loss(self, keys: torch.Tensor, values: torch.Tensor, bt: dict[str, torch.Tensor]) -> torch.Tensor:
        """Normalised MSE over translated layers and real tokens (post k-norm keys)."""
        cfg = self.mot.cfg
        idx = cfg.translated
        b, _, h, t, d = keys.shape
        k = keys[:, idx].permute(0, 1, 3, 2, 4).reshape(b, len(idx), t, h * d)  # [B, Lt, T, kv]
        v = values[:, idx].permute(0, 1, 3, 2, 4).reshape(b, len(idx), t, h * d)
        y = self.mot.normalise_target(k, v)
        y_nat = self.mot.normalise_target(bt["tk"][:, idx], bt["tv"][:, idx])
        err = ((y - y_nat) ** 2).mean(-1)  # [B, Lt, T]
        m = bt["mask"][:, None, :].float()
        return (err * m).sum() / (m.sum() * len(idx))

    # ------------------------------------------------------------------ stage 1
    def stage_regression(self, steps: int, opt: torch.optim.Optimizer, start: int = 0, ckpt: Callable | None = None) -> None:
        for step in range(start, steps):
            recs = [self.pairs[self.rng.randrange(len(self.pairs))] for _ in range(self.cfg.batch)]
            bt = self.batch(recs)
            keys, values, out = self.translate_batch(bt)
            loss = self.regression_loss(keys, values, bt)
            total = loss + self.cfg.aux_weight * out.aux_loss
            opt.zero_grad()
            total.backward()
            torch.nn.utils.clip_grad_norm_(self.mot.parameters(), 1.0)
            opt.step()
            self._after_step("regression", step, steps, {"loss": loss.item(), "aux": out.aux_loss.item()}, ckpt)
            self.steps_done = step + 1
            if self._out_of_time(step):
                break

    # ------------------------------------------------------------------ stage 2
    def attention_scores(self, q: torch.Tensor, k: torch.Tensor, layer: int) -> torch.Tensor:
        """Scaled scores `[Hq, C, T]` of queries `q [Hq, C, D]` over keys `k [H, T, D]` (both
        rotated) in one target layer, each KV head shared by its group of query heads."""
        rep = q.shape[0] // k.shape[0]
        return q @ k.repeat_interleave(rep, 0).transpose(1, 2) * self.ts.layers[layer].self_attn.scaling

    def attention_loss(self, keys: torch.Tensor, values: torch.Tensor, rec: dict[str, Any], b: int) -> torch.Tensor:
        """Relative error of per-layer attention outputs over chunk K/V under native queries."""
        spec, cfg = self.target.spec, self.mot.cfg
        n = int(rec["tgt_ids"].numel())
        pos = torch.arange(self.P, self.P + n)
        j = 0 if "c0_q" in rec else None
        if j is None:
            return keys.new_zeros(())
        q_all = rec[f"c{j}_q"].float()  # [L, Hq, C, D]
        losses = []
        for l in cfg.translated:
            q = q_all[l]
            k_nat = rotate(rec["tgt_k"][l].float(), pos, spec.rope[l])  # [H, T, D]
            v_nat = rec["tgt_v"][l].float()
            k_tr = rotate(keys[b, l, :, :n], pos, spec.rope[l])
            v_tr = values[b, l, :, :n]
            rep = q.shape[0] // k_nat.shape[0]
            o_nat = torch.softmax(self.attention_scores(q, k_nat, l), -1) @ v_nat.repeat_interleave(rep, 0)
            o_tr = torch.softmax(self.attention_scores(q, k_tr, l), -1) @ v_tr.repeat_interleave(rep, 0)
            losses.append(((o_tr - o_nat) ** 2).sum() / (o_nat ** 2).sum().clamp(min=1e-8))
        return torch.stack(losses).mean()

    def prefix_chunk_scores(self, q: torch.Tensor, chunk_keys: torch.Tensor, layer: int) -> torch.Tensor:
        """Scaled scores `[Hq, C, P+T]` of stored (rotated) queries `q [Hq, C, D]` over the
        shared prefix's keys followed by position-free chunk keys `[H, T, D]`, rotated at
        their positions, as the target attends at a continuation."""
        pre = self.pairs.prefix_k[layer].float()  # [H, P, D]
        pos = torch.arange(self.P + chunk_keys.shape[1])
        keys = rotate(torch.cat([pre, chunk_keys], 1), pos, self.target.spec.rope[layer])
        return self.attention_scores(q, keys, layer)

    def key_attention_loss(self, keys: torch.Tensor, rec: dict[str, Any], b: int, j: int) -> torch.Tensor:
        """KL of the target's native queries' attention (continuation j's kept positions) over
        prefix + native chunk keys against prefix + translated keys, mean over translated
        layers, heads and queries: a loss on the keys alone (E29: the keys hold the error)."""
        n = int(rec["tgt_ids"].numel())
        q_all = rec[f"c{j}_q"].float()  # [L, Hq, C, D], RoPE applied
        losses = []
        for l in self.mot.cfg.translated:
            lp_nat = torch.log_softmax(self.prefix_chunk_scores(q_all[l], rec["tgt_k"][l].float(), l), -1)
            lp_tr = torch.log_softmax(self.prefix_chunk_scores(q_all[l], keys[b, l, :, :n], l), -1)
            losses.append((lp_nat.exp() * (lp_nat - lp_tr)).sum(-1).mean())
        return torch.stack(losses).mean()

    def key_logit_weights(self) -> torch.Tensor:
        """`[L, H, D]` mean squared query per key channel (each KV head's group of query heads
        summed), from the training pairs' stored queries: the weights under which a key error
        becomes an expected attention-logit error (up to the layer's scaling, which cancels in
        `key_logit_loss`). RoPE rotates channel i with i + rd/2, so only the pair's energy is
        position-free; both channels of a pair get its mean."""
        if self._key_logit_w is None:
            spec, cfg = self.target.spec, self.mot.cfg
            h, d = cfg.tgt_kv_heads, cfg.tgt_head_dim
            total, count = torch.zeros(cfg.tgt_layers, h, d), 0
            for i in range(min(64, len(self.pairs))):
                rec = self.pairs[i]
                for j in range(len(rec["kinds"])):
                    q = rec[f"c{j}_q"].float()  # [L, Hq, N, D], rotated
                    total += (q ** 2).reshape(cfg.tgt_layers, h, -1, q.shape[2], d).sum((2, 3))
                    count += q.shape[2]
            if count == 0:
                raise ValueError("key_logit_weight needs pairs with stored queries (continuations)")
            w = total / count
            for l, rope in enumerate(spec.rope):
                if rope is not None:
                    half = rope.rotary_dim // 2
                    pair = (w[l, :, :half] + w[l, :, half : 2 * half]) / 2
                    w[l, :, :half], w[l, :, half : 2 * half] = pair, pair
            self._key_logit_w = w
        return self._key_logit_w

    def native_keys(self, bt: dict[str, torch.Tensor], name: str = "tk") -> torch.Tensor:
        """The batch's native keys `bt["tk"]` (values: `name="tv"`) in the layout of translated keys `[B, L, H, T, D]`."""
        cfg = self.mot.cfg
        b, n_layers, t, _ = bt[name].shape
        return bt[name].reshape(b, n_layers, t, cfg.tgt_kv_heads, cfg.tgt_head_dim).transpose(2, 3)

    def mix_native(self, keys: torch.Tensor, values: torch.Tensor, bt: dict[str, torch.Tensor],
                   share: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values `[B, L, H, T, D]` with `round(share * n)` real tokens of each chunk (drawn
        by `refresh_mix_by`: at random, or the ids the difficulty table ranks hardest) replaced on
        every layer by their native ones, as refresh would leave them: no gradient reaches those.
        With `refresh_mix_share="uniform"` each chunk's share is drawn from `[0, share)` instead."""
        picked = torch.zeros(bt["mask"].shape, dtype=torch.bool)  # [B, T]
        table = self.mix_table() if self.cfg.refresh_mix_by == "difficulty" else None
        for i, n in enumerate(bt["lengths"].tolist()):
            k = round((self._mix_rng.uniform(0, share) if self.cfg.refresh_mix_share == "uniform" else share) * n)
            if table is None:
                chosen = self._mix_rng.sample(range(n), k)
            else:  # the ids the table ranks hardest
                chosen = torch.topk(table[bt["ids"][i, :n]], k).indices.tolist()
            picked[i, chosen] = True
        where = picked[:, None, None, :, None]
        return (torch.where(where, self.native_keys(bt), keys),
                torch.where(where, self.native_keys(bt, "tv"), values))

    def mix_table(self) -> torch.Tensor:
        """The difficulty table `[V]` that `refresh_mix_by="difficulty"` draws the native share by:
        the one beside the translator training starts from (`init`)."""
        if self._mix_table is None:
            from cagkv.translate.difficulty import load_difficulty

            table = load_difficulty(self.cfg.init) if Path(self.cfg.init).is_dir() else None
            if table is None:
                raise TranslatorError(f"refresh_mix_by='difficulty' needs init to be a translator folder with a "
                                      f"difficulty table (benchmarks/fit_difficulty.py), got {self.cfg.init!r}")
            self._mix_table = table
        return self._mix_table

    def key_logit_errors(self, keys: torch.Tensor, bt: dict[str, torch.Tensor],
                         weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per translated layer `[Lt]`, summed over the batch: the weighted squared error of the
        keys centred within each chunk, and the native keys' weighted spread there. A shift
        shared by all of a chunk's keys moves every logit of a query alike, which the softmax
        mostly ignores. `weights` `[L, H, D]`: `key_logit_weights()` by default."""
        idx = self.mot.cfg.translated
        w = (self.key_logit_weights() if weights is None else weights)[idx][None, :, :, None, :]  # [1, Lt, H, 1, D]
        m = bt["mask"][:, None, None, :, None].float()  # [B, 1, 1, T, 1]
        n = m.sum(3, keepdim=True).clamp(min=1)

        def centred(k: torch.Tensor) -> torch.Tensor:
            return (k - (k * m).sum(3, keepdim=True) / n) * m

        k_nat = centred(self.native_keys(bt)[:, idx])
        err = (w * (centred(keys[:, idx]) - k_nat) ** 2).sum((0, 2, 3, 4))
        return err, (w * k_nat ** 2).sum((0, 2, 3, 4))

    def key_logit_loss(self, keys: torch.Tensor, bt: dict[str, torch.Tensor]) -> torch.Tensor:
        """Expected squared attention-logit error of every chunk key (centred within its chunk),
        relative to the native keys' spread, mean over translated layers. Dense (every token,
        every layer), where the e2e KL sees 16 positions."""
        err, spread = self.key_logit_errors(keys, bt)
        return (err / spread.clamp(min=1e-8)).mean()

    def stage_attention(self, steps: int, opt: torch.optim.Optimizer, start: int = 0, ckpt: Callable | None = None) -> None:
        for step in range(start, steps):
            recs = [self.pairs[self.rng.randrange(len(self.pairs))] for _ in range(max(1, self.cfg.batch // 2))]
            bt = self.batch(recs)
            keys, values, out = self.translate_batch(bt)
            att = torch.stack([self.attention_loss(keys, values, r, i) for i, r in enumerate(recs)]).mean()
            reg = self.regression_loss(keys, values, bt)
            total = att + self.cfg.anchor_weight * reg + self.cfg.aux_weight * out.aux_loss
            opt.zero_grad()
            total.backward()
            torch.nn.utils.clip_grad_norm_(self.mot.parameters(), 1.0)
            opt.step()
            self._after_step("attention", step, steps, {"loss": att.item(), "reg": reg.item()}, ckpt)
            self.steps_done = step + 1
            if self._out_of_time(step):
                break

    # ------------------------------------------------------------------ stage 3
    def continuation_logits(self, keys: torch.Tensor, values: torch.Tensor, b: int, n: int, c_ids: torch.Tensor,
                            keep: torch.Tensor | None = None) -> torch.Tensor:
        """The frozen target continues `c_ids` from prefix + translated chunk: logits `[N, V]`."""
        k_all = torch.cat([self.pairs.prefix_k.float(), keys[b, :, :, :n]], 2)  # [L, H, P+T, D]
        v_all = torch.cat([self.pairs.prefix_v.float(), values[b, :, :, :n]], 2)
        dtype = next(self.target.model.parameters()).dtype
        cache = build_cache(self.target.config, self.target.spec, k_all, v_all, torch.arange(self.P + n), dtype=dtype)
        kw = {} if keep is None else {"logits_to_keep": keep}
        return self.target.model(input_ids=c_ids[None], cache=cache, **kw).logits[0].float()

    def e2e_loss(self, keys: torch.Tensor, values: torch.Tensor, rec: dict[str, Any], b: int, j: int) -> torch.Tensor:
        n = int(rec["tgt_ids"].numel())
        w = rec[f"c{j}_w"].float()
        ans = rec[f"c{j}_ans"]
        score = w + ans.float() * (w.max() + 1.0)  # answer positions always kept
        sel = score.topk(min(self.cfg.kl_positions, score.numel())).indices.sort().values
        logits = self.continuation_logits(keys, values, b, n, rec[f"c{j}_ids"], keep=rec[f"c{j}_pos"][sel])
        kl = kl_topk(F.log_softmax(logits, -1), rec[f"c{j}_topi"][sel], rec[f"c{j}_topv"][sel].float())
        weight = (0.05 + w[sel] / w[sel].sum().clamp(min=1e-6)
                  + self.cfg.answer_weight * ans[sel].float() / max(1, int(ans[sel].sum())))
        return (weight * kl).sum() / weight.sum()

    def stage_e2e(self, steps: int, opt: torch.optim.Optimizer, start: int = 0, ckpt: Callable | None = None,
                  stage: str = "e2e", anchor: bool = True) -> None:
        for step in range(start, steps):
            opt.zero_grad()
            stats = {"loss": 0.0, "reg": 0.0}
            for _ in range(self.cfg.e2e_accum):
                rec = self.pairs[self.rng.randrange(len(self.pairs))]
                if not rec["kinds"]:
                    continue
                j = self.rng.randrange(len(rec["kinds"]))
                bt = self.batch([rec])
                keys, values, out = self.translate_batch(bt)
                if self.cfg.refresh_mix > 0:
                    kl = self.e2e_loss(*self.mix_native(keys, values, bt, self.cfg.refresh_mix), rec, 0, j)
                else:
                    kl = self.e2e_loss(keys, values, rec, 0, j)
                reg = self.regression_loss(keys, values, bt) if anchor else kl.new_zeros(())
                total = kl + self.cfg.anchor_weight * reg + self.cfg.aux_weight * out.aux_loss
                if anchor and self.cfg.key_weight > 0:
                    key = self.key_attention_loss(keys, rec, 0, j)
                    total = total + self.cfg.key_weight * key
                    stats["key"] = stats.get("key", 0.0) + key.item() / self.cfg.e2e_accum
                if anchor and self.cfg.key_logit_weight > 0:
                    klog = self.key_logit_loss(keys, bt)
                    total = total + self.cfg.key_logit_weight * klog
                    stats["key_logit"] = stats.get("key_logit", 0.0) + klog.item() / self.cfg.e2e_accum
                (total / self.cfg.e2e_accum).backward()
                stats["loss"] += kl.item() / self.cfg.e2e_accum
                stats["reg"] += reg.item() / self.cfg.e2e_accum
            torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], 1.0)
            opt.step()
            self._after_step(stage, step, steps, stats, ckpt)
            self.steps_done = step + 1
            if self._out_of_time(step):
                break

    def stage_boundary(self, replay: int, steps: int, opt: torch.optim.Optimizer, start: int = 0,
                       ckpt: Callable | None = None) -> None:
        """Context Correction for one replay head: KL of the target's continuations after
        replaying its top `replay` layers from the head, gradients into that head only."""
        head = self.mot.boundary[str(self.mot.cfg.tgt_layers - replay)]
        # Only the head takes gradients: the translated lower layers' K/V would otherwise send
        # backward work and never-cleared gradients into the mixture and the linear path.
        saved = {p: p.requires_grad for p in self.mot.parameters()}
        for p in self.mot.parameters():
            p.requires_grad_(False)
        for p in head.parameters():
            p.requires_grad_(True)
        self.replay = replay
        try:
            self.stage_e2e(steps, opt, start=start, ckpt=ckpt, stage=f"boundary_r{replay}", anchor=False)
        finally:
            self.replay = 0
            for p, flag in saved.items():
                p.requires_grad_(flag)

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self, pairs: PairSet | None = None, limit: int | None = None, replay: int = 0) -> dict[str, Any]:
        """Held-out metrics (see module doc). Recovery = (translated - none) / (native - none).
        `replay`: evaluate with the target recomputing its top `replay` layers (replay heads)."""
        previous, self.replay = self.replay, replay
        try:
            return self._evaluate(pairs, limit)
        finally:
            self.replay = previous

    def _evaluate(self, pairs: PairSet | None, limit: int | None) -> dict[str, Any]:
        pairs = pairs or self.heldout
        self.mot.eval()
        cfg = self.mot.cfg
        n_items = min(len(pairs), limit or self.cfg.eval_samples)
        sse = torch.zeros(cfg.tgt_layers)
        sst = torch.zeros(cfg.tgt_layers)
        att, kls, kls_w, ws, kls_next, klog = [], [], [], [], [], []
        ll = {"tr": 0.0, "nat": 0.0, "none": 0.0, "n": 0}
        top1 = {"tr": 0, "nat": 0, "none": 0, "n": 0}
        for i in range(n_items):
            rec = pairs[i]
            bt = self.batch([rec])
            keys, values, _ = self.translate_batch(bt)
            n = int(rec["tgt_ids"].numel())
            h, d = cfg.tgt_kv_heads, cfg.tgt_head_dim
            k = keys[0].permute(0, 2, 1, 3).reshape(cfg.tgt_layers, n, h * d)  # [L, T, kv]
            v = values[0].permute(0, 2, 1, 3).reshape(cfg.tgt_layers, n, h * d)
            pred = torch.cat([k, v], -1)
            nat = torch.cat([bt["tk"][0], bt["tv"][0]], -1)
            mean = self.mot.tgt_mean[:, None, :]
            sse += ((pred - nat) ** 2).sum((1, 2))
            sst += ((nat - mean) ** 2).sum((1, 2))
            att.append(float(self.attention_loss(keys, values, rec, 0)))
            if self.cfg.key_logit_weight > 0:
                klog.append(float(self.key_logit_loss(keys, bt)))
            for j, kind in enumerate(rec["kinds"]):
                pos = rec[f"c{j}_pos"]
                logits = self.continuation_logits(keys, values, 0, n, rec[f"c{j}_ids"], keep=pos)  # [N, V]
                logq = F.log_softmax(logits, -1)
                kl = kl_topk(logq, rec[f"c{j}_topi"], rec[f"c{j}_topv"].float())
                w = rec[f"c{j}_w"].float()
                kls.append(float(kl.mean()))
                kls_w.append(float((kl * w).sum()))
                ws.append(float(w.sum()))
                if kind == "next":
                    kls_next.append(kls[-1])
                    continue
                ans = rec[f"c{j}_ans"]
                gold = rec[f"c{j}_ids"][pos + 1]
                ll["tr"] += float(logq.gather(1, gold[:, None])[:, 0][ans].mean())
                ll["nat"] += float(rec[f"c{j}_ll_nat"][ans].mean())
                ll["none"] += float(rec[f"c{j}_ll_none"][ans].mean())
                ll["n"] += 1
                top1["tr"] += int((logq.argmax(-1)[ans] == gold[ans]).sum())
                top1["nat"] += int((rec[f"c{j}_topi"][:, 0].long()[ans] == gold[ans]).sum())
                top1["n"] += int(ans.sum())
        self.mot.train()
        r2 = (1 - sse / sst.clamp(min=1e-8)).tolist()
        m = max(ll["n"], 1)
        gap = (ll["nat"] - ll["none"]) / m
        rec_ll = ((ll["tr"] - ll["none"]) / m) / gap if abs(gap) > 1e-9 else float("nan")
        return {
            "heldout_chunks": n_items,
            "r2_per_layer": [round(x, 4) for x in r2],
            "r2_mean_translated": round(sum(r2[l] for l in cfg.translated) / len(cfg.translated), 4),
            "attention_rel_error": round(sum(att) / max(1, len(att)), 4),
            "key_logit_rel_error": round(sum(klog) / len(klog), 4) if klog else None,
            "continuation_kl": round(sum(kls) / max(1, len(kls)), 4),
            "continuation_kl_doc_weighted": round(sum(kls_w) / max(1e-9, sum(ws)), 4),
            # plain continuation of the document's text (kind "next"): what QA-only training can hurt
            "continuation_kl_next": round(sum(kls_next) / len(kls_next), 4) if kls_next else None,
            "answer_ll": {k: round(ll[k] / m, 4) for k in ("tr", "nat", "none")},
            "answer_ll_recovery": round(rec_ll, 4),
            "answer_top1": {k: round(top1[k] / max(1, top1["n"]), 4) for k in ("tr", "nat")},
            "answers": ll["n"],
        }

    # ------------------------------------------------------------------ plumbing
    def _after_step(self, stage: str, step: int, steps: int, stats: dict[str, float], ckpt: Callable | None) -> None:
        if (step + 1) % self.cfg.log_every == 0 or step + 1 == steps:
            rec = {"stage": stage, "step": step + 1, "of": steps, "t": round(time.time() - self.t_start, 1)}
            rec.update({k: round(v, 5) for k, v in stats.items()})
            self.log(rec)
        if ckpt is not None and ((step + 1) % self.cfg.ckpt_every == 0 or step + 1 == steps):
            ckpt(stage, step + 1)

    def begin_stage(self, stage: str) -> None:
        self.stage, self.stage_t0 = stage, time.time()

    def _out_of_time(self, step: int) -> bool:
        now = time.time()
        if self.cfg.max_minutes > 0 and (now - self.t_start) / 60 > self.cfg.max_minutes:
            return True
        budget = self.cfg.stage_minutes.get(getattr(self, "stage", ""), 0.0)
        return budget > 0 and (now - getattr(self, "stage_t0", now)) / 60 > budget


def stage_steps(cfg: TrainConfig) -> dict[str, int]:
    return {"regression": cfg.steps_regression, "attention": cfg.steps_attention, "e2e": cfg.steps_e2e}


TRAIN_ONLY = ("", "mixture", "streams", "key_scale")
LINEAR_PARAMS = ("skip_a", "skip_b", "skip_bias", "boundary.")


def freeze_for(mot: MoTTranslator, train_only: str) -> int:
    """`train_only="mixture"`: stop gradients into the linear path and the replay heads
    (the closed-form part), so the gradient stages train only the mixture; `"streams"`:
    into everything but the layer streams; `"key_scale"`: into everything but the keys' per-layer
    scales (`key_scale`). Returns the number of parameters left trainable."""
    if train_only not in TRAIN_ONLY:
        raise ValueError(f"train_only must be one of {TRAIN_ONLY}, got {train_only!r}")
    if train_only == "streams" and not mot.cfg.layer_streams:
        raise ValueError("train_only='streams' needs layer_streams")
    if train_only == "key_scale" and not mot.cfg.key_scale:
        raise ValueError("train_only='key_scale' needs key_scale")
    for name, p in mot.named_parameters():
        if (train_only == "mixture" and name.startswith(LINEAR_PARAMS)) or \
                (train_only == "streams" and not name.startswith("streams.")) or \
                (train_only == "key_scale" and name != "key_log_scale"):
            p.requires_grad_(False)
    return sum(p.numel() for p in mot.parameters() if p.requires_grad)


def make_optimizer(mot: MoTTranslator, stage: str, cfg: TrainConfig) -> torch.optim.Optimizer:
    lr = cfg.lr_e2e if stage == "e2e" else cfg.lr
    return torch.optim.AdamW([p for p in mot.parameters() if p.requires_grad], lr=lr, weight_decay=0.01)


def train(source_name: str, target_name: str, cfg: TrainConfig, progress: bool = True) -> Path:
    """Run (or resume) the whole pipeline into `cfg.out`; returns the artifact folder."""
    from cagkv.translate.runner import run_training

    return run_training(source_name, target_name, cfg, progress=progress)

