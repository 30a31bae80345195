"""The per-token difficulty table: the error it averages, its fit over pairs, its file, and
the translator property that reads it back."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from translate_fixtures import CORPUS, tiny_model  # noqa: E402

from cagkv.errors import TranslatorError  # noqa: E402
from cagkv.refresh import PEAK_Z  # noqa: E402
from cagkv.translate.corpus import Continuation, Sample  # noqa: E402
from cagkv.translate.difficulty import (  # noqa: E402
    DIFFICULTY_FILE,
    PRIOR_COUNT,
    card_record,
    fit_difficulty,
    load_difficulty,
    save_difficulty,
    token_errors,
)
from cagkv.translate.pairs import PairSet, build_pairs  # noqa: E402
from cagkv.translate.train import Trainer, TrainConfig  # noqa: E402


@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory) -> Trainer:
    src, tgt = tiny_model("llama", 4), tiny_model("gemma3", 6)
    samples = [Sample(text, [Continuation("next", "", CORPUS[(i + 1) % 5])]) for i, text in enumerate(CORPUS[:4])]
    folder = tmp_path_factory.mktemp("pairs")
    build_pairs(src, tgt, samples, folder, topk=8, predict=5)
    pairs = PairSet(folder)
    torch.manual_seed(0)
    cfg = TrainConfig(d_model=24, d_expert=32, experts=2, top_k=1, group_size=2, batch=2, log_every=1000, seed=0,
                      skip_rank=0, init="random")
    tr = Trainer(src, tgt, pairs, pairs, cfg)
    tr.fit_stats()
    return tr


def test_token_errors_weigh_every_layer_alike_and_skip_padding() -> None:
    g = torch.Generator().manual_seed(0)
    native_k, native_v = torch.randn(2, 3, 2, 5, 4, generator=g), torch.randn(2, 3, 2, 5, 4, generator=g)
    mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    assert torch.equal(token_errors(native_k, native_v, native_k, native_v, mask), torch.zeros(2, 5))

    keys = native_k.clone()
    keys[0, 1, :, 2] += 1.0  # one token's key in one layer
    err = token_errors(keys, native_v, native_k, native_v, mask)
    assert err[0, 2] > 0 and int((err != 0).sum()) == 1
    # scaling one layer (native and translated alike) does not change its share of the error
    scale = torch.ones(1, 3, 1, 1, 1)
    scale[:, 1] = 10.0
    torch.testing.assert_close(token_errors(keys * scale, native_v, native_k * scale, native_v, mask), err)
    # padded positions carry nothing, whatever sits there
    keys[1, :, :, 3:] += 5.0
    assert torch.equal(token_errors(keys, native_v, native_k, native_v, mask)[1], torch.zeros(5))


def _counted_by_hand(trainer: Trainer) -> tuple[torch.Tensor, torch.Tensor]:
    vocab = trainer.target.config.vocab_size
    total, count = torch.zeros(vocab, dtype=torch.float64), torch.zeros(vocab, dtype=torch.float64)
    with torch.no_grad():
        for i in range(len(trainer.pairs)):  # the same errors, one chunk at a time
            bt = trainer.batch([trainer.pairs[i]])
            keys, values, _ = trainer.translate_batch(bt)
            err = token_errors(keys, values, trainer.native_keys(bt), trainer.native_keys(bt, "tv"), bt["mask"])[0]
            for token, e in zip(bt["ids"][0, : int(bt["lengths"][0])].tolist(), err.tolist()):
                total[token] += e
                count[token] += 1
    return total, count


def test_fit_averages_each_token_ids_error_shrunk_towards_the_mean(trainer: Trainer) -> None:
    table = fit_difficulty(trainer, trainer.pairs, prior="mean")
    vocab = trainer.target.config.vocab_size
    assert table["difficulty"].shape == table["count"].shape == (vocab,)

    total, count = _counted_by_hand(trainer)
    assert torch.equal(table["count"], count.float())
    mean = total.sum() / count.sum()
    want = ((total + PRIOR_COUNT * mean) / (count + PRIOR_COUNT) / mean).float()
    torch.testing.assert_close(table["difficulty"], want)
    seen = count > 0
    assert torch.all(table["difficulty"][~seen] == 1.0) and bool((table["difficulty"][seen] != 1.0).any())
    # the ids seen most sit furthest from the prior: their own mean dominates
    often = int(count.argmax())
    assert abs(float(table["difficulty"][often]) - float(total[often] / count[often] / mean)) < 0.2


def test_the_singletons_prior_puts_rare_and_unseen_ids_at_the_mean_error_of_ids_seen_once(trainer: Trainer) -> None:
    table = fit_difficulty(trainer, trainer.pairs)  # the default prior
    total, count = _counted_by_hand(trainer)
    once = count == 1
    assert bool(once.any()) and bool((count > 1).any())
    mean, centre = total.sum() / count.sum(), total[once].mean()
    assert abs(float(centre - mean)) > 1e-6  # the two priors differ on this data
    want = ((total + PRIOR_COUNT * centre) / (count + PRIOR_COUNT) / mean).float()
    torch.testing.assert_close(table["difficulty"], want)
    assert torch.allclose(table["difficulty"][count == 0], (centre / mean).float())
    # the same chunks given twice, as two pair sets: every id is counted twice
    doubled = fit_difficulty(trainer, [trainer.pairs, trainer.pairs])
    assert torch.equal(doubled["count"], 2 * table["count"])
    with pytest.raises(TranslatorError, match="prior"):
        fit_difficulty(trainer, trainer.pairs, prior="median")


def test_an_exact_translator_makes_every_token_equally_hard(trainer: Trainer, monkeypatch) -> None:
    def exact(bt, *args, **kwargs):
        return trainer.native_keys(bt), trainer.native_keys(bt, "tv"), None

    monkeypatch.setattr(trainer, "translate_batch", exact)
    table = fit_difficulty(trainer, trainer.pairs)
    assert torch.equal(table["difficulty"], torch.ones(trainer.target.config.vocab_size))


def test_table_round_trips_and_bad_files_are_refused(tmp_path: Path) -> None:
    assert load_difficulty(tmp_path) is None
    table = {"difficulty": torch.tensor([0.5, 1.0, 2.0]), "count": torch.tensor([4.0, 0.0, 1.0])}
    assert save_difficulty(table, tmp_path) == tmp_path / DIFFICULTY_FILE
    assert torch.equal(load_difficulty(tmp_path), table["difficulty"])

    (tmp_path / DIFFICULTY_FILE).write_bytes((tmp_path / DIFFICULTY_FILE).read_bytes()[:20])
    with pytest.raises(TranslatorError, match="unreadable"):
        load_difficulty(tmp_path)
    save_difficulty({"difficulty": torch.tensor([1.0, -1.0])}, tmp_path)
    with pytest.raises(TranslatorError, match="non-negative"):
        load_difficulty(tmp_path)
    save_difficulty({"difficulty": torch.tensor([1.0, float("nan")])}, tmp_path)
    with pytest.raises(TranslatorError, match="finite"):
        load_difficulty(tmp_path)
    save_difficulty({"count": torch.tensor([1.0])}, tmp_path)
    with pytest.raises(TranslatorError, match="unreadable"):
        load_difficulty(tmp_path)


def test_a_refit_card_record_describes_the_new_table_and_keeps_only_the_switch_threshold() -> None:
    table = {"difficulty": torch.tensor([0.5, 1.2, 2.0, 1.2]), "count": torch.tensor([4.0, 0.0, 1.0, 2.0])}
    previous = {"ids_seen": 1, "tokens": 1, "range_seen": [0.9, 1.1], "note": "about the old table",
                "peak_z": 14.44, "peak_z_from": "E77"}
    record = card_record(table, ["/pairs/a", "/pairs/b"], 12, "singletons", previous=previous)
    assert record["ids_seen"] == 3 and record["tokens"] == 7 and record["chunks"] == 12
    assert record["range_seen"] == [0.5, 2.0] and record["pairs_dirs"] == ["/pairs/a", "/pairs/b"]
    assert record["peak_z"] == 14.44 and record["peak_z_from"] == "E77"
    assert "note" not in record and record["file"] == DIFFICULTY_FILE
    assert "peak_z" not in card_record(table, [], 0, "mean")


def test_translator_reads_its_table_beside_the_weights(trainer: Trainer, tmp_path: Path) -> None:
    from cagkv.translate.artifact import load_translator, save_artifact

    card = {"source": {"fingerprint": trainer.source.fingerprint}, "target": {"fingerprint": trainer.target.fingerprint},
            "default_refresh_scoring": "contrast_difficulty"}
    folder = save_artifact(tmp_path / "t", trainer.mot, card, dtype=torch.float32)
    without = load_translator(folder)
    assert without.difficulty is None
    assert without.default_refresh_scoring == "contrast"  # the card's scoring needs the table it lacks
    table = fit_difficulty(trainer, trainer.pairs)
    save_difficulty(table, folder)
    with_table = load_translator(folder)
    torch.testing.assert_close(with_table.difficulty, table["difficulty"])
    assert with_table.default_refresh_scoring == "contrast_difficulty"
    for value in ("loud", None, 3):
        with_table.card["default_refresh_scoring"] = value
        assert with_table.default_refresh_scoring == "contrast"
    # adaptive's switch: the threshold the card's difficulty record names, else the global one
    assert with_table.peak_z == PEAK_Z
    with_table.card["difficulty"] = {"file": "difficulty.safetensors", "peak_z": 17.5}
    assert with_table.peak_z == 17.5
    for value in ("loud", None, -3, 0, float("nan"), float("inf")):
        with_table.card["difficulty"] = {"peak_z": value}
        assert with_table.peak_z == PEAK_Z
    with_table.card["difficulty"] = "not a record"
    assert with_table.peak_z == PEAK_Z
