"""The per-token view (probes.token_view, apply_probe view=html): for a text and for a datapack row, one
self-contained page whose embedded numbers equal apply_probe's per-token scores and an independent computation
(each token's vector through the probe: samil's instance score coef . (x - mean) / std + b, mean_diff's score of
the vector), the statement's decision equal to apply_probe's; the page opens in headless Chromium where it is
installed; bad options are one line."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from functools import partial

import numpy as np
import pytest

from probes.apply import apply
from toolkit.config import compose_config
from toolkit.errors import ToolkitError
from extract.store import ActivationStore
from probes.artifacts import load_probe
from probes.features import TOKEN_KINDS
from probes.pipeline import train_probes
from tests.helpers import compose_apply, datapack_csv, extract_csv

TEXT = "The city of Paris is located in France."


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """The tiny model's store of a city datapack (layers 1, 2) and a samil and a mean_diff cell at layer 2."""
    root = tmp_path_factory.mktemp("view")
    csv = datapack_csv(root / "a.csv", slice(0, 120), slice(0, 60))
    extract_csv(root, "cities_a", csv, root / "s", "layers=[1,2]")
    run = partial(compose_config, "train_probe", "model.name=tiny", "data.name=cities_a", f"store_dir={root / 's'}",
                  f"results_dir={root / 'results'}", "n_boot=20", "layer=2")
    cells = {"samil": train_probes(run("probe=samil", "task=true_vs_false", "probe.C=10"))[0],
             "mean_diff": train_probes(run("probe=mean_diff", "task=multiclass"))[0]}
    return root, cells


def _embedded(page: str) -> list[dict]:
    found = re.search(r'<script type="application/json" id="token-view">(.*?)</script>', page, re.S)
    return json.loads(found.group(1).replace("<\\/", "</"))


def _by_hand(probe, tokens: np.ndarray) -> np.ndarray:
    """Each token's score [T, heads], written out from the heads' fitted tensors."""
    out = []
    for head in probe.heads:
        state = {k: v.double().numpy() for k, v in head.state_dict().items() if hasattr(v, "double")}
        if probe.representation == "bags":         # samil: the instance score of each token
            out.append(((tokens - state["mean"]) / state["std"]) @ state["coef"] + state["intercept"])
        else:                                      # mean_diff: X @ direction + threshold
            out.append(tokens @ state["direction"] + state["threshold"])
    return np.stack(out, axis=1)


@pytest.mark.parametrize("probe_name", ["samil", "mean_diff"])
def test_the_text_view_holds_apply_probes_per_token_scores(dirs, probe_name):
    root, cells = dirs
    base = [f"probe={cells[probe_name]}", f"store_dir={root / 's'}", f"results_dir={root / 'results'}",
            f"name=view-{probe_name}", "view=html"]
    scores_file = apply(compose_apply(*base, f"text={TEXT}"))
    page = scores_file.with_suffix(".html").read_text()
    record = json.loads(scores_file.read_text())["statements"][0]
    (view,) = _embedded(page)
    assert sorted(view["layers"]) == ["1", "2"] and view["probe_layer"] == 2
    np.testing.assert_array_equal(view["layers"]["2"]["scores"], record["token_scores"])
    assert view["tokens"] == record["tokens"] and "".join(view["tokens"]).strip().endswith("France.")
    assert view["decision"]["pred"] == record["pred"] and view["decision"]["probs"] == record["probs"]
    probe = load_probe(cells[probe_name])
    # independently: the statement's own tokens from the store's extraction path, through the heads by hand
    from extract.on_the_fly import extract_statements, store_model

    with ActivationStore(root / "s" / "tiny" / "cities_a.h5") as store:
        memory = extract_statements(store_model(store.attrs, "cpu"), [TEXT], [2], store.attrs["dtype"])
    tokens, _ = memory.bags(2, TOKEN_KINDS[probe.tokens])
    np.testing.assert_allclose(record["token_scores"], _by_hand(probe, tokens.astype(np.float64)), rtol=1e-5,
                               atol=1e-6)
    if probe_name == "samil":      # the bag's score is its best token's
        assert record["scores"][0] == pytest.approx(max(s[0] for s in record["token_scores"]), abs=1e-9)
    assert "abstains" in page or f"predicts <b>{record['pred']}</b>" in page


def test_a_datapack_row_view_reads_the_store(dirs, tmp_path):
    root, cells = dirs
    page_file = apply(compose_apply(f"probe={cells['samil']}", "data=csv", "data.name=cities_a", "row=3", "view=html",
                                    f"store_dir={root / 's'}", f"results_dir={tmp_path}"))
    (view,) = _embedded(page_file.read_text())
    probe = load_probe(cells["samil"])
    with ActivationStore(root / "s" / "tiny" / "cities_a.h5") as store:
        assert view["statement"] == store.table["statement"].iloc[3]
        X, offsets = store.bags(1, TOKEN_KINDS[probe.tokens])
        np.testing.assert_allclose(view["layers"]["1"]["scores"],
                                   _by_hand(probe, X[offsets[3]:offsets[4]].astype(np.float64)), rtol=1e-5, atol=1e-6)
    assert not list(tmp_path.rglob("*->*"))       # a view writes no transfer cell


def test_bad_view_options_are_one_line(dirs, tmp_path):
    root, cells = dirs
    base = [f"probe={cells['samil']}", f"store_dir={root / 's'}", f"results_dir={tmp_path}"]
    for extra, needle in ((["data=csv", "data.name=cities_a", "row=3"], "row=3 is read by view=html only"),
                          (["data=csv", "data.name=cities_a", "row=-1", "view=html"], "row=-1"),
                          (["data=csv", "data.name=cities_a", "row=100000", "view=html"], "holds rows 0.."),
                          (["text=Rome is in Italy.", "row=2", "view=html"], "give data=<datapack> too"),
                          (["text=Rome is in Italy.", "view=svg"], "view")):
        with pytest.raises(ToolkitError, match=re.escape(needle)):
            apply(compose_apply(*base, *extra))
    assert not list(tmp_path.rglob("*.html"))


@pytest.mark.skipif(shutil.which("chromium") is None and shutil.which("chromium-browser") is None,
                    reason="no Chromium on this machine (apt-get install chromium): the page is not rendered here")
def test_the_page_renders_in_headless_chromium(dirs, tmp_path):
    root, cells = dirs
    scores_file = apply(compose_apply(f"probe={cells['mean_diff']}", f"store_dir={root / 's'}",
                                      f"results_dir={tmp_path}", "view=html", f"text={TEXT}"))
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    shot = tmp_path / "view.png"
    done = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1200,700",
                           f"--screenshot={shot}", scores_file.with_suffix(".html").as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    dom = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom",
                          scores_file.with_suffix(".html").as_uri()], capture_output=True, text=True, timeout=120)
    assert "France." in dom.stdout and dom.stdout.count("<tr") >= 3    # header and one row per layer, as rendered
