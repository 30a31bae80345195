"""`Translator`: a trained MoT bound to its card; turns source KV blocks into target blocks.

    translate(block, target)  one chunk
    translate_many(blocks, target)  all retrieved chunks in one padded batch (one expert
                                    dispatch for every token, layer group and slot)
    translate_many(..., replay=r)   the target recomputes its top r layers over each chunk
                                    from the replay head's residual stream entering layer
                                    L - r (r = L: from its own embeddings, i.e. native)
    translate_many(..., window=True) `mot-window`: the target recomputes every layer over
                                    each chunk, attending over translated K/V in a window
                                    of ~30 % of its layers (the paper's reference inference)

Replay and window run each chunk after the target's own context prefix at positions
P..P+T-1 (as at ingest and in training) and return position-free keys, like translation.

Every call computes the translated K/V with the folded inference form of the network
(`cagkv.translate.folded`, E56); `set_linear_path(dtype, folded=False)` runs the training
graph instead (what `assemble_kv` gives; for side-by-side benchmarks).

The returned `KVBlock` holds the target's tokens of the same chunk text, position-free
keys (the engine rotates them with the target's RoPE at their assembled positions) and
values, in the target model's dtype.

Example:
    >>> tr = find_translator(source.fingerprint, target.fingerprint)
    >>> tblock = tr.translate(block, target)       # block made by the source model
"""

from __future__ import annotations

import copy
import math
import os
import warnings
import time
from typing import TYPE_CHECKING, Any, Sequence

import torch

from cagkv.align import align_tokens, token_offsets_many
from cagkv.errors import TranslatorError, UsageError
from cagkv.kv import KVBlock
from cagkv.models.layers import parse_bias_scope
from cagkv.translate.features import TargetSide, source_features
from cagkv.translate.folded import FoldedMoT
from cagkv.translate.mot import MoTOutput, MoTTranslator

WINDOW_START, WINDOW_SHARE = 0.35, 0.30  # mot-window: layers at relative depth [0.35, 0.65)


def window_layers(num_layers: int, start: float = WINDOW_START, share: float = WINDOW_SHARE) -> list[int]:
    """The `mot-window` layers: about `share` of the stack starting at relative depth `start`."""
    n = max(1, round(share * num_layers))
    first = min(max(1, round(start * num_layers)), num_layers - n)
    return list(range(first, first + n))


LINEAR_DTYPE_ENV = "CAGKV_LINEAR_DTYPE"


