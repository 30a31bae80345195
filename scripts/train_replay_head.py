"""Train one replay head of an installed translator end to end (docs/EXPERIMENTS.md E9).

    python scripts/train_replay_head.py R MINUTES LR OUT_DIR [PAIRS_DIR]

Loads the shipped smollm2-135m -> gemma3-270m translator, evaluates the held-out probe
with replay R, trains only that replay head (`Trainer.stage_boundary`: KL of the frozen
target's continuations after replaying its top R layers) for MINUTES, evaluates again
and writes the artifact (int8 linear paths) to OUT_DIR. PAIRS_DIR: the paired training
data of `cagkv train` (default: the staged run's, under $CAGKV_HOME/pairs).
"""
import json
import os
import sys

import torch

from cagkv.models import load
from cagkv.translate import load_translator
from cagkv.translate.artifact import save_artifact
from cagkv.translate.pairs import PairSet
from cagkv.translate.runner import train_replay_heads
from cagkv.translate.train import Trainer, TrainConfig

torch.set_num_threads(2)
home = os.environ.get("CAGKV_HOME", os.path.expanduser("~/.cache/cagkv"))
r, minutes, lr, out = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
base = sys.argv[5] if len(sys.argv) > 5 else f"{home}/pairs/smollm2-135m__gemma3-270m__489ebb693ebf"
src, tgt = load("smollm2-135m"), load("gemma3-270m")
tr = load_translator("cagkv/translators/smollm2-135m__gemma3-270m", src.fingerprint, tgt.fingerprint)
mot = tr.model
mot.train()
cfg = TrainConfig(eval_samples=10, e2e_accum=2, kl_positions=16, log_every=10, seed=0,
                  steps_boundary=10000, boundary_minutes=minutes, lr_e2e=lr)
trainer = Trainer(src, tgt, PairSet(base + "/train"), PairSet(base + "/heldout"), cfg, mot=mot,
                  log=lambda rec: print(json.dumps(rec), flush=True))
before = trainer.evaluate(replay=r)
print("before", r, before["answer_ll_recovery"], before["continuation_kl"], flush=True)
state: dict = {"stages": []}
after = train_replay_heads(trainer, cfg, state, replays=[r])[str(r)]
print("stage", json.dumps(state["stages"]), flush=True)
print("after", r, after["answer_ll_recovery"], after["continuation_kl"], flush=True)
save_artifact(out, mot, dict(tr.card), int8_linear=True)
