"""Cross-model claims report: two toy models with different depths, real train_probe cells on synthetic
stores; relative depths and quarters, probes swept at fewer than all stored layers kept out of the depth
claim, the neither shares against a direct count, Holm families and verdicts against their p-values,
health flags, figures, and the entry point's one-line error."""
from __future__ import annotations

import json
import subprocess
import sys
from functools import partial
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from experiments.claims_neither import FEATURE_CONTROLS
from experiments.cross_model import depth_quarter, depth_summary, verdict
from evaluation.selective import holm
from toolkit.config import compose_config
from probes.pipeline import train_probes
from tests.helpers import make_depth_store

ROOT = Path(__file__).resolve().parent.parent
# model: (stored layers, n_layers, layer of the strongest signal, probes)
MODELS = {"toy-a": ([0, 2, 4, 6, 8], 8, 6, ("mean_diff", "samil")),
          "toy-b": ([0, 2, 4, 6], 6, 2, ("mean_diff",))}
TASKS = "[true_vs_all,false_vs_all,neither_vs_all,multiclass]"
SAMIL_LAYERS = [4, 6]   # samil is swept at 2 of toy-a's 5 stored layers, as the real study fitted it at one


def _cli(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "experiments.cross_model", f"results_dir={root / 'results'}",
                           f"reports_dir={root / 'reports'}", f"hydra.run.dir={root / 'logs'}", *args],
                          cwd=ROOT, capture_output=True, text=True, check=False)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    root = tmp_path_factory.mktemp("cross_model")
    for model, (layers, n_layers, peak, probes) in MODELS.items():
        make_depth_store(root / "activations", model, layers, n_layers, peak)
        run = partial(compose_config, "train_probe", f"model.name={model}", f"store_dir={root / 'activations'}",
                      f"results_dir={root / 'results'}", "n_boot=50", f"tasks={TASKS}")
        for probe in probes:
            train_probes(run(f"probe={probe}", *(["probe.C=10", f"layer={SAMIL_LAYERS}"] if probe == "samil"
                                                 else ["layer=all"])))
    run_a = partial(compose_config, "train_probe", "model.name=toy-a", f"store_dir={root / 'activations'}",
                    f"results_dir={root / 'results'}", "n_boot=50", f"tasks={TASKS}")
    train_probes(run_a("probe=linear", "features=text"))   # the text control (the store's 300 statements)
    for seed in (0, 1):   # the shuffled-label floor of mean_diff at toy-a's peak layer
        train_probes(run_a("probe=mean_diff", "shuffle_labels=true", f"layer=[{MODELS['toy-a'][2]}]", f"seed={seed}"))
    result = _cli(root, "models=[toy-a,toy-b]", "datapacks=[city_locations,med_indications]", "n_boot=50")
    assert result.returncode == 0, result.stderr[-2000:]
    claims = pd.read_csv(root / "reports" / "cross_model" / "claims.csv")
    return root, claims, result.stderr


def _cells(root: Path, model: str, probe: str, task: str) -> dict[int, dict]:
    folder = root / "results" / model / "city_locations" / probe / task / "entity_disjoint"
    return {int(p.parent.name.split("=")[1]): json.loads(p.read_text()) for p in folder.glob("layer=*/seed=0.json")}


def _flag(cell: dict) -> str:
    from experiments.tables import cell_flag

    return cell_flag(cell)


def _best_calibration_layer(cells: dict[int, dict], layers) -> int:
    """The first of `layers` with the highest calibration MCC (experiments.report.best_layers' rule)."""
    layers = sorted(layers)
    scores = [cells[k]["calibration_metrics"]["mcc_all"] for k in layers]
    return layers[int(np.argmax(scores))]


def test_quarters_on_a_hand_example():
    depths = [0.0, 0.25, 0.2501, 0.5, 0.51, 0.75, 0.76, 1.0]
    assert depth_quarter(depths).tolist() == [1, 1, 2, 2, 3, 3, 4, 4]
    assert depth_quarter(np.array([0, 2, 4, 6, 8]) / 8).tolist() == [1, 1, 2, 3, 4]
    assert depth_quarter(np.array([0, 2, 4, 6]) / 6).tolist() == [1, 2, 3, 4]


