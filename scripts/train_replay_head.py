"""Train one replay head of an installed translator end to end (docs/EXPERIMENTS.md E9, E18, E27).

    python scripts/train_replay_head.py R MINUTES LR OUT_DIR [PAIRS_DIR]
        [--translator DIR] [--target gemma3-270m] [--threads 2] [--from-expert] [--steps N]

Loads a translator (default: the shipped smollm2-135m -> gemma3-270m one), evaluates the
held-out probe with replay R, trains only that replay head (`Trainer.stage_boundary`: KL of
the frozen target's continuations after replaying its top R layers; the linear path and
the mixture stay as they are) for MINUTES or N steps, whichever ends first, evaluates
again and writes the artifact (int8 linear paths) to OUT_DIR. PAIRS_DIR: the paired
training data of `cagkv train` (default: the staged run's, under $CAGKV_HOME/pairs). `--from-expert`: the head also reads the
expert's hidden state of its layer's group (`MoTConfig.boundary_from_expert`; the new
read-out starts at zero, so the first evaluation equals the plain head's).
"""
import argparse
import json
import os

import torch

from cagkv.models import load
from cagkv.translate import load_translator
from cagkv.translate.artifact import save_artifact
from cagkv.translate.mot import with_expert_fed_heads
from cagkv.translate.pairs import PairSet
from cagkv.translate.runner import train_replay_heads
from cagkv.translate.train import Trainer, TrainConfig

home = os.environ.get("CAGKV_HOME", os.path.expanduser("~/.cache/cagkv"))
ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("replay", type=int)
ap.add_argument("minutes", type=float)
ap.add_argument("lr", type=float)
ap.add_argument("out")
ap.add_argument("pairs", nargs="?", default=f"{home}/pairs/smollm2-135m__gemma3-270m__489ebb693ebf")
ap.add_argument("--translator", default="cagkv/translators/smollm2-135m__gemma3-270m")
ap.add_argument("--source", default="smollm2-135m")
ap.add_argument("--target", default="gemma3-270m")
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--steps", type=int, default=10000, help="step cap (MINUTES is the wall cap)")
ap.add_argument("--from-expert", action="store_true", help="feed the head the expert's hidden state too")
args = ap.parse_args()

torch.set_num_threads(args.threads)
r = args.replay
src, tgt = load(args.source), load(args.target)
tr = load_translator(args.translator, src.fingerprint, tgt.fingerprint)
mot = with_expert_fed_heads(tr.model) if args.from_expert else tr.model
if str(mot.cfg.tgt_layers - r) not in mot.boundary:
    ap.error(f"the translator has no replay head for r = {r} (boundaries {sorted(mot.cfg.boundaries)})")
mot.train()
cfg = TrainConfig(eval_samples=10, e2e_accum=2, kl_positions=16, log_every=10, seed=0,
                  steps_boundary=args.steps, boundary_minutes=args.minutes, lr_e2e=args.lr)
trainer = Trainer(src, tgt, PairSet(args.pairs + "/train"), PairSet(args.pairs + "/heldout"), cfg, mot=mot,
                  log=lambda rec: print(json.dumps(rec), flush=True))
before = trainer.evaluate(replay=r)
print("before", r, before["answer_ll_recovery"], before["continuation_kl"], flush=True)
state: dict = {"stages": []}
after = train_replay_heads(trainer, cfg, state, replays=[r])[str(r)]
print("stage", json.dumps(state["stages"]), flush=True)
print("after", r, after["answer_ll_recovery"], after["continuation_kl"], flush=True)
card = dict(tr.card)
card.setdefault("stages", []).extend(state["stages"])
save_artifact(args.out, mot, card, int8_linear=True)
