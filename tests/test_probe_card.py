"""Probe cards (probes.card): a result cell's probe saved as a Hugging Face-style folder loads back with
identical scores on the store's rows, its README's YAML metadata names what a reader needs, and a tampered
weight file (or README) is refused in one line."""
from __future__ import annotations

import json
from functools import partial

import numpy as np
import pytest
import yaml

from evaluation.cells import CellError
from toolkit.config import compose_config
from extract.store import ActivationStore
from probes.artifacts import load_probe
from probes.features import TOKEN_KINDS
from probes.pipeline import train_probes
from tests.helpers import make_synthetic_store

CASES = [("linear", "true_vs_all", []), ("mean_diff", "multiclass", []), ("samil", "true_vs_false", ["probe.C=100"])]


@pytest.fixture(scope="module")
def cards(tmp_path_factory):
    root = tmp_path_factory.mktemp("cards")
    store = ActivationStore(make_synthetic_store(root / "activations", n_real=400, n_neither=200))
    run = partial(compose_config, "train_probe", "model.name=synthetic", f"store_dir={root / 'activations'}",
                  f"results_dir={root / 'results'}", "n_boot=20", "layer=1")
    out = []
    for probe, task, extra in CASES:
        cell = train_probes(run(f"probe={probe}", f"task={task}", *extra))[0]
        out.append((cell, load_probe(cell).save_card(root / f"card-{probe}-{task}", store=store)))
    return store, out


def _inputs(store, probe):
    kinds = TOKEN_KINDS[probe.tokens]
    return store.bags(probe.layer, kinds) if probe.representation == "bags" else store.last_token(probe.layer, kinds)


def test_a_card_loads_back_with_the_same_scores(cards):
    store, pairs = cards
    for cell, card in pairs:
        assert sorted(p.name for p in card.iterdir()) == ["README.md", "config.json", "model.safetensors"]
        original, loaded = load_probe(cell), load_probe(card)
        X = _inputs(store, original)
        np.testing.assert_array_equal(loaded.decision_function(X), original.decision_function(X))
        np.testing.assert_array_equal(loaded.predict_proba(X), original.predict_proba(X))
        np.testing.assert_array_equal(loaded.predict_set(X), original.predict_set(X))


def test_the_readme_metadata_names_model_layer_task_datapack_metrics_and_commit(cards):
    store, pairs = cards
    cell_file, card = pairs[0]
    text = (card / "README.md").read_text()
    meta = yaml.safe_load(text.split("---")[1])
    cell = json.loads(cell_file.read_text())
    assert meta["model_fingerprint"] == cell["store"]["model_fingerprint"] and meta["layer"] == 1
    assert meta["task"] == "true_vs_all" and meta["target_coding"] == {"1": "true", "0": "rest"}
    assert meta["datapack"] == "city_locations" and len(meta["datapack_statements_sha256"]) == 64
    assert meta["metrics"]["mcc"] == cell["metrics"]["mcc"] and meta["metrics"]["mcc_ci"] == cell["metrics"]["mcc_ci"]
    assert meta["conformal"]["thresholds"] == cell["conformal"]["thresholds"]
    assert meta["git_commit"] == cell["provenance"]["git_commit"] and "abstention" in text


@pytest.mark.parametrize("name", ["model.safetensors", "README.md"])
def test_a_tampered_card_is_refused_in_one_line(cards, tmp_path, name):
    import shutil

    _, pairs = cards
    card = tmp_path / "card"
    shutil.copytree(pairs[0][1], card)
    data = bytearray((card / name).read_bytes())
    data[-3] ^= 0xFF
    (card / name).write_bytes(bytes(data))
    with pytest.raises(CellError, match="does not match the sha256") as err:
        load_probe(card)
    assert "\n" not in str(err.value)


def test_a_card_is_written_whole_and_an_existing_folder_is_kept(cards, tmp_path):
    _, pairs = cards
    probe = load_probe(pairs[0][0])
    (tmp_path / "taken").mkdir()
    with pytest.raises(CellError, match="exists"):
        probe.save_card(tmp_path / "taken")
    assert list((tmp_path / "taken").iterdir()) == []
    probe.save_card(tmp_path / "taken", overwrite=True)
    assert load_probe(tmp_path / "taken").layer == 1 and not list(tmp_path.glob(".taken.staging-*"))
