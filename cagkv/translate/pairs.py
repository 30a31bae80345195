"""Paired training data, cached on disk: what the source stored and what the target does.

For every `Sample` (chunk + continuations) one safetensors file holds:

    src_k, src_v   [Ls, Hs, S, Ds] f16  source K (position-free) / V of the chunk, prefilled
                                        after the source's own context prefix (as at ingest)
    src_off        [S, 2]               character spans of the source tokens
    tgt_ids, tgt_off, tgt_k, tgt_v      the same for the target's native prefill
    c{j}_ids       [C]                  continuation j: separator + question suffix + answer, or
                                        separator + the document's next text
    c{j}_pos       [N]                  kept predictions i (predicting ids[i+1]): the last
                                        `predict` ones, always covering the answer
    c{j}_ans       [N] bool             prediction targets an answer token
    c{j}_topi/topv [N, K]               native next-token top-K ids / log-probs
    c{j}_ll_nat, c{j}_ll_none [N]       log-prob of the true next token, native / no document
    c{j}_w         [N]                  KL(native || no document): how much the document matters
    c{j}_q         [L, Hq, N, D] f16    the target's queries at those positions, RoPE applied

plus `prefix.safetensors` (the target's own prefix K/V, position-free) and `index.json`.
Building is resumable: existing sample files are kept.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn.functional as F

from cagkv.align import token_offsets
from cagkv.models.cache import build_cache, extract_kv, full_cache
from cagkv.models.rope import rotate
from cagkv.prompt import PromptFormat
from cagkv.translate.corpus import Sample

if TYPE_CHECKING:
    from cagkv.models import LoadedModel

__all__ = ["build_pairs", "PairSet", "continuation_ids", "prefill_kv"]


def continuation_ids(fmt: PromptFormat, kind: str, question: str, answer: str) -> tuple[list[int], int]:
    """Token ids of one continuation (separator first, as the target computes it natively
    after the chunk at ask time) and how many trailing ids are the answer."""
    sep = fmt.separator_ids()
    if kind == "next":
        ids = fmt.encode(answer)
        return sep + ids, len(ids)
    head = sep + fmt.question_suffix_ids(" ".join(question.split()))
    ans = fmt.encode((" " if not fmt.chat else "") + " ".join(answer.split()))
    return head + ans, len(ans)


@torch.no_grad()
def prefill_kv(loaded: LoadedModel, prefix: list[int], chunk: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Position-free K, V `[L, H, T, D]` of `chunk` prefilled after `prefix` (as at ingest)."""
    ids = torch.tensor([prefix + chunk])
    out = loaded.model(input_ids=ids, cache=full_cache(), use_cache=True)
    pos = torch.arange(len(prefix), len(prefix) + len(chunk))
    return extract_kv(out.cache, loaded.spec, pos)  # [L, H, T, D] each


