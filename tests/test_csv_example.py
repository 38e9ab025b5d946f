"""The worked example of docs/extract.md ("Your own statements"): a 30-row CSV with the documented columns is
extracted with the tiny model; at alpha=0.1 train_probe stops with the one line the page quotes (its calibration
split is too small), and at the alpha that line advises it writes its cell."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from evaluation.conformal import ConformalError
from toolkit.config import compose_config
from extract.statements import load_statements
from probes.pipeline import train_probes
from tests.helpers import extract_csv

DOC = Path(__file__).resolve().parent.parent / "docs" / "extract.md"


def test_the_documented_30_row_csv_runs_with_the_advised_alpha(tmp_path):
    table = load_statements("city_locations")
    rows = table.iloc[np.r_[0:20, len(table) - 10:len(table)]][["statement", "label", "object_1", "object_2"]]
    rows.to_csv(tmp_path / "mine.csv", index=False)
    doc = DOC.read_text()
    assert rows.iloc[0].to_list()[0] in doc and "statement,label,object_1,object_2" in doc
    extract_csv(tmp_path, "mine", tmp_path / "mine.csv", tmp_path / "activations")
    run = ["model.name=tiny", "data.name=mine", f"store_dir={tmp_path / 'activations'}",
           f"results_dir={tmp_path / 'results'}", "probe=linear", "layer=1", "n_boot=20"]
    with pytest.raises(ConformalError) as refused:
        train_probes(compose_config("train_probe", *run))
    quoted = re.search(r"#   (calibration split has .*?) \.\.\.", doc).group(1)
    assert str(refused.value).startswith(quoted)
    advised = re.search(r"raise alpha to at least ([0-9.]+)", str(refused.value)).group(1)
    (cell,) = train_probes(compose_config("train_probe", *run, f"alpha={advised}"))
    assert cell.exists()
