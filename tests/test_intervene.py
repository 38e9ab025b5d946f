"""`python -m intervene` on the tiny model: alpha 0 is the zero-shot scorer bit for bit; a steered pass equals a
hand-written hooked forward; a planted readout direction moves the answer and random directions do not; a killed
run resumes to the same numbers; bad options are one line and write nothing."""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load, save

import intervene.run as iv
from toolkit.config import compose_config
from extract.models import decoder_layers, load_model
from extract.run import extract
from extract.scorer import score
from extract.store import ActivationStore, store_path
from intervene.run import effects, readout_values, run, steered_runs, zero_shot_items
from intervene.steer import SteeredOptions, Steering
from probes.pipeline import train_probes
from tests.helpers import assert_one_error_line, run_module, whole_cities_csv
from zero_shot.scoring import PromptScorer, option_matrix


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    """A tiny-model store of 30 real and 8 synthetic cities (layers 0 and 2), linear and mlp true_vs_false cells at
    layer 2, the loaded model."""
    root = tmp_path_factory.mktemp("intervene")
    whole_cities_csv(root / "c.csv", 30, 8)
    dirs = [f"store_dir={root / 'activations'}", f"results_dir={root / 'results'}"]
    extract(compose_config("extract", "model=tiny", "data=csv", f"data.path={root / 'c.csv'}",
                           "data.name=city_locations", "layers=[0,2]", dirs[0]))
    cells = {p: train_probes(compose_config("train_probe", "model=tiny", "data=city_locations", f"probe={p}",
                                            "layer=2", "task=true_vs_false", "trainer.accelerator=cpu", "n_boot=20",
                                            *dirs))[0] for p in ("linear", "mlp")}
    loaded = load_model(compose_config("extract", "model=tiny").model)
    return {"root": root, "dirs": dirs, "cells": cells, "loaded": loaded}


def _cfg(tiny, *overrides):
    return compose_config("intervene", "model=tiny", "data=city_locations", f"cell='{tiny['cells']['linear']}'",
                          "n_boot=50", *tiny["dirs"], *overrides)


def _prompts(tiny, n=6):
    store = ActivationStore(store_path(tiny["root"] / "activations", "tiny", "city_locations"))
    return zero_shot_items(tiny["loaded"], store.table, np.arange(n), "statement", "default")


def test_alpha_zero_is_the_zero_shot_scorer_bit_for_bit(tiny):
    loaded = tiny["loaded"]
    seqs, positions, option_ids = _prompts(tiny)
    prompt = PromptScorer(loaded.model, option_ids, loaded.device)
    plain = score(loaded, seqs, prompt, 4).results
    with Steering(loaded.model, 2) as steering:                        # the hook is in place, nothing added
        steered = score(loaded, seqs, SteeredOptions(prompt, steering, seqs, positions, None), 4).results
        zero = score(loaded, seqs, SteeredOptions(prompt, steering, seqs, positions,
                                                  torch.zeros(loaded.hidden_size)), 4).results
    assert np.array_equal(plain, steered)
    np.testing.assert_allclose(zero, plain, rtol=0, atol=1e-6)        # another prefix split: float rounding only


def _hooked_check(loaded, statements: list[str], layer: int, size: float) -> None:
    """Steered option probabilities (the scorer, batches of 4, shared prefix) == a plain forward of each whole
    prompt with a hand-written hook adding delta at the statement's tokens; and the push moved them."""
    table = pd.DataFrame({"statement": statements})
    seqs, positions, option_ids = zero_shot_items(loaded, table, np.arange(len(statements)), "statement", "default")
    delta = torch.randn(loaded.hidden_size, generator=torch.Generator().manual_seed(1)) * size
    prompt = PromptScorer(loaded.model, option_ids, loaded.device)
    with Steering(loaded.model, layer) as steering:
        steered = score(loaded, seqs, SteeredOptions(prompt, steering, seqs, positions, delta), 4).results
    reduce = option_matrix(option_ids, loaded.model.get_output_embeddings().weight.shape[0])
    blocks, expected = decoder_layers(loaded.model), []
    for ids, at in zip(seqs, positions):
        def add(hidden, at=at):
            hidden = hidden.clone()
            hidden[0, torch.as_tensor(at)] += delta
            return hidden
        handle = (blocks[0].register_forward_pre_hook(lambda m, a, k: ((add(a[0]), *a[1:]), k) if a else
                                                      (a, {**k, "hidden_states": add(k["hidden_states"])}),
                                                      with_kwargs=True) if layer == 0 else
                  blocks[layer - 1].register_forward_hook(lambda m, a, o: (add(o[0]), *o[1:]) if isinstance(o, tuple)
                                                          else add(o)))
        try:
            with torch.inference_mode():
                logits = loaded.model(input_ids=torch.from_numpy(ids)[None]).logits[0, -1]
        finally:
            handle.remove()
        expected.append((torch.softmax(logits.float(), -1) @ reduce).numpy())
    expected = np.stack(expected)
    plain = score(loaded, seqs, prompt, 4).results
    np.testing.assert_allclose(steered, expected, rtol=1e-3, atol=1e-6)            # float32: batched vs one by one
    assert np.abs(steered - plain).max() > 20 * np.abs(steered - expected).max()   # the push did something