class _QueryTap:
    """Captures each layer's queries (after q-norm, before RoPE) during a forward."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.handles, self.q = [], {}
        layers = getattr(model, "model", model).layers
        for i, layer in enumerate(layers):
            attn = layer.self_attn
            self.handles.append(attn.q_proj.register_forward_hook(self._hook(i, attn)))

    def _hook(self, i: int, attn: torch.nn.Module) -> Callable[..., None]:
        def fn(_m: Any, _inp: Any, out: torch.Tensor) -> None:
            b, t, _ = out.shape
            q = out.view(b, t, -1, attn.head_dim).transpose(1, 2)  # [B, Hq, T, D]
            if getattr(attn, "q_norm", None) is not None:
                q = attn.q_norm(q)
            self.q[i] = q[0].detach()

        return fn

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _topk_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    logp = F.log_softmax(logits.float(), dim=-1)
    top = logp.topk(k, dim=-1)
    return logp, top.indices.to(torch.int32), top.values


@torch.no_grad()
def build_pairs(
    source: LoadedModel, target: LoadedModel, samples: list[Sample], out_dir: str | Path,
    topk: int = 32, predict: int = 16, progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Write one paired file per sample into `out_dir` (resumable); returns the folder."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sfmt, tfmt = PromptFormat.for_model(source), PromptFormat.for_model(target)
    s_prefix, t_prefix = sfmt.context_prefix_ids(), tfmt.context_prefix_ids()
    # the target's own prefix, position-free (computed natively at ask time too)
    pk, pv = prefill_kv(target, [], t_prefix)
    save_file({"ids": torch.tensor(t_prefix), "k": pk.contiguous(), "v": pv.contiguous()}, str(out / "prefix.safetensors"))
    written = json.loads((out / "index.json").read_text()) if (out / "index.json").is_file() else {}
    index = {
        "source": {"name": source.name, "fingerprint": source.fingerprint},
        "target": {"name": target.name, "fingerprint": target.fingerprint},
        "topk": topk, "samples": max(len(samples), written.get("samples", 0)),
        "created": written.get("created", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())),
    }
    (out / "index.json").write_text(json.dumps(index, indent=1))
    P = len(t_prefix)
    tap = _QueryTap(target.model)
    try:
        for i, sample in enumerate(samples):
            path = out / f"{i:05d}.safetensors"
            if path.exists():
                continue
            text = sample.text  # a stored block covers exactly the chunk text
            s_ids, s_off = token_offsets(source.tokenizer, text)
            t_ids, t_off = token_offsets(target.tokenizer, text)
            sk, sv = prefill_kv(source, s_prefix, s_ids.tolist())
            tk, tv = prefill_kv(target, t_prefix, t_ids.tolist())
            T = t_ids.numel()
            rec: dict[str, torch.Tensor] = {
                "src_k": sk.half(), "src_v": sv.half(), "src_off": s_off,
                "tgt_ids": t_ids, "tgt_off": t_off, "tgt_k": tk.half(), "tgt_v": tv.half(),
            }
            kinds = []
            for j, cont in enumerate(sample.conts):
                c_ids, n_ans = continuation_ids(tfmt, cont.kind, cont.question, cont.answer)
                if len(c_ids) < 2 or n_ans < 1:
                    continue
                C = len(c_ids)
                # predictions kept: the last `predict` tokens (answer + the question's end)
                keep = torch.arange(max(0, C - 1 - max(predict, n_ans)), C - 1)  # prediction i -> ids[i+1]
                cache = build_cache(target.config, target.spec, torch.cat([pk, tk], 2), torch.cat([pv, tv], 2),
                                    torch.arange(P + T))
                tap.q.clear()
                logits = target.model(input_ids=torch.tensor([c_ids]), cache=cache, logits_to_keep=keep).logits[0]
                q_pos = torch.arange(P + T, P + T + C)[keep]
                qs = torch.stack([rotate(tap.q[l][:, keep], q_pos, target.spec.rope[l]) for l in range(len(tap.q))])
                none_logits = target.model(input_ids=torch.tensor([t_prefix + c_ids]), logits_to_keep=keep + P).logits[0]
                logp, topi, topv = _topk_logprobs(logits, topk)
                logp_none = F.log_softmax(none_logits.float(), dim=-1)
                nxt = torch.tensor(c_ids)[keep + 1]
                w = (logp.exp() * (logp - logp_none)).sum(-1).clamp(min=0)  # KL(native || none)
                ans = keep >= C - 1 - n_ans
                n = len(kinds)
                rec.update({
                    f"c{n}_ids": torch.tensor(c_ids), f"c{n}_pos": keep, f"c{n}_ans": ans,
                    f"c{n}_topi": topi, f"c{n}_topv": topv,
                    f"c{n}_ll_nat": logp.gather(1, nxt[:, None])[:, 0],
                    f"c{n}_ll_none": logp_none.gather(1, nxt[:, None])[:, 0],
                    f"c{n}_w": w, f"c{n}_q": qs.half().contiguous(),
                })
                kinds.append(cont.kind)
            meta = {"text": text, "kinds": json.dumps(kinds), "source": sample.source}
            tmp = path.with_suffix(".tmp")
            save_file({k: v.contiguous() for k, v in rec.items()}, str(tmp), metadata=meta)
            tmp.rename(path)
            if progress:
                progress(i + 1, len(samples))
    finally:
        tap.close()
    return out


class PairSet:
    """Read access to a folder written by `build_pairs`."""

    def __init__(self, folder: str | Path, indices: Iterable[int] | None = None) -> None:
        from safetensors.torch import load_file

        self.folder = Path(folder)
        self.index = json.loads((self.folder / "index.json").read_text())
        pre = load_file(str(self.folder / "prefix.safetensors"))
        self.prefix_ids, self.prefix_k, self.prefix_v = pre["ids"], pre["k"], pre["v"]
        files = sorted(self.folder.glob("[0-9]*.safetensors"))
        self.files = files if indices is None else [files[i] for i in indices if i < len(files)]

    def __len__(self) -> int:
        return len(self.files)

    def subset(self, indices: list[int]) -> PairSet:
        other = object.__new__(PairSet)
        other.__dict__.update(self.__dict__)
        other.files = [self.files[i] for i in indices]
        return other

    def __getitem__(self, i: int) -> dict[str, Any]:
        from safetensors import safe_open
        from safetensors.torch import load_file

        rec: dict[str, Any] = dict(load_file(str(self.files[i])))
        with safe_open(str(self.files[i]), "pt") as f:
            meta = f.metadata() or {}
        rec["kinds"] = json.loads(meta.get("kinds", "[]"))
        rec["text"] = meta.get("text", "")
        rec["source"] = meta.get("source", "")
        return rec
