"""Every output of every entry point records its provenance (toolkit/provenance.py) and every store
and cell names the checkpoint it came from (model_label): train_probe, apply_probe (transfer cell and
statement record), zero_shot, truthfulqa and ncb, run for real on the tiny model."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from probes.apply import apply_to_statements, apply_to_store
from evaluation.cells import read_cell
from toolkit.provenance import PACKAGES, config_hash
from toolkit.config import compose_config
from extract.models import gguf_checkpoint
from extract.run import extract
from extract.store import ActivationStore, store_path
from ncb.run import run as run_ncb
from probes.pipeline import train_probes
from tests.helpers import whole_cities_csv
from truthfulqa.run import run as run_truthfulqa
from zero_shot.run import run as run_zero_shot

ROOT = Path(__file__).resolve().parent.parent
KEYS = {"git_commit", "git_dirty", "toolkit_version", "python", "packages", "command", "config_sha256"}


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict[str, dict]:
    """One output of each entry point, on a tiny-model store of 30 real and 8 synthetic cities."""
    root = tmp_path_factory.mktemp("provenance")
    whole_cities_csv(root / "c.csv", 30, 8)
    dirs = [f"store_dir={root / 'activations'}", f"results_dir={root / 'results'}"]
    extract(compose_config("extract", "model=tiny", "data=csv", f"data.path={root / 'c.csv'}",
                           "data.name=city_locations", "layers=[2]", dirs[0]))
    [cell] = train_probes(compose_config("train_probe", "model=tiny", "data=city_locations", "probe=linear",
                                         "layer=2", "trainer.accelerator=cpu", "n_boot=20", *dirs))
    transfer = apply_to_store(cell, "city_locations", root / "activations", root / "results")
    record = apply_to_statements(cell, ["Paris is a city in France."], root / "activations", root / "results")
    zero_shot = run_zero_shot(compose_config("zero_shot", "model=tiny", "data=csv", f"data.path={root / 'c.csv'}",
                                             "data.name=city_locations", "batch_size=64", "n_boot=20", dirs[1]))
    tqa = run_truthfulqa(compose_config("truthfulqa", "model=tiny", "format=plain", "limit=2", "n_boot=20",
                                        dirs[1]))
    ncb = run_ncb(compose_config("ncb", "model=tiny", "data=city_locations", f"method='{cell}'", "n_boot=20", *dirs))
    store = ActivationStore(store_path(root / "activations", "tiny", "city_locations"))
    return {"cell": read_cell(cell), "transfer": read_cell(transfer), "apply": json.loads(record.read_text()),
            "zero_shot": read_cell(zero_shot[0]), "truthfulqa": json.loads(tqa.read_text()),
            "ncb": json.loads(ncb[1].read_text()), "store": dict(store.attrs)}


@pytest.mark.parametrize("name", ["cell", "transfer", "apply", "zero_shot", "truthfulqa", "ncb"])
def test_every_output_records_its_provenance(outputs, name):
    block = outputs[name]["provenance"]
    assert set(block) == KEYS
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:
        assert block["git_commit"] == head.stdout.strip() and isinstance(block["git_dirty"], bool)
    assert block["packages"]["torch"] == torch.__version__ and set(block["packages"]) == set(PACKAGES)
    assert all(block["packages"].values()) and block["toolkit_version"]
    assert isinstance(block["command"], list) and block["command"]
    assert len(block["config_sha256"]) == 64
    if "config" in outputs[name]:   # a cell: the hash is that of the config it records
        assert block["config_sha256"] == config_hash(outputs[name]["config"])


def test_stores_and_cells_name_their_checkpoint(outputs):
    label = outputs["store"]["model_label"]
    assert label.startswith("tiny-llama(") and label.endswith("(float32)")
    for name in ("cell", "transfer"):
        assert outputs[name]["store"]["model_label"] == label
    assert outputs["truthfulqa"]["model_label"] == label
    assert outputs["zero_shot"]["scores_source"]["meta"]["model_label"] == label
    assert outputs["cell"]["store"]["layers"] == [2]   # what a sweep's coverage is judged against


def test_ncb_reports_its_neighbourhood_sizes_and_gap_p_values(outputs):
    counts = outputs["ncb"]["counts"]
    sizes = counts["test_neighbourhood_sizes"]
    assert "0" not in sizes and sum(sizes.values()) == counts["test_targets"]
    gaps = [r for r in outputs["ncb"]["results"] if r["gap"] is not None]
    assert gaps and all(0.0 <= r["gap_p"] <= 1.0 for r in gaps)
    for r in gaps:   # a gap whose interval excludes 0 has p <= 0.05 (the same bootstrap draws)
        if r["gap_ci"][0] > 0 or r["gap_ci"][1] < 0:
            assert r["gap_p"] <= 0.05 + 1e-12


def test_gguf_file_names_give_checkpoint_and_quantisation():
    assert gguf_checkpoint("SmolLM2-135M-Instruct.Q4_1.gguf") == ("SmolLM2-135M-Instruct", "GGUF Q4_1")
    assert gguf_checkpoint("gemma-3-270m-q4_k_m.gguf") == ("gemma-3-270m", "GGUF Q4_K_M")
    assert gguf_checkpoint("model-F16.gguf") == ("model", "GGUF F16")
    assert gguf_checkpoint("weights.gguf")[1] == "GGUF, quantisation not named in the file name"