def linear_path_dtype() -> torch.dtype:
    """The dtype the translator's folded linear path multiplies in at inference
    (`MoTTranslator.fold_skip`): bfloat16 where the CPU has bfloat16 arithmetic (avx512_bf16
    or AMX), float32 elsewhere, where bfloat16 would be emulated. The path is most of the
    translation's multiply-adds; its bfloat16 error (~0.3 % of its output) is far below the
    translation's own. `CAGKV_LINEAR_DTYPE=float32|bfloat16|auto` overrides."""
    value = os.environ.get(LINEAR_DTYPE_ENV, "auto").strip().lower()
    if value in ("float32", "bfloat16"):
        return getattr(torch, value)
    if value != "auto":
        raise UsageError(f"{LINEAR_DTYPE_ENV} must be float32, bfloat16 or auto (got {value!r})")
    cpu = torch.cpu
    native = any(getattr(cpu, probe, lambda: False)() for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
    return torch.bfloat16 if native else torch.float32


if TYPE_CHECKING:
    from cagkv.models import LoadedModel

__all__ = ["Translator", "TranslateInputs", "prepare_inputs", "assemble_kv", "card_default_refresh", "card_refresh_scoring",
           "card_peak_z", "card_attention_bias", "card_bias_scope"]


class TranslateInputs:
    """Padded batch of translator inputs on the target grid."""

    def __init__(self, src: torch.Tensor, ids: torch.Tensor, offsets: list[torch.Tensor], lengths: list[int]):
        self.src = src  # [B, T, F]
        self.ids = ids  # [B, T] target ids (0 where padded)
        self.offsets = offsets  # per block [T_b, 2]
        self.lengths = lengths
        self.mask = (torch.arange(ids.shape[1], device=ids.device)[None, :]
                     < torch.tensor(lengths, device=ids.device)[:, None])  # [B, T]


def prepare_inputs(
    mot: MoTTranslator, src_blocks: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    tgt_tokens: Sequence[tuple[torch.Tensor, torch.Tensor]], device: torch.device | str = "cpu",
    batched: bool | None = None,
) -> TranslateInputs:
    """Align each source block `(keys, values, offsets)` onto its target tokens `(ids, offsets)`,
    on `device`. On the CPU block by block (a sparse product each); elsewhere (or `batched`)
    every block at once: the blocks are moved there (half the bytes of the aligned features)
    and pooled in one gather, a few kernels whatever the number of blocks, where a GPU would
    otherwise spend its time launching per-block ones."""
    device = torch.device(device)
    batched = device.type != "cpu" if batched is None else batched
    used = mot.cfg.used_src
    lengths = [int(t_ids.shape[0]) for t_ids, _ in tgt_tokens]
    t_max = max(lengths, default=0)
    width = len(used) * 2 * mot.cfg.src_kv_dim
    ids = torch.zeros(len(lengths), t_max, dtype=torch.int64)
    for i, (t_ids, _) in enumerate(tgt_tokens):
        ids[i, : lengths[i]] = t_ids
    weights = [align_tokens(s_off, t_off) for (_, _, s_off), (_, t_off) in zip(src_blocks, tgt_tokens)]  # [T, S] each
    offsets = [t_off for _, t_off in tgt_tokens]
    if not batched:
        src = torch.empty(len(lengths), t_max, width, device=device)  # padding zeroed below, not the whole batch
        for i, ((k, v, _), w) in enumerate(zip(src_blocks, weights)):
            pool_features(w, source_features(k.to(device), v.to(device), used), src[i, : lengths[i]],
                          sparse=device.type == "cpu")
            src[i, lengths[i] :] = 0
        return TranslateInputs(src, ids.to(device), offsets, lengths)
    rows, cols, shares, s_at = [], [], [], 0
    for i, w in enumerate(weights):  # one block-diagonal alignment over the padded batch
        r, c = w.nonzero(as_tuple=True)
        rows.append(r + i * t_max)
        cols.append(c + s_at)
        shares.append(w[r, c])
        s_at += w.shape[1]
    # each block to the device, then one concatenation there (no host copy of them all)
    keys = torch.cat([k.to(device) for k, _, _ in src_blocks], dim=2)  # [Ls, H, S_all, D]
    values = torch.cat([v.to(device) for _, v, _ in src_blocks], dim=2)
    src = torch.zeros(len(lengths) * t_max, width, device=device)
    gather_pool(torch.cat(rows).to(device), torch.cat(cols).to(device), torch.cat(shares).to(device),
                source_features(keys, values, used), src)
    return TranslateInputs(src.view(len(lengths), t_max, width), ids.to(device), offsets, lengths)


def pool_features(w: torch.Tensor, feats: torch.Tensor, out: torch.Tensor, sparse: bool = True) -> None:
    """`out[T, F] = w[T, S] @ feats[S, F]` for alignment weights with 1-3 non-zeros per row:
    a sparse product, or (`sparse=False`) the same sum as `gather_pool`."""
    if sparse:
        with warnings.catch_warnings():  # "sparse CSR support is in beta"; mm on it is long stable
            warnings.simplefilter("ignore", UserWarning)
            torch.mm(w.to_sparse_csr(), feats, out=out)
        return
    rows, cols = w.nonzero(as_tuple=True)
    out.zero_()
    gather_pool(rows, cols, w[rows, cols], feats, out)


def gather_pool(rows: torch.Tensor, cols: torch.Tensor, shares: torch.Tensor, feats: torch.Tensor,
                out: torch.Tensor) -> None:
    """`out[rows] += shares * feats[cols]`: a sparse product as one gather and one index_add
    (plain kernels on any device)."""
    out.index_add_(0, rows, feats.index_select(0, cols) * shares[:, None])


def assemble_kv(
    mot: MoTTranslator, ts: TargetSide, out: MoTOutput, emb: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """MoT output + exact layers -> keys, values `[B, L, H, T, D]` (differentiable)."""
    cfg = mot.cfg
    k_tr, v_tr = mot.decode(out.y)  # [B, Lt, T, kv]
    b, _, t, _ = k_tr.shape
    h, d = cfg.tgt_kv_heads, cfg.tgt_head_dim
    k0, v0 = ts.exact_kv(emb, 0)  # [B, H, T, D]
    scales = mot.key_scales()
    keys, values = [], []
    for layer in range(cfg.tgt_layers):
        if layer in cfg.exact_layers:
            keys.append(k0.to(k_tr.dtype))
            values.append(v0.to(k_tr.dtype))
            continue
        i = cfg.translated.index(layer)
        k = k_tr[:, i].reshape(b, t, h, d).transpose(1, 2)  # [B, H, T, D]
        v = v_tr[:, i].reshape(b, t, h, d).transpose(1, 2)
        k = ts.k_post(k, layer)
        keys.append(k if scales is None else k * scales[layer].to(k.dtype))
        values.append(v)
    return torch.stack(keys, 1), torch.stack(values, 1)  # [B, L, H, T, D]



# What a card's measured defaults mean, read leniently (a value out of range falls back to the
# library's default); shared by `Translator` and `cagkv translators list` (`list_translators`).
def card_default_refresh(card: dict[str, Any]) -> float:
    """The card's `default_refresh` if it is a share in [0, 1], else 0."""
    try:
        value = float(card.get("default_refresh", 0.0) or 0.0)
    except (TypeError, ValueError):
        return 0.0
    return value if 0.0 <= value <= 1.0 else 0.0


def card_refresh_scoring(card: dict[str, Any], has_table: bool) -> str:
    """The card's `default_refresh_scoring` if it is one of `cagkv.refresh.SCORINGS` that the
    translator can run (a difficulty scoring needs its table), else `DEFAULT_SCORING`."""
    from cagkv.refresh import DEFAULT_SCORING, NEEDS_DIFFICULTY, SCORINGS

    value = card.get("default_refresh_scoring")
    if value not in SCORINGS or (value in NEEDS_DIFFICULTY and not has_table):
        return DEFAULT_SCORING
    return str(value)


def card_peak_z(card: dict[str, Any]) -> float:
    """The `peak_z` of the card's difficulty record if positive and finite, else `PEAK_Z`."""
    from cagkv.refresh import PEAK_Z

    record = card.get("difficulty")
    try:
        value = float(record.get("peak_z", PEAK_Z)) if isinstance(record, dict) else PEAK_Z
    except (TypeError, ValueError):
        return PEAK_Z
    return value if math.isfinite(value) and value > 0 else PEAK_Z


def card_attention_bias(card: dict[str, Any], key: str = "attention_bias") -> float:
    """The card's `attention_bias` (added to the translated tokens' attention logits at question
    time where a refresh runs, docs/EXPERIMENTS.md E86-E87), or with `key="attention_bias_r0"`
    the one for pure translation (no refresh, no replay; E88), if a finite number, else 0."""
    try:
        value = float(card.get(key, 0.0) or 0.0)
    except (TypeError, ValueError):
        return 0.0
    return value if math.isfinite(value) else 0.0


def card_bias_scope(card: dict[str, Any], key: str) -> str:
    """The card's scope for its bias `key` (`key + "_scope"`, in `cagkv.models.layers.parse_bias_scope`'s
    words, as in "answer4,rest:full": docs/EXPERIMENTS.md E88e, E90, E93) where it names a valid
    one, else "all"."""
    value = card.get(f"{key}_scope", "all")
    try:
        parse_bias_scope(value if isinstance(value, str) else "")
    except ValueError:
        return "all"
    return value


class Translator:
    """A trained translator for one (source, target) model pair. See module doc."""

    def __init__(self, model: MoTTranslator, card: dict[str, Any], path: str | None = None) -> None:
        self.model = model.eval()
        self._folded_mot: FoldedMoT | None = None
        self._folded_for: tuple[str, torch.dtype] | None = None  # (target fingerprint, dtype) it was built for
        self.set_linear_path(linear_path_dtype())
        self.card = card
        self.last_replay_ms = 0.0  # time of the last call's replay / window recomputation
        self._prefixes: dict[tuple[str, str], tuple[Any, int]] = {}  # target's own prefix cache
        self.path = path  # artifact folder, when loaded from one

    def set_linear_path(self, dtype: torch.dtype, folded: bool = True) -> None:
        """The dtype the translator's linear parts multiply in, and whether translation uses
        the folded inference form (`cagkv.translate.folded`, the default) or the training
        graph with a folded linear path (E55's form)."""
        self.linear_dtype, self.folded = dtype, folded
        self.model.fold_skip(dtype)

    @property
    def source_fingerprint(self) -> str:
        return str(self.card["source"]["fingerprint"])

    @property
    def target_fingerprint(self) -> str:
        return str(self.card["target"]["fingerprint"])

    @property
    def quality(self) -> float | None:
        """The held-out quality score `auto` compares with `auto_threshold`."""
        value = self.card.get("quality", {}).get("value")
        return None if value is None else float(value)

    @property
    def auto_threshold(self) -> float:
        return float(self.card.get("quality", {}).get("auto_threshold", 1.0))

    @property
    def auto_ok(self) -> bool:
        """True when the card's held-out quality reaches its recorded `auto` threshold."""
        q = self.quality
        return q is not None and q >= self.auto_threshold

    def good_enough(self) -> tuple[bool, str]:
        """`auto` mode's verdict from the card: (passes, reason with the numbers)."""
        q = self.quality
        metric = self.card.get("quality", {}).get("metric", "quality")
        if q is None:
            return False, "its card records no held-out quality"
        verb = ">=" if q >= self.auto_threshold else "<"
        return q >= self.auto_threshold, f"held-out {metric} {q:.3f} {verb} threshold {self.auto_threshold:.2f}"

    @property
    def default_replay(self) -> int:
        """The replay `auto`/`translate` use when none is asked: the card's measured choice."""
        value = int(self.card.get("default_replay", 0) or 0)
        return value if value in self.replay_values else 0

    @property
    def default_refresh(self) -> float:
        """The share of chunk tokens `auto`/`translate` refresh when none is asked: the card's
        measured choice (`cagkv.refresh`; 0 where the card names none or a value outside [0, 1])."""
        return card_default_refresh(self.card)

    @property
    def default_refresh_scoring(self) -> str:
        """How `auto`/`translate` rank the tokens to refresh when no scoring is asked: the card's
        measured choice, where it names one of `cagkv.refresh.SCORINGS` that this translator can
        run (a difficulty scoring needs its table), else `cagkv.refresh.DEFAULT_SCORING`."""
        return card_refresh_scoring(self.card, has_table=self.difficulty is not None)

    @property
    def attention_bias(self) -> float:
        """What `translate` adds to the attention logits of the tokens a refresh leaves translated
        when none is asked: the card's measured choice (0 where it names none; `CAG.prepare`
        uses it only where a refresh runs)."""
        return card_attention_bias(self.card)

    @property
    def attention_bias_r0(self) -> float:
        """Likewise for pure translation (no refresh, no replay: every chunk token translated),
        measured apart from the refresh one (docs/EXPERIMENTS.md E88); 0 where the card names none."""
        return card_attention_bias(self.card, "attention_bias_r0")

    @property
    def attention_bias_scope(self) -> str:
        """Where the card's `attention_bias` acts ("all" where it names none; E94)."""
        return card_bias_scope(self.card, "attention_bias")

    @property
    def attention_bias_r0_scope(self) -> str:
        """Where the card's `attention_bias_r0` acts ("all" where it names none; "answer4,rest:full":
        the question's and the first 4 answer tokens' in every layer, the later answer tokens' in
        the full-attention layers, E93)."""
        return card_bias_scope(self.card, "attention_bias_r0")

    @property
    def difficulty(self) -> torch.Tensor | None:
        """Expected translation error per target token id `[V]` (1.0 = average), read once from
        the artifact's `difficulty.safetensors` (`cagkv.translate.difficulty`); None without one."""
        if not hasattr(self, "_difficulty"):
            from cagkv.translate.difficulty import load_difficulty

            self._difficulty = load_difficulty(self.path) if self.path else None
        return self._difficulty

    @property
    def kv_bias(self) -> dict[str, torch.Tensor] | None:
        """The translator's mean error per target layer and KV head (`{"keys", "values"}`
        `[L, H, D]`, keys before RoPE), added to every translation; read once from the
        artifact's `kv_bias.safetensors` (`cagkv.translate.kv_bias`); None without one."""
        if not hasattr(self, "_kv_bias"):
            from cagkv.translate.kv_bias import load_kv_bias

            cfg = self.model.cfg
            self._kv_bias = (load_kv_bias(self.path, cfg.tgt_layers, cfg.tgt_kv_heads, cfg.tgt_head_dim)
                             if self.path else None)
        return self._kv_bias

    @property
    def key_ridge(self) -> dict[str, torch.Tensor] | None:
        """A closed-form correction of the translated keys from every source layer, added to
        every translation; read once from the artifact's `key_ridge.safetensors`
        (`cagkv.translate.key_ridge`, E108); None without one."""
        if not hasattr(self, "_key_ridge"):
            from cagkv.translate.key_ridge import load_key_ridge

            cfg = self.model.cfg
            self._key_ridge = (load_key_ridge(self.path, cfg.src_layers, cfg.src_kv_dim, cfg.tgt_layers,
                                              cfg.tgt_kv_heads * cfg.tgt_head_dim) if self.path else None)
        return self._key_ridge

    @property
    def attention_fit(self) -> torch.Tensor | None:
        """An attention bias table `[L, H]` (target layers by query heads) fitted to native's
        attention shares, which the bias scope word "fitted" scales a bias by; read once from the
        artifact's `attention_bias_fit.safetensors` (`cagkv.translate.attention_fit`); None without one."""
        if not hasattr(self, "_attention_fit"):
            from cagkv.translate.attention_fit import load_attention_fit

            self._attention_fit = load_attention_fit(self.path, self.model.cfg.tgt_layers) if self.path else None
        return self._attention_fit

    @property
    def peak_z(self) -> float:
        """Where "adaptive" refresh scoring switches to contrast (`cagkv.refresh.peakedness`):
        the threshold the card's difficulty record names, tuned for this target on held-out
        data (docs/EXPERIMENTS.md E77), else `cagkv.refresh.PEAK_Z` (tuned for E72's pair)."""
        return card_peak_z(self.card)

    @property
    def replay_values(self) -> list[int]:
        """The `replay` values this translator supports: 0, one per replay head, and L."""
        n = self.model.cfg.tgt_layers
        return sorted({0, n, *(n - b for b in self.model.cfg.boundaries)})

    def translate(self, block: KVBlock, target: LoadedModel, replay: int = 0, window: bool = False) -> KVBlock:
        """Translate one source block into the target's KV format (see module doc)."""
        return self.translate_many([block], target, replay=replay, window=window)[0]

    @torch.no_grad()
    def translate_many(self, blocks: Sequence[KVBlock], target: LoadedModel, replay: int = 0,
                       window: bool = False) -> list[KVBlock]:
        """Translate several blocks in one padded batch (see module doc for replay / window)."""
        self.last_replay_ms = 0.0
        if replay not in self.replay_values:
            raise TranslatorError(
                f"this translator supports replay in {self.replay_values} (asked {replay}); its card lists the "
                "replay heads it was trained with"
            )
        if replay and window:
            raise TranslatorError("replay and mot-window are two different inferences: use one")
        self.check_models(blocks, target)
        if not blocks:
            return []
        tgt_tokens = token_offsets_many(target.tokenizer, [b.text for b in blocks])
        empty = [i for i, (ids, _) in enumerate(tgt_tokens) if ids.numel() == 0 or blocks[i].num_tokens == 0]
        if empty:
            raise TranslatorError(f"cannot translate an empty chunk (block {empty[0]})")
        self._follow(target.device)
        inputs = prepare_inputs(self.model, [(b.keys, b.values, b.offsets) for b in blocks], tgt_tokens,
                                device=target.device)
        ts = TargetSide(target.model)
        dtype = next(target.model.parameters()).dtype
        emb = ts.embed(inputs.ids).float()
        below = self.model.cfg.native_below
        residual = lower = None
        if below:  # the target's own layers below `below` over each chunk, and the residual stream there
            t0 = time.perf_counter()
            lower = [self._run_chunk(target, emb[i : i + 1, :n].to(dtype), 0, below)
                     for i, n in enumerate(inputs.lengths)]
            residual = emb.new_zeros(*emb.shape[:2], lower[0][0].shape[-1])
            for i, n in enumerate(inputs.lengths):
                residual[i, :n] = lower[i][0][0].float()
            self.last_replay_ms = (time.perf_counter() - t0) * 1000
        if self._uses_folded():
            kv, hidden = self._folded(target, ts).kv(inputs, emb, out_dtype=dtype, residual=residual)
        else:
            out = self.model(inputs.src, emb, inputs.mask, residual)
            keys, values = assemble_kv(self.model, ts, out, emb.to(dtype))
            kv = [(keys[i, :, :, :n].to(dtype).contiguous(), values[i, :, :, :n].to(dtype).contiguous())
                  for i, n in enumerate(inputs.lengths)]
            hidden = out.hidden
        for (keys, values), (_, k_low, v_low) in zip(kv, lower or []):
            keys[:below], values[:below] = k_low, v_low
        if self.key_ridge is not None:  # before replay, like the bias below
            from cagkv.translate.key_ridge import apply_key_ridge, ridge_features

            ridge = self.key_ridge
            kv = [(apply_key_ridge(keys, ridge_features(b.keys.to(keys.device), b.values.to(keys.device), b.offsets,
                                                        tgt_tokens[i][1], ridge["source_layers"].tolist()), ridge),
                   values) for i, (b, (keys, values)) in enumerate(zip(blocks, kv))]
        if self.kv_bias is not None:  # before replay: the layers it recomputes read the ones below
            from cagkv.translate.kv_bias import apply_kv_bias

            kv = [apply_kv_bias(keys, values, self.kv_bias) for keys, values in kv]
        if replay or window:
            t0 = time.perf_counter()
            for i, (keys, values) in enumerate(kv):
                n = inputs.lengths[i]
                if window:
                    h = emb[i : i + 1, :n].to(dtype)
                    start, inject = 0, window_layers(self.model.cfg.tgt_layers)
                else:
                    start, inject = self.model.cfg.tgt_layers - replay, []
                    h = (emb[i : i + 1, :n] if start == 0 else
                         self.model.boundary_hidden(inputs.src[i : i + 1, :n], emb[i : i + 1, :n], start,
                                                    hidden[:, i : i + 1, :n])).to(dtype)
                _, keys[start:], values[start:] = self._run_chunk(target, h, start, keys=keys, values=values,
                                                                  inject=inject)
            self.last_replay_ms += (time.perf_counter() - t0) * 1000
        return [self._block(block, k, v, tgt_tokens[i], target) for i, (block, (k, v)) in enumerate(zip(blocks, kv))]

    @staticmethod
    def _block(block: KVBlock, keys: torch.Tensor, values: torch.Tensor, tokens: tuple[torch.Tensor, torch.Tensor],
               target: LoadedModel) -> KVBlock:
        return KVBlock(keys=keys, values=values, token_ids=tokens[0], offsets=tokens[1], text=block.text,
                       model_fingerprint=target.fingerprint, extra={"translated_from": block.model_fingerprint})

    def warm(self, target: LoadedModel) -> None:
        """Build what the first translation into `target` would build (the folded form), so
        that a caller timing translations does not time this one-time cost."""
        if self._uses_folded():
            self._folded(target, TargetSide(target.model))

    def _follow(self, device: torch.device) -> None:
        """Move the network to the target's device (and drop a folded form built elsewhere)."""
        if next(self.model.parameters()).device != device:
            self.model.to(device)
            self._folded_mot, self._folded_for = None, None
            self._prefixes.clear()

    def _uses_folded(self) -> bool:
        return self.folded and FoldedMoT.supports(self.model)

    def _folded(self, target: LoadedModel, ts: TargetSide) -> FoldedMoT:
        """The inference form of the translator for `target` (built at the first translation)."""
        key = (target.fingerprint, self.linear_dtype)
        if self._folded_for != key:
            self._folded_mot, self._folded_for = FoldedMoT(self.model, ts, self.linear_dtype), key
        return self._folded_mot

    def _prefix(self, target: LoadedModel) -> tuple[Any, int]:
        """The target's own context-prefix cache (computed once per target), and its length."""
        from cagkv.models.cache import full_cache
        from cagkv.models.layers import forward_at
        from cagkv.prompt import PromptFormat

        key = (target.fingerprint, str(target.dtype))
        if key not in self._prefixes:
            ids = PromptFormat.for_model(target).context_prefix_ids()
            cache = full_cache()
            if ids:
                forward_at(target.model, ids, 0, cache)
            self._prefixes[key] = (cache, len(ids))
        return self._prefixes[key]

    def _run_chunk(self, target: LoadedModel, hidden: torch.Tensor, start: int, stop: int | None = None,
                   keys: torch.Tensor | None = None, values: torch.Tensor | None = None,
                   inject: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run the target's layers start..stop-1 over one chunk after its prefix, from `hidden`
        `[1, T, E]` (the residual stream entering `start`); `inject` layers attend over (and keep)
        the translated `keys`/`values` given. Returns the residual stream after them and the
        position-free K, V `[stop - start, H, T, D]` of those layers."""
        from cagkv.models.cache import extract_kv
        from cagkv.models.layers import inject_kv, run_layers
        from cagkv.models.rope import rotate

        stop = target.spec.num_layers if stop is None else stop
        prefix, p = self._prefix(target)
        cache = copy.deepcopy(prefix)
        t = hidden.shape[1]
        positions = torch.arange(p, p + t, device=hidden.device)
        given = {l: (rotate(keys[l], positions, target.spec.rope[l], out_dtype=keys.dtype)[None], values[l][None])
                 for l in inject}
        with inject_kv(cache, given):
            out = run_layers(target.model, hidden, positions[None], cache, start, stop)
        k_new, v_new = extract_kv(cache, target.spec, positions, dtype=torch.float32, layers=range(start, stop))
        dtype = hidden.dtype if keys is None else keys.dtype
        return out, k_new.to(dtype), v_new.to(dtype)

    def check_models(self, blocks: Sequence[KVBlock], target: LoadedModel) -> None:
        """Refuse blocks or a target whose fingerprint differs from the card's."""
        if target.fingerprint != self.target_fingerprint:
            raise TranslatorError(
                f"translator is for target model {self.target_fingerprint}, got {target.fingerprint} ({target.name})"
            )
        for b in blocks:
            if b.model_fingerprint != self.source_fingerprint:
                raise TranslatorError(
                    f"translator is for source model {self.source_fingerprint}, block was made by {b.model_fingerprint}"
                )

