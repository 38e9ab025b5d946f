"""apply_probe: a saved probe scores its own test rows exactly as its cell did, scores another
datapack's store of the same model, refuses stores of another model / settings / without its layer
(one line, nothing written), and scores user statements extracted on the fly (the same vectors as the
store's). fit_probe fits and calibrates exactly as train_probe."""
from __future__ import annotations

import json
import subprocess
import sys
from functools import partial
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from probes.apply import apply, apply_to_statements, apply_to_store, csv_statements
from evaluation.cells import read_cell, write_cell
from evaluation.splits import entity_groups, make_split
from evaluation.tasks import task_targets
from toolkit.config import compose_config
from toolkit.errors import ToolkitError
from extract.on_the_fly import extract_statements, store_model
from extract.store import ActivationStore, ModelMismatch, StoreError, store_summary
from probes.artifacts import fit_probe, load_probe
from probes.saved_pair import artifact_path
from probes.features import TOKEN_KINDS, layer_features
from probes.pipeline import train_probes
from tests.helpers import compose_apply, datapack_csv, extract_csv

ROOT = Path(__file__).resolve().parent.parent
LAYER = 2


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """Stores of the tiny model: cities_a (training), cities_b (other statements), cities_c (layer 1 only);
    cities_b of another tiny model (weights seed 1) and with a system prompt, in their own store_dirs;
    one mean_diff cell per task on cities_a."""
    root = tmp_path_factory.mktemp("apply")
    a = datapack_csv(root / "a.csv", slice(0, 150), slice(0, 70))
    b = datapack_csv(root / "b.csv", slice(150, 250), slice(70, 120))
    extract_csv(root, "cities_a", a, root / "s", "layers=[1,2]")
    extract_csv(root, "cities_b", b, root / "s", "layers=[1,2]")
    extract_csv(root, "cities_c", b, root / "s", "layers=[1]", "limit=10")
    extract_csv(root, "cities_b", b, root / "other_model", "layers=[1,2]", "limit=10", "model.seed=1")
    extract_csv(root, "cities_b", b, root / "prompted", "layers=[1,2]", "limit=10", "model.system_prompt=Be brief.")
    run = partial(compose_config, "train_probe", "model.name=tiny", "data.name=cities_a", f"store_dir={root / 's'}",
                  f"results_dir={root / 'results'}", "n_boot=50", f"layer={LAYER}", "probe=mean_diff")
    cells = {task: train_probes(run(f"task={task}"))[0] for task in ("true_vs_all", "multiclass")}
    return root, cells


def test_own_datapack_reproduces_the_cells_test_metrics(dirs):
    root, cells = dirs
    for cell_file in cells.values():
        path = apply_to_store(cell_file, "cities_a", root / "s", root / "results")
        assert path.parts[-6] == "cities_a->cities_a"
        cell, transfer = read_cell(cell_file), read_cell(path)
        for key in ("rows", "y", "groups", "sets", "pred"):
            assert transfer["test"][key] == cell["test"][key], key
        for key in ("scores", "probs"):
            np.testing.assert_allclose(transfer["test"][key], cell["test"][key], atol=1e-6)
        for key in ("n", "mcc", "wmcc", "acceptance", "mcc_ci", "wmcc_ci", "mcc_all", "coverage", "accepted_per_label"):
            assert transfer["metrics"][key] == cell["metrics"][key], key
        for key in ("auroc", "auroc_probs", "ece", "aurc"):
            assert transfer["metrics"][key] == pytest.approx(cell["metrics"][key], abs=1e-6), key


def test_another_datapack_scores_every_statement_of_the_task(dirs):
    root, cells = dirs
    path = apply_to_store(cells["true_vs_all"], "cities_b", root / "s", root / "results")
    transfer = read_cell(path)
    with ActivationStore(root / "s" / "tiny" / "cities_b.h5") as store:
        n = store.n_statements
    assert transfer["metrics"]["n"] == n and transfer["test"]["rows"] == list(range(n))
    assert transfer["config"]["data"]["name"] == "cities_b" and transfer["transfer"]["train_data"] == "cities_a"
    stamp = path.stat().st_mtime_ns
    assert apply_to_store(cells["true_vs_all"], "cities_b", root / "s", root / "results") == path
    assert path.stat().st_mtime_ns == stamp  # kept unless overwrite


@pytest.mark.parametrize("store_dir,datapack,error,message", [
    ("other_model", "cities_b", ModelMismatch, "has another model_fingerprint"),
    ("s", "cities_c", StoreError, "does not hold layer 2"),
])
def test_refused_stores_write_nothing(dirs, tmp_path, store_dir, datapack, error, message):
    root, cells = dirs
    with pytest.raises(error, match=message) as err:
        apply_to_store(cells["true_vs_all"], datapack, root / store_dir, tmp_path / "results")
    assert "\n" not in str(err.value) and not (tmp_path / "results").exists()


