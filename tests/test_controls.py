"""The controls that could explain a probe's signal away (probes.controls): the text alone finds a planted
lexical cue and nothing where only the activations carry the label; shuffled training labels give a probe
nothing to learn; a cell whose AUROC interval covers 0.5 is flagged no_signal."""
from __future__ import annotations

import json

import numpy as np
import pytest

from evaluation.cell_metrics import auroc_interval, no_signal
from experiments.tables import cell_flag
from extract.statements import load_statements
from probes.pipeline import train_probes
from tests.helpers import make_synthetic_store, probe_config, run_cfg


def _random_label_csv(path, n: int = 1200, cue: str | None = None, seed: int = 3):
    """The first `n` real city statements with labels 0/1 drawn at random (so the text says nothing about them);
    with `cue`, every label-1 statement starts with it. Returns (csv path, table as load_statements reads it)."""
    table = load_statements("city_locations").iloc[:n].copy()
    table["label"] = np.random.default_rng(seed).integers(0, 2, size=n)
    if cue is not None:
        table.loc[table["label"] == 1, "statement"] = cue + " " + table.loc[table["label"] == 1, "statement"]
    table[["statement", "label", "object_1", "object_2", "negation"]].to_csv(path, index=False)
    return path


def _cell(paths) -> dict:
    return json.loads(paths[0].read_text())


def _csv_cfg(tmp_path, csv, name: str, *overrides: str):
    return probe_config("model.name=synthetic", "data=csv", f"data.path={csv}", f"data.name={name}",
                        "data.label_column=label", f"store_dir={tmp_path / 'activations'}",
                        f"results_dir={tmp_path / 'results'}", "n_boot=200", "task=true_vs_false", *overrides)


def test_text_control_finds_a_lexical_cue(tmp_path):
    """Labels carried by one word of the text: TF-IDF + logistic regression on the text alone, no store, finds
    them; the cell says what it read and sits under linear+text at layer none."""
    csv = _random_label_csv(tmp_path / "cue.csv", cue="Reportedly,")
    paths = train_probes(_csv_cfg(tmp_path, csv, "cue", "probe=linear", "features=text"))
    cell = _cell(paths)
    assert "linear+text" in str(paths[0]) and cell["layer"] is None
    assert cell["method"]["features"] == "text" and cell["store"]["features"] == "text"
    assert cell["metrics"]["mcc_all"] > 0.95 and cell["metrics"]["auroc"] > 0.99
    assert "no_signal" not in cell_flag(cell)


def test_text_control_ignores_an_activation_only_cue(tmp_path):
    """Labels random with respect to the text but planted in the activations: the activation probe finds them,
    the text control does not (and its cell is flagged no_signal)."""
    csv = _random_label_csv(tmp_path / "plain.csv")
    make_synthetic_store(tmp_path / "activations", table=load_statements("plain", path=str(csv), label_column="label"),
                         datapack="plain")
    probe = _cell(train_probes(_csv_cfg(tmp_path, csv, "plain", "probe=linear", "layer=[1]")))
    text = _cell(train_probes(_csv_cfg(tmp_path, csv, "plain", "probe=linear", "features=text")))
    assert probe["test"]["rows"] == text["test"]["rows"]          # the same split, the same test rows
    assert probe["metrics"]["mcc_all"] > 0.9
    assert abs(text["metrics"]["mcc_all"]) < 0.2
    assert "no_signal" in cell_flag(text) and "no_signal" not in cell_flag(probe)


def test_shuffled_labels_give_a_probe_nothing(tmp_path):
    """A strong planted direction: the probe finds it (MCC > 0.9); refitted on permuted training labels (five
    permutations) it learns a random direction, whose test MCC scatters around 0 (a random direction still leans
    on the planted axes, so one permutation's |MCC| can exceed a chance draw's): the null floor, the mean over the
    permutations, is within 0.1 of 0 and no permutation reaches 0.2. Cells under linear+shuffled, same test rows."""
    make_synthetic_store(tmp_path / "activations", n_real=2000, n_neither=400, dim=256)
    base = ("probe=linear", "task=true_vs_false", "layer=[1]")
    real = _cell(train_probes(run_cfg(tmp_path, *base)))
    assert real["metrics"]["mcc_all"] > 0.9
    floor = []
    for seed in range(5):
        paths = train_probes(run_cfg(tmp_path, *base, "shuffle_labels=true", f"seed={seed}"))
        cell = _cell(paths)
        assert "linear+shuffled" in str(paths[0]) and cell["method"]["shuffle_labels"] is True
        assert cell["test"]["rows"] == real["test"]["rows"] and cell["test"]["y"] == real["test"]["y"]
        floor.append(cell["metrics"]["mcc_all"])
    assert abs(np.mean(floor)) < 0.1 and max(map(abs, floor)) < 0.2, floor