def test_files_and_skipped_datapack(report):
    root, _, log = report
    out = root / "reports" / "cross_model"
    for name in ("depth_city_locations.png", "claims.csv", "claims.md"):
        assert (out / name).stat().st_size > 0
    assert not (out / "depth_med_indications.png").exists()
    assert "no cells for toy-b / med_indications" in log
    md = (out / "claims.md").read_text()
    assert all(f"## ({c})" in md for c in "abc") and "| toy-b | city_locations | mean_diff | multiclass |" in md


def test_depth_rows_quarters_and_summary(report):
    root, claims, _ = report
    depth = claims[claims["claim"] == "a"]
    expected = {(m, p, t) for m, (_, _, _, probes) in MODELS.items() for p in probes
                for t in TASKS.strip("[]").split(",")}
    assert set(zip(depth["model"], depth["probe"], depth["task"])) == expected and len(depth) == len(expected)
    for _, r in depth.iterrows():
        layers, n_layers, _, _ = MODELS[r["model"]]
        quarter = dict(zip(layers, depth_quarter(np.array(layers) / n_layers)))
        cells = _cells(root, r["model"], r["probe"], r["task"])
        swept = sorted(cells)
        assert r["n_layers"] == n_layers and r["layer"] == _best_calibration_layer(cells, swept)
        assert r["layers_swept"] == len(swept) and r["n_stored_layers"] == len(layers)
        assert r["full_sweep"] == (swept == layers)
        assert r["depth"] == pytest.approx(r["layer"] / n_layers)
        assert r["quarter"] == quarter[r["layer"]] and r["peak_in_q3"] == (r["quarter"] == 3)
        assert (r["flag"] if isinstance(r["flag"], str) else "") == _flag(cells[r["layer"]])
        for q in range(1, 5):
            in_q = [k for k in swept if quarter[k] == q]
            if not in_q:
                assert np.isnan(r[f"q{q}_layer"])
                continue
            chosen = _best_calibration_layer(cells, in_q)
            assert r[f"q{q}_layer"] == chosen
            assert r[f"q{q}_mcc"] == pytest.approx(cells[chosen]["metrics"]["mcc"])
            assert [r[f"q{q}_mcc_lo"], r[f"q{q}_mcc_hi"]] == pytest.approx(cells[chosen]["metrics"]["mcc_ci"])
        if r["full_sweep"]:
            assert r["q3_vs_rest_mcc_lo"] <= r["q3_vs_rest_mcc"] + 1e-9 <= r["q3_vs_rest_mcc_hi"] + 2e-9
            assert 0 <= r["q3_vs_rest_mcc_p_raw"] <= r["q3_vs_rest_mcc_p_holm"] <= 1
    summary = claims[claims["claim"] == "a_summary"].set_index("model")
    for model, g in depth.groupby("model"):
        # the family: all the model's Q3-vs-rest comparisons (full sweeps only)
        tested = g.dropna(subset=["q3_vs_rest_mcc_p_raw"])
        np.testing.assert_allclose(tested["q3_vs_rest_mcc_p_holm"], holm(tested["q3_vs_rest_mcc_p_raw"].to_numpy()))
        swept = g[g["full_sweep"]]
        assert summary.loc[model, "n_combinations"] == len(swept) and summary.loc[model, "n_tested"] == len(tested)
        assert summary.loc[model, "n_peak_in_q3"] == swept["peak_in_q3"].sum()
        for kind in ("raw", "holm"):
            significant = tested[f"q3_vs_rest_mcc_p_{kind}"] < 0.05
            assert (tested[f"q3_vs_rest_mcc_significant_{kind}"].astype(bool) == significant).all()
            assert summary.loc[model, f"n_q3_better_{kind}"] == (significant & (tested["q3_vs_rest_mcc"] > 0)).sum()
            assert summary.loc[model, f"n_q3_worse_{kind}"] == (significant & (tested["q3_vs_rest_mcc"] < 0)).sum()