def test_another_system_prompt_is_refused(dirs, tmp_path):
    """A cell recording the full store summary (template text, system prompt) refuses a store extracted
    with another system prompt, though its model fingerprint is the same."""
    root, cells = dirs
    cell = read_cell(cells["true_vs_all"])
    with ActivationStore(root / "s" / "tiny" / "cities_a.h5") as store:
        cell["store"] = store_summary(store)
    copy = tmp_path / "seed=0.json"
    write_cell(copy, cell)
    heads = artifact_path(cells["true_vs_all"])
    copy.with_name(heads.name).write_bytes(heads.read_bytes())
    with pytest.raises(ModelMismatch, match="another system_prompt"):
        apply_to_store(copy, "cities_b", root / "prompted", tmp_path / "results")
    assert not (tmp_path / "results").exists()


def test_cli_refusal_is_one_line(dirs):
    root, cells = dirs
    done = subprocess.run([sys.executable, "-m", "apply_probe", f"probe={cells['true_vs_all']}", "data=csv",
                           "data.name=cities_b", f"store_dir={root / 'other_model'}",
                           f"results_dir={root / 'cli_results'}", f"hydra.run.dir={root / 'logs'}"],
                          cwd=ROOT, capture_output=True, text=True)
    errors = [line for line in done.stderr.splitlines() if "ERROR" in line]
    assert done.returncode == 1 and len(errors) == 1 and "model_fingerprint" in errors[0], done.stderr[-2000:]
    assert not (root / "cli_results").exists()


def test_on_the_fly_vectors_equal_the_stores(dirs):
    root, _ = dirs
    with ActivationStore(root / "s" / "tiny" / "cities_a.h5") as store:
        statements = store.table["statement"].tolist()[:12]
        memory = extract_statements(store_model(store.attrs, "cpu"), statements, LAYER, store.attrs["dtype"],
                                    batch_tokens=200)
        for representation in ("last", "mean", "bags"):
            for tokens in TOKEN_KINDS:
                a = layer_features(store, LAYER, representation, tokens).subset(np.arange(12))
                b = layer_features(memory, LAYER, representation, tokens)
                # the store computed the template's shared prefix once (its key/value cache extended per
                # batch): the same vectors to the stored float16's rounding (one ulp, 2^-10 relative)
                np.testing.assert_allclose(b.X.numpy(), a.X.numpy(), atol=1e-6, rtol=2 ** -10)
                if representation == "bags":
                    assert b.offsets.tolist() == a.offsets.tolist()