@pytest.mark.parametrize("layer", [0, 2, 3])   # (at the last layer, 4, statement tokens no longer reach the answer)
def test_a_steered_pass_equals_a_hooked_forward(tiny, layer):
    store = ActivationStore(store_path(tiny["root"] / "activations", "tiny", "city_locations"))
    _hooked_check(tiny["loaded"], store.table["statement"].tolist()[:6], layer, 30.0)


@pytest.mark.slow
def test_a_steered_smollm2_pass_equals_a_hooked_forward():
    loaded = load_model(compose_config("extract", "model=smollm2").model)
    _hooked_check(loaded, ["The city of Paris is located in France.", "The city of Lyon is located in Chile.",
                           "The city of Qerbu is located in Zantia.", "Aspirin is indicated for the treatment of pain.",
                           "The city of Oslo is not located in Norway."], 12, 4.0)


def test_a_planted_readout_direction_moves_the_answer_and_random_ones_do_not(tiny, tmp_path):
    """The last layer's output feeds the LM head through the final RMSNorm: the head's rows of the "true" option
    made +4 v / g, the "false" option's -4 v / g, so the true-vs-false log-odds read the hidden state along v."""
    loaded = load_model(compose_config("extract", "model=tiny").model)
    model, d = loaded.model, loaded.hidden_size
    seqs, _, option_ids = _prompts(tiny, 12)
    positions = [np.array([len(x) - 1]) for x in seqs]     # the last layer: only the answer's position reaches it
    v = torch.randn(d, generator=torch.Generator().manual_seed(3))
    v /= v.norm()
    gain = model.model.norm.weight.detach()
    head = model.get_output_embeddings()
    head.weight = torch.nn.Parameter(head.weight.detach().clone())
    with torch.no_grad():
        head.weight[option_ids[0]] = 4 * v / gain
        head.weight[option_ids[1]] = -4 * v / gain
    rng = np.random.default_rng(0)
    randoms = {f"random_{j}": (lambda r: r / np.linalg.norm(r))(rng.standard_normal(d)) for j in range(6)}
    cfg = OmegaConf.create({"alphas": [-4.0, 0.0, 4.0], "batch_size": 4, "overwrite": False})
    prompt = PromptScorer(model, option_ids, loaded.device)

    def make(steering, delta):
        return SteeredOptions(prompt, steering, seqs, positions, delta)

    groups = np.arange(len(seqs)) // 2
    results = {}
    for name, probe in (("planted", v.double().numpy()), ("random", randoms.pop("random_5"))):
        units = {"probe": probe, **randoms}
        raw = steered_runs(cfg, loaded, 4, units, 1.0, "zero_shot", seqs, positions, make,
                           tmp_path / f"{name}.npz", name)
        values = np.stack([np.stack([readout_values("zero_shot", raw[j, a], "true_vs_false") for a in range(3)], 1)
                           for j in range(len(units))], 1)
        results[name] = effects(values, list(units), [-4.0, 0.0, 4.0], groups, 200, 0)
    planted, random = results["planted"], results["random"]
    assert planted["verdict"] == "moves the answer toward the probe's class beyond random directions", planted
    assert planted["effect"]["probe"][2] > 1.0 and planted["effect"]["probe"][0] < -1.0
    assert planted["outside_random_band"] == [True, False, True]
    assert random["verdict"] == "no effect beyond random directions", random