def test_a_probe_not_swept_at_every_stored_layer_stays_out_of_the_depth_claim(report):
    """samil (layers 4 and 6 of toy-a's 0-8; its best, 6, is in Q3) is listed but neither counted in Q3 nor
    compared; the summary and claims.md name what was left out."""
    root, claims, _ = report
    samil = claims[(claims["claim"] == "a") & (claims["probe"] == "samil")]
    assert len(samil) == 4 and not samil["full_sweep"].any() and (samil["layers_swept"] == 2).all()
    assert (samil["n_stored_layers"] == 5).all() and samil["q3_vs_rest_mcc_p_raw"].isna().all()
    summary = claims[claims["claim"] == "a_summary"].set_index("model")
    assert summary.loc["toy-a", "n_combinations"] == 4 and summary.loc["toy-a", "n_excluded"] == 4
    assert summary.loc["toy-b", "n_excluded"] == 0
    mean_diff = claims[(claims["claim"] == "a") & (claims["model"] == "toy-a") & (claims["probe"] == "mean_diff")]
    assert summary.loc["toy-a", "n_peak_in_q3"] == mean_diff["peak_in_q3"].sum()
    assert "city_locations / samil / multiclass (2 of 5 layers)" in summary.loc["toy-a", "excluded"]
    md = (root / "reports" / "cross_model" / "claims.md").read_text()
    assert "left out: city_locations / samil" in md and "| not swept |" in md
    # swept at every stored layer, samil counts like any probe
    rows = pd.DataFrame({"model": "m", "datapack": "d", "probe": ["samil", "samil", "linear"], "task": ["t", "u", "t"],
                         "layers_swept": [5, 1, 5], "n_stored_layers": 5, "full_sweep": [True, False, True],
                         "peak_in_q3": True, "q3_vs_rest_mcc": [0.1, 0.2, -0.1],
                         "q3_vs_rest_mcc_p_raw": [0.01, np.nan, 0.2], "q3_vs_rest_mcc_p_holm": [0.02, np.nan, 0.2],
                         "q3_vs_rest_mcc_significant_raw": [True, None, False],
                         "q3_vs_rest_mcc_significant_holm": [True, None, False]})
    (s,) = depth_summary(rows)
    assert (s["n_combinations"], s["n_peak_in_q3"], s["n_tested"], s["n_q3_better_holm"]) == (2, 2, 2, 1)
    assert s["n_excluded"] == 1 and s["excluded"] == "d / samil / u (1 of 5 layers)"


def test_neither_shares_equal_a_direct_count(report):
    root, claims, _ = report
    neither = claims[(claims["claim"] == "b") & ~claims["probe"].isin(FEATURE_CONTROLS)]
    assert len(neither) == sum(len(probes) for *_, probes in MODELS.values())
    for _, r in neither.iterrows():
        cells = _cells(root, r["model"], r["probe"], "multiclass")
        assert r["layer"] == _best_calibration_layer(cells, sorted(cells))
        test = cells[r["layer"]]["test"]
        pred = np.array(test["pred"])[np.array(test["y"]) == 2]
        wrong = np.isin(pred, [0, 1])
        assert r["n_neither"] == pred.size and r["n_abstained"] == np.sum(pred == -1)
        assert r["neither_recall"] == pytest.approx(np.mean(pred == 2))
        assert r["neither_abstained"] == pytest.approx(np.mean(pred == -1))
        if wrong.any():
            assert r["misclassified_as_false"] == pytest.approx(np.mean(pred[wrong] == 0))
            assert r["misclassified_as_true"] == pytest.approx(np.mean(pred[wrong] == 1))
        assert r["neither_recall_lo"] <= r["neither_recall"] <= r["neither_recall_hi"]
        binary = _cells(root, r["model"], r["probe"], "neither_vs_all")
        assert r["neither_vs_all_mcc"] == pytest.approx(binary[r["neither_vs_all_layer"]]["metrics"]["mcc"])