def test_text_scores_statements_like_the_store(dirs, capsys):
    """text= through the command line: one printed line per statement, and the saved probabilities
    equal the probe's on the store's vectors of the same statements."""
    root, cells = dirs
    with ActivationStore(root / "s" / "tiny" / "cities_a.h5") as store:
        statements = store.table["statement"].tolist()[:2]
        probe = load_probe(cells["multiclass"])
        expected = probe.predict_proba(store.last_token(LAYER)[:2])
    done = subprocess.run([sys.executable, "-m", "apply_probe", f"probe={cells['multiclass']}",
                           f"text=[{statements[0]}, '{statements[1]}']", f"store_dir={root / 's'}",
                           f"results_dir={root / 'results'}", f"hydra.run.dir={root / 'logs'}"],
                          cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    printed = [line for line in done.stdout.splitlines() if "set={" in line]
    assert len(printed) == 2 and printed[0].endswith(statements[0])
    saved = json.loads(next((root / "results" / "tiny" / "apply").glob("text.cities_a.mean_diff.multiclass.*.json"))
                       .read_text())
    got = [[s["probs"][c] for c in saved["classes"]] for s in saved["statements"]]
    np.testing.assert_allclose(got, expected, atol=1e-6)
    path = apply_to_statements(cells["true_vs_all"], ["Paris is a city in France."], root / "s", root / "results")
    assert json.loads(path.read_text())["classes"] == ["not true", "true"]


def test_a_second_text_run_of_the_same_name_is_refused_unless_overwrite(dirs, tmp_path):
    """A second text= run used to replace the first's output silently: it is refused (one line, before the
    model is loaded) unless overwrite=true or another name= is given."""
    root, cells = dirs
    base = (f"probe={cells['true_vs_all']}", f"store_dir={root / 's'}", f"results_dir={tmp_path / 'results'}")
    first = apply(compose_apply(*base, "text=Paris is a city in France."))
    before = first.read_text()
    with pytest.raises(ToolkitError, match="exists .*give name=<another name>, or overwrite=true"):
        apply(compose_apply(*base, "text=Rome is a city in Peru."))
    assert first.read_text() == before
    other = apply(compose_apply(*base, "text=Rome is a city in Peru.", "name=rome"))
    assert other != first and first.read_text() == before
    again = apply(compose_apply(*base, "text=Rome is a city in Peru.", "overwrite=true"))
    assert again == first and "Rome" in first.read_text()


def test_text_is_data_never_interpolated(dirs, tmp_path, monkeypatch, capsys):
    """`${oc.env:SECRET_TOKEN}` in text= used to be scored and saved as the variable's value, and an unset
    variable crashed: user text is scored as the characters written."""
    root, cells = dirs
    monkeypatch.setenv("SECRET_TOKEN", "hunter2-do-not-leak")
    monkeypatch.delenv("TRUTHPROBE_UNSET_VARIABLE", raising=False)
    base = (f"probe={cells['true_vs_all']}", f"store_dir={root / 's'}", f"results_dir={tmp_path / 'results'}")
    for i, (text, expected) in enumerate([
            ("${oc.env:SECRET_TOKEN}", ["${oc.env:SECRET_TOKEN}"]),
            ("['${oc.env:SECRET_TOKEN}', 'Paris is in ${oc.env:TRUTHPROBE_UNSET_VARIABLE}.']",
             ["${oc.env:SECRET_TOKEN}", "Paris is in ${oc.env:TRUTHPROBE_UNSET_VARIABLE}."])]):
        path = apply(compose_apply(*base, f"text={text}", f"name=t{i}"))
        saved = json.loads(path.read_text())
        assert [s["statement"] for s in saved["statements"]] == expected
        assert "hunter2" not in path.read_text()
    assert "hunter2" not in capsys.readouterr().out


def test_a_csv_path_with_spaces_gets_a_safe_default_name(dirs, tmp_path):
    """csv='my statements.csv' used to be refused as a bad name=: only the output name is one path
    component, derived from the file's stem (my_statements)."""
    root, cells = dirs
    csv = tmp_path / "my statements.csv"
    pd.DataFrame({"statement": ["Paris is a city in France.", "Rome is a city in Peru."]}).to_csv(csv, index=False)
    path = apply(compose_apply(f"probe={cells['true_vs_all']}", f"csv={csv}", f"store_dir={root / 's'}",
                               f"results_dir={tmp_path / 'results'}"))
    assert path.name.startswith("my_statements.cities_a.mean_diff.true_vs_all.")
    assert len(json.loads(path.read_text())["statements"]) == 2


def test_fit_probe_fits_and_calibrates_as_train_probe(dirs):
    """fit_probe on the cell's features, labels and split gives the cell's test scores, probabilities,
    sets and calibration."""
    root, cells = dirs
    for (task, cell_file), classes in zip(cells.items(), ([1], [0, 1, 2])):
        cfg = compose_config("train_probe", "probe=mean_diff", f"task={task}")
        cell = read_cell(cell_file)
        with ActivationStore(root / "s" / "tiny" / "cities_a.h5") as store:
            table = store.table
            rows, _ = task_targets(table["label"].to_numpy(), task)
            split = make_split(table, **cfg.split)
            X = store.last_token(LAYER)[rows]
        parts = (split.train, split.calibration, split.test)
        train, cal, test = (np.flatnonzero(np.isin(rows, part)) for part in parts)
        probe = fit_probe("mean_diff", X, table["label"].to_numpy()[rows], train, cal, classes=classes,
                          groups=entity_groups(table)[rows], seed=0)
        out = probe.score_all(X[test])
        np.testing.assert_allclose(out["scores"], cell["test"]["scores"], atol=1e-6)
        np.testing.assert_allclose(out["probs"], cell["test"]["probs"], atol=1e-6)
        assert out["sets"].astype(int).tolist() == cell["test"]["sets"]
        assert probe.calibration == cell["calibration"] and probe.conformal.to_dict() == cell["conformal"]


def test_transfer_matrix(dirs, tmp_path):
    """Two datapacks x two tasks: the diagonal is the ordinary cells' test metrics, the rest are transfer
    cells (computed once), and the tables and heat-maps are written."""
    from experiments.transfer import write_transfer

    root, _ = dirs
    results = tmp_path / "results"
    for datapack in ("cities_a", "cities_b"):
        train_probes(compose_config("train_probe", "model.name=tiny", f"data.name={datapack}", "probe=mean_diff",
                                    "tasks=[true_vs_false,multiclass]", f"store_dir={root / 's'}",
                                    f"results_dir={results}", "n_boot=50", "layer=[1,2]"))
    args = (results, tmp_path / "reports", "tiny", ["cities_a", "cities_b"])
    out = write_transfer(*args, store_dir=root / "s")
    table = pd.read_csv(out / "transfer.csv")
    assert len(table) == 2 * 2 * 2 and set(table["task"]) == {"true_vs_false", "multiclass"}
    assert not any(Path(p).is_absolute() for p in table["path"])     # relative to results_dir: no machine's folder
    for r in table.itertuples():
        cell = read_cell(results / r.path)
        assert r.mcc == pytest.approx(cell["metrics"]["mcc"]) and r.wmcc == pytest.approx(cell["metrics"]["wmcc"])
        assert ("->" in r.path) == (r.train != r.eval)
        assert cell["layer"] == r.layer and cell["config"]["data"]["name"] == r.eval
    stamps = {p: (results / p).stat().st_mtime_ns for p in table["path"]}
    pages = [tmp_path / "page1", tmp_path / "page2"]
    for page_dir in pages:   # the report's call: tabulates existing cells, computes nothing; and the results page
        write_transfer(*args, page_dir=page_dir)
    assert all((results / p).stat().st_mtime_ns == t for p, t in stamps.items())
    assert (out / "transfer.md").read_text().startswith("### mean_diff, multiclass")
    for task in ("true_vs_false", "multiclass"):
        assert (out / f"transfer_{task}.png").stat().st_size > 0
        assert (pages[0] / f"tiny_transfer_{task}.png").stat().st_size > 0
    first, second = ((p / "tiny.md").read_text().splitlines() for p in pages)
    assert first[0].startswith("# Does a truth direction transfer?") and first[2].startswith("> Generated by ")
    assert first[:2] + first[3:] == second[:2] + second[3:]      # a rerun differs in its provenance line only
    assert (out / "transfer.md").read_text() in "\n".join(first) + "\n"
    assert (pages[0] / "tiny_transfer.csv").read_bytes() == (out / "transfer.csv").read_bytes()


def test_transfer_matrix_shows_auroc_and_single_label_cells(dirs, tmp_path):
    """Beside MCC: the raw scores' AUROC with its cluster-bootstrap interval (a direct percentile computation
    over the cell's groups, n_boot and seed), `single_label` from the evaluated cell's conformal sets, and
    the probe's flag; a single-label cell says so in the markdown instead of reading as "no signal"."""
    from evaluation.cell_metrics import raw_auroc
    from evaluation.selective import cluster_bootstrap_indices
    from experiments.tables import cell_flag
    from experiments.transfer import _markdown, write_transfer

    root, _ = dirs
    results = tmp_path / "results"
    for datapack in ("cities_a", "cities_b"):
        train_probes(compose_config("train_probe", "model.name=tiny", f"data.name={datapack}", "probe=mean_diff",
                                    "task=true_vs_false", f"store_dir={root / 's'}", f"results_dir={results}",
                                    "n_boot=50", "layer=[2]"))
    out = write_transfer(results, tmp_path / "reports", "tiny", ["cities_a", "cities_b"], tasks=["true_vs_false"],
                         store_dir=root / "s")
    table = pd.read_csv(out / "transfer.csv", keep_default_na=False, na_values=[""])
    assert len(table) == 4
    for r in table.itertuples():
        cell = read_cell(results / r.path)
        test, m = cell["test"], cell["metrics"]
        y, scores = np.array(test["y"]), np.array(test["scores"])
        draws = [raw_auroc(y[i], scores[i]) for i in
                 cluster_bootstrap_indices(np.array(test["groups"]), m["n_boot"], np.random.default_rng(m["seed"]))]
        assert r.auroc == pytest.approx(m["auroc"])
        assert [r.auroc_lo, r.auroc_hi] == pytest.approx(np.percentile(draws, [2.5, 97.5]).tolist())
        assert r.single_label == m["single_label_accepted"]
        probe_cell = read_cell(results / table[(table["train"] == r.train) & (table["eval"] == r.train)]["path"].iloc[0])
        assert (r.flag if isinstance(r.flag, str) else "") == cell_flag(probe_cell)
    one_label = table.assign(single_label=[True, False, False, False], mcc=[0.0, *table["mcc"][1:]])
    md = _markdown(one_label, ["cities_a", "cities_b"])
    assert md.count("(one label)") == 1 and "AUROC" in md and "absence of signal" in md


def test_a_csv_row_without_a_statement_is_refused_with_its_row_number(tmp_path):
    """Blank and whitespace-only rows were dropped silently: the results no longer lined up with the file."""
    csv = tmp_path / "mine.csv"
    csv.write_text("statement,label\nParis is in France.,1\n\n   ,0\nRome is in Peru.,0\n")
    with pytest.raises(ToolkitError, match=r"rows 3, 4 \(the header is row 1\) hold no statement"):
        csv_statements(str(csv))
    csv.write_text("statement\nParis is in France.\n  Rome is in Peru. \n")
    assert csv_statements(str(csv)) == ["Paris is in France.", "Rome is in Peru."]
