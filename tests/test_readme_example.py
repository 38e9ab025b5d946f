"""The manual's Python API example (docs/python-api.md, once the README's) runs unchanged, in a fresh
process, on a tiny-model store and a cell of `train_probe`."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from toolkit.config import compose_config
from probes.pipeline import train_probes
from tests.helpers import datapack_csv, extract_csv

ROOT = Path(__file__).resolve().parent.parent
MARKERS = re.compile(r"<!-- python-api-example -->\s*```python\n(.*?)```\s*<!-- /python-api-example -->", re.S)


def test_readme_python_example_runs(tmp_path):
    blocks = MARKERS.findall((ROOT / "docs" / "python-api.md").read_text())
    assert len(blocks) == 1
    store = extract_csv(tmp_path, "cities", datapack_csv(tmp_path / "a.csv", slice(0, 150), slice(0, 70)),
                        tmp_path / "s", "layers=[2]")
    cell = train_probes(compose_config("train_probe", "model.name=tiny", "data.name=cities", "probe=mean_diff",
                                       f"store_dir={tmp_path / 's'}", f"results_dir={tmp_path / 'results'}",
                                       "n_boot=50", "layer=2"))[0]
    env = {**os.environ, "STORE": str(store), "CELL": str(cell), "OUT": str(tmp_path / "mine.json"), "LAYER": "2"}
    done = subprocess.run([sys.executable, "-c", blocks[0]], cwd=tmp_path, env={**env, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("MCC")]
    assert len(lines) == 2 and "W-MCC" in lines[0]
    [heads] = tmp_path.glob("mine.*.probe.safetensors")   # named by its content hash, as the cell records
    assert heads.stat().st_size > 0