def test_controls_beside_the_claims(report):
    """Claim (b): the text control's rows, each probe against it on the same test rows (compare_cells' mcc_all,
    a direct recall difference), Holm over the whole family, verdicts from the Holm decisions; claim (a): the
    shuffled-label floor is the mean of the permutations' cells at the probe's best layer."""
    from experiments.compare import compare_cells

    root, claims, _ = report
    neither = claims[(claims["claim"] == "b") & (claims["probe"] == "linear+text")]
    assert list(neither["model"]) == ["toy-a"] and neither["layer"].isna().all()
    versus = claims[claims["claim"] == "b_control"]
    assert set(zip(versus["model"], versus["probe"], versus["control"])) == {
        ("toy-a", "mean_diff", "linear+text"), ("toy-a", "samil", "linear+text")}
    control = json.loads((root / "results/toy-a/city_locations/linear+text/neither_vs_all/entity_disjoint/"
                                 "layer=none/seed=0.json").read_text())
    control_multi = json.loads((root / "results/toy-a/city_locations/linear+text/multiclass/entity_disjoint/"
                                       "layer=none/seed=0.json").read_text())
    for _, r in versus.iterrows():
        probe = _cells(root, "toy-a", r["probe"], "neither_vs_all")[int(r["neither_vs_all_layer"])]
        direct = compare_cells(probe, control, n_boot=50)["mcc_all"]
        assert r["delta_mcc_all"] == pytest.approx(direct["diff"]) and r["delta_mcc_all_p_raw"] == direct["p_value"]
        multi = _cells(root, "toy-a", r["probe"], "multiclass")[int(r["multiclass_layer"])]["test"]
        y = np.array(multi["y"])
        recall = [np.mean(np.array(t["pred"])[y == 2] == 2) for t in (multi, control_multi["test"])]
        assert r["delta_recall"] == pytest.approx(recall[0] - recall[1])
        verdict_of = ("not distinguishable" if not r["delta_mcc_all_significant_holm"] else
                      "beyond the control" if r["delta_mcc_all"] > 0 else "below the control")
        assert r["verdict_delta_mcc_all"] == verdict_of
    np.testing.assert_allclose(versus["delta_mcc_all_p_holm"], holm(versus["delta_mcc_all_p_raw"].to_numpy()))
    (v,) = claims[claims["claim"] == "b_verdict"].itertuples()
    beyond = [p for p, g in versus.groupby("probe") if (g["verdict_delta_mcc_all"] == "beyond the control").all()]
    assert v.verdict == ("separable beyond lexical novelty" if beyond else
                         "not distinguishable from lexical novelty on this datapack")
    depth = claims[(claims["claim"] == "a") & (claims["model"] == "toy-a") & (claims["probe"] == "mean_diff")]
    for _, r in depth.iterrows():
        null = [json.loads(p.read_text())["metrics"]["mcc"] for p in (
            root / "results/toy-a/city_locations/mean_diff+shuffled" / r["task"] / "entity_disjoint" /
            f"layer={int(r['layer'])}").glob("seed=*.json")]
        assert r["n_permutations"] == len(null)
        if null:
            assert r["shuffled_mcc"] == pytest.approx(np.mean(null)) and r["shuffled_mcc_lo"] == min(null)
        assert r["first_layer"] == 0
    assert (depth["n_permutations"] == 2).any()
    md = (root / "reports" / "cross_model" / "claims.md").read_text()
    assert "| toy-a | city_locations | linear+text (control) |" in md and f"**toy-a / city_locations**: {v.verdict}" in md