def test_auroc_interval_and_no_signal():
    """The interval is the percentile interval of the AUROC of explicitly resampled rows; chance scores cover 0.5
    (no signal), informative ones do not."""
    from evaluation.cell_metrics import raw_auroc
    from evaluation.selective import cluster_bootstrap_indices

    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 400)
    groups = rng.integers(0, 120, 400)
    chance, informative = rng.standard_normal((400, 1)), (y + rng.standard_normal(400))[:, None]
    for scores in (chance, informative):
        draws = [raw_auroc(y[r], scores[r]) for r in cluster_bootstrap_indices(groups, 300, np.random.default_rng(4))]
        assert auroc_interval(y, scores, groups, 300, 4) == pytest.approx(np.percentile(draws, [2.5, 97.5]))
    assert no_signal(auroc_interval(y, chance, groups, 300, 4))
    assert not no_signal(auroc_interval(y, informative, groups, 300, 4))
    y3 = rng.integers(0, 3, 400)
    probs = rng.dirichlet([1, 1, 1], 400)
    draws = [raw_auroc(y3[r], probs[r]) for r in cluster_bootstrap_indices(None, 200, np.random.default_rng(1), n=400)]
    assert auroc_interval(y3, probs, None, 200, 1) == pytest.approx(np.percentile(draws, [2.5, 97.5]))


def test_controls_refuse_what_they_cannot_do(tmp_path):
    """One line each: a bag-reading probe on statement-level control features, an unknown feature kind."""
    from probes.base import ProbeError

    with pytest.raises(ProbeError, match="features=text gives one vector per statement"):
        train_probes(run_cfg(tmp_path, "probe=samil", "features=text"))
    with pytest.raises(Exception, match="features"):
        train_probes(run_cfg(tmp_path, "probe=linear", "features=pixels"))


def test_surprisal_control_equals_a_plain_forward(tmp_path):
    """features=surprisal: the mean and max NLL of each statement's tokens after the BOS equal a plain forward
    of the tiny model, one statement at a time; computed once (a rerun reads the saved values) and fitted like
    any statement vector."""
    import torch

    from extract.models import load_model
    from tests.helpers import extract_config

    csv = _random_label_csv(tmp_path / "s.csv", n=300)
    cfg = probe_config("model=tiny", "data=csv", f"data.path={csv}", "data.name=surp", "data.label_column=label",
                       f"results_dir={tmp_path / 'results'}", f"store_dir={tmp_path / 'activations'}", "n_boot=50",
                       "task=true_vs_false", "probe=linear", "features=surprisal")
    cell = _cell(train_probes(cfg))
    assert cell["method"]["features"] == "surprisal" and cell["store"]["hidden_size"] == 2
    saved = tmp_path / "results" / "tiny" / "surp" / "surprisal" / "surprisal.npy"
    values, stamp = np.load(saved), saved.stat().st_mtime_ns
    loaded = load_model(extract_config("model=tiny").model)
    statements = load_statements("surp", path=str(csv), label_column="label")["statement"].tolist()
    with torch.inference_mode():
        for i in (0, 7, 123, 299):
            ids = loaded.tokenizer(statements[i], add_special_tokens=False)["input_ids"]
            x = torch.tensor([[loaded.tokenizer.bos_token_id, *ids]])
            logp = torch.log_softmax(loaded.model(x).logits[0, :-1].double(), -1)
            nll = -logp[torch.arange(len(ids)), torch.tensor(ids)]
            assert values[i] == pytest.approx([float(nll.mean()), float(nll.max())], rel=1e-4, abs=1e-4)
    train_probes(probe_config("model=tiny", "data=csv", f"data.path={csv}", "data.name=surp",
                              "data.label_column=label", f"results_dir={tmp_path / 'results'}", "n_boot=50",
                              "task=true_vs_all", "probe=linear", "features=surprisal"))
    assert saved.stat().st_mtime_ns == stamp                       # read, not recomputed
