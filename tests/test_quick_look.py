"""The README's 5-minute quick look runs as written on the tiny random model (conf/model/tiny.yaml) in place
of SmolLM2, in a temporary folder: each command exits 0, the report folder and the apply output exist,
and nothing is written outside the folder the commands name (the same store_dir / results_dir for all)."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QUICK_LOOK = re.compile(r"<!-- quick-look -->\s*```bash\n(.*?)```\s*<!-- /quick-look -->", re.S)
TINY = {"model=smollm2": "model=tiny", "results/smollm2/": "results/tiny/",   # 4 blocks: layers 0..4
        '"layers=[4,8,12,16,20]"': '"layers=[1,2,3,4]"', "/layer=16/": "/layer=2/"}


def quick_look_commands() -> list[str]:
    """The README's quick-look commands, SmolLM2 replaced by the tiny model, continuation lines joined."""
    [block] = QUICK_LOOK.findall((ROOT / "README.md").read_text())
    for old, new in TINY.items():
        assert old in block, old
        block = block.replace(old, new)
    return [line for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def test_readme_quick_look_runs_on_the_tiny_model(tmp_path):
    commands = quick_look_commands()
    assert len(commands) == 4 and all(c.startswith("python -m ") for c in commands)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for command in commands:
        done = subprocess.run([sys.executable, *shlex.split(command)[1:]], cwd=tmp_path, env=env,
                              capture_output=True, text=True)
        assert done.returncode == 0, (command, done.stderr[-3000:])
    report = tmp_path / "scratch" / "reports" / "tiny" / "city_locations"
    assert (report / "best.md").is_file() and (report / "mcc_by_layer.png").is_file()
    assert list((tmp_path / "scratch" / "results" / "tiny" / "apply").glob("*.json"))
    assert not {"activations", "results", "reports"} & {p.name for p in tmp_path.iterdir()}