def test_samil_verdicts_follow_their_holm_adjusted_p_values(report):
    root, claims, _ = report
    samil = claims[claims["claim"] == "c"]
    # only toy-a has samil cells; mean_diff is its one single-instance rival here, at its own best layer and at
    # samil's
    assert set(samil["model"]) == {"toy-a"} and set(samil["versus"]) == {"mean_diff"} and len(samil) == 8
    assert set(samil["samil"]) == {"samil"} and (samil["at"] == "best layers").sum() == 4
    same = samil[samil["at"] == "same layer"]
    assert (same["other_layer"] == same["samil_layer"]).all() and len(same) == 4
    summary = claims[claims["claim"] == "c_summary"].set_index("model")
    assert summary.loc["toy-a", "n_comparisons"] == 8
    for metric in ("mcc", "wmcc", "mcc_all", "auroc"):
        prefix = f"delta_{metric}"
        # the family: all the model's (datapack, task, rival) comparisons of this metric
        np.testing.assert_allclose(samil[f"{prefix}_p_holm"], holm(samil[f"{prefix}_p_raw"].to_numpy()))
        for kind in ("raw", "holm"):
            significant = samil[f"{prefix}_p_{kind}"] < 0.05
            for (_, r), sig in zip(samil.iterrows(), significant):
                assert r[f"verdict_{metric}_{kind}"] == verdict(r[prefix], sig)
                assert (r[f"verdict_{metric}_{kind}"] == "samil better") == (sig and r[prefix] > 0)
            worse = (significant & (samil[prefix] < 0)).sum()
            assert summary.loc["toy-a", f"n_samil_worse_{kind}_{metric}"] == worse
        assert (samil[f"{prefix}_lo"] <= samil[prefix] + 1e-9).all()
    for _, r in samil.iterrows():
        cells = _cells(root, "toy-a", "samil", r["task"])
        assert (r["samil_flag"] if isinstance(r["samil_flag"], str) else "") == _flag(cells[r["samil_layer"]])
    assert verdict(0.1, True) == "samil better" and verdict(-0.1, True) == "samil worse"
    assert verdict(0.1, False) == "no significant difference" and verdict(0.1, pd.NA) == "undefined"
    md = (root / "reports" / "cross_model" / "claims.md").read_text()
    assert "Holm-adjusted over the family of all the model's (datapack, task, rival) comparisons" in md


def test_no_cells_is_one_line_error(tmp_path):
    result = _cli(tmp_path, "models=[nothing]", "datapacks=[city_locations]")
    errors = [line for line in result.stderr.splitlines() if "ERROR" in line]
    assert result.returncode == 1 and len(errors) == 1 and "no result cells" in errors[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr


def test_the_results_page_is_rewritten_identically_but_for_its_provenance_line(report, tmp_path):
    root, _, _ = report
    pages = []
    for name in ("first", "second"):
        result = _cli(root, "models=[toy-a,toy-b]", "datapacks=[city_locations,med_indications]", "n_boot=50",
                      f"page_dir={tmp_path / name}")
        assert result.returncode == 0, result.stderr[-2000:]
        pages.append(tmp_path / name)
    first, second = ((p / "claims.md").read_text().splitlines() for p in pages)
    changed = [i for i, (a, b) in enumerate(zip(first, second)) if a != b]
    assert len(first) == len(second) and all(first[i].startswith("> Generated by") for i in changed)
    assert sum(line.startswith("> Generated by") for line in first) == 1
    assert (pages[0] / "claims.csv").read_bytes() == (pages[1] / "claims.csv").read_bytes()
    assert (pages[0] / "claims.csv").read_bytes() == (root / "reports" / "cross_model" / "claims.csv").read_bytes()
    assert "![depth_city_locations.png](depth_city_locations.png)" in first and \
        (pages[0] / "depth_city_locations.png").stat().st_size > 0
    assert "| toy-a | city_locations | 5 | mean_diff 5 (4 tasks); samil 2 (4 tasks) |" in first


def test_too_few_resamples_for_holm_over_the_family_are_said(report):
    """n_boot=50: no bootstrap p is below 2 / 51, so Holm over a family of more than one comparison cannot
    reach 0.05; the run says so in one line (the claims page's Holm columns would otherwise read as a finding)."""
    _, claims, stderr = report
    family = int(claims.dropna(subset=["q3_vs_rest_mcc_p_raw"]).groupby("model").size().max())
    assert family >= 2
    assert "n_boot=50: no bootstrap p is below 0.039, so Holm over a family of" in stderr
    assert "rerun with n_boot >= " in stderr
    from experiments.tables import holm_resolution_warning
    assert holm_resolution_warning(5000, 45) is None and holm_resolution_warning(1000, 0) is None
    assert "rerun with n_boot >= 1440" in holm_resolution_warning(1000, 36)    # the NCB study's robust family