def test_the_command_writes_resumes_and_matches_an_uninterrupted_run(tiny, monkeypatch):
    options = ("n_random=2", "alphas=[-2,0,2]", "n_statements=12", "batch_size=4")
    whole = run(_cfg(tiny, *options, f"results_dir={tiny['root'] / 'whole'}"))
    record = json.loads(whole.read_text())
    assert record["directions"] == ["probe", "probe_orthogonal", "random_0", "random_1"]
    assert record["provenance"]["command"] and record["readouts"]["zero_shot"]["n_items"] <= 12
    assert set(record["readouts"]) == {"zero_shot", "likelihood"}

    calls = {"n": 0}
    real_score = iv.score

    def dying(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt
        return real_score(*args, **kwargs)

    monkeypatch.setattr(iv, "score", dying)
    out = tiny["root"] / "killed"
    with pytest.raises(KeyboardInterrupt):
        run(_cfg(tiny, *options, f"results_dir={out}"))
    assert list(out.glob("**/*.partial.npz")) and not list(out.glob("**/seed=0.json"))
    monkeypatch.setattr(iv, "score", real_score)
    resumed = json.loads(run(_cfg(tiny, *options, f"results_dir={out}")).read_text())
    for kind in record["readouts"]:
        assert resumed["readouts"][kind] == record["readouts"][kind]
    assert not list(out.glob("**/*.partial.npz"))


@pytest.mark.parametrize("option, needle", [
    ("model=smollm2", "is a cell of model 'tiny'"),
    ("alphas=[-4,4]", "alphas=[-4.0, 4.0]"),
    ("mlp", "has no single direction"),
    ("layer", "layer 3 is not in"),
    ("readouts=[votes]", "readouts=['votes']"),
])
def test_bad_options_are_one_line_and_write_nothing(tiny, tmp_path, option, needle):
    results = tmp_path / "results"
    if option == "mlp":
        args = [f"cell='{tiny['cells']['mlp']}'"]
    elif option == "layer":
        linear = Path(tiny["cells"]["linear"])
        folder = tmp_path / "cells" / "layer=3"
        shutil.copytree(linear.parent, folder)
        cell = json.loads((folder / linear.name).read_text())
        heads = folder / cell["heads"]["file"]    # a cell fitted at layer 3 (its heads say so too), which the store lacks
        data = save(load(heads.read_bytes()), metadata={"layer": "3"})
        heads.write_bytes(data)
        cell["heads"] = {**cell["heads"], "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
        (folder / linear.name).write_text(json.dumps({**cell, "layer": 3}))
        args = [f"cell='{folder / linear.name}'"]
    else:
        args = [option]
    result = run_module("intervene", "model=tiny", "data=city_locations", f"cell='{tiny['cells']['linear']}'",
                        *tiny["dirs"][:1], f"results_dir={results}", *args, cwd=tmp_path)
    assert_one_error_line(result, needle)
    assert not results.exists() or not list(results.glob("**/*"))


def test_the_page_command_writes_and_rewrites_its_page(tiny, tmp_path):
    args = ["models=[tiny]", "datapacks=[city_locations]", "probes=[linear,mlp]", "tasks=[true_vs_false]",
            "n_statements=8", "n_random=2", "alphas=[-2,0,2]", "n_boot=50", *tiny["dirs"]]
    first = run_module("experiments.interventions", *args, f"out_dir={tmp_path / 'page1'}", cwd=tmp_path)
    assert first.returncode == 1 and "has no single direction" in first.stderr    # mlp: the step's one line
    args[2] = "probes=[linear]"
    first = run_module("experiments.interventions", *args, f"out_dir={tmp_path / 'page1'}", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    again = run_module("experiments.interventions", *args, "run=false", f"out_dir={tmp_path / 'page2'}", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    one, two = ((tmp_path / p / "index.md").read_text().splitlines() for p in ("page1", "page2"))
    changed = [i for i, (a, b) in enumerate(zip(one, two)) if a != b]
    assert len(one) == len(two) and all(one[i].startswith("> Generated by") for i in changed)   # the stamp only
    assert sum(line.startswith("> Generated by") for line in one) == 1
    assert (tmp_path / "page1" / "interventions.csv").read_bytes() == (tmp_path / "page2" / "interventions.csv").read_bytes()
    assert (tmp_path / "page1" / "dose_tiny_zero_shot.png").exists()
    assert "| tiny | city_locations | linear | true_vs_false | 2 |" in "\n".join(one)


def test_samil_direction_is_its_token_score_in_raw_coordinates():
    """SAwMILProbe.coef_ / intercept_ (what intervene pushes along): a bag's score = max over its tokens of
    x . coef_ + intercept_, on raw (unstandardised) tokens; the direction is near the planted one."""
    from probes.samil.probe import SAwMILProbe
    from probes.samil.synthetic import make_planted_bags

    X, offsets, y, _, u = make_planted_bags(n_bags=120, dim=16, seed=0)
    X = X * 3.0 + 5.0                                          # raw coordinates far from standardised ones
    probe = SAwMILProbe(C=10.0, accelerator="cpu").fit((X, offsets), y)
    tokens = X.astype(np.float64) @ probe.coef_ + probe.intercept_
    bags = np.array([tokens[a:b].max() for a, b in zip(offsets[:-1], offsets[1:])])
    np.testing.assert_allclose(probe.decision_function((X, offsets)), bags, rtol=1e-5, atol=1e-5)
    cosine = probe.coef_ @ u / np.linalg.norm(probe.coef_)
    assert cosine > 0.8, cosine
