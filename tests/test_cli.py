"""Issue 29, the command line: every entry point's `--help` lists its config groups with their choices and
its options with their descriptions (from its schema) within seconds, importing neither torch nor
lightning; a mistyped group choice or option is one error line saying what was meant."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from toolkit.config import CONF_DIR, compose_config, config_groups
from toolkit.entry import COMMANDS, quoted
from toolkit.errors import misspelt_line
from toolkit.schema import schema_options
from tests.helpers import ROOT, assert_one_error_line, run_module
from tests.test_schemas import SCHEMAS

MODULES = {module.rpartition(".")[2]: module for module, _ in COMMANDS.values() if module.rpartition(".")[2] in SCHEMAS}
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
# `python -m <module> --help` in this process (runpy), then the heavy modules it imported
HELP_IMPORTS = """
import runpy, sys
module = sys.argv[1]
sys.argv[1:] = ["--help"]
try:
    runpy.run_module(module, run_name="__main__", alter_sys=True)
except SystemExit as done:
    assert done.code in (0, None), done.code
print("heavy:", sorted(m for m in ("torch", "lightning", "transformers", "sklearn") if m in sys.modules))
"""


def test_every_config_is_an_entry_point_here():
    assert set(MODULES) == set(SCHEMAS) == {p.stem for p in CONF_DIR.glob("*.yaml")}


@pytest.mark.parametrize("name", MODULES)
def test_help_lists_groups_and_options_with_descriptions(name):
    done = subprocess.run([sys.executable, "-m", MODULES[name], "--help"], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and not done.stderr, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    groups = config_groups(compose_config(name, hydra=True))
    for group in groups:
        choices = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
        assert any(line.split()[:1] == [group] and all(c in line for c in choices) for line in lines), group
    for key, f in schema_options(SCHEMAS[name], groups).items():
        assert any(line.strip().startswith(f"{key}=") and f.metadata["help"] in line for line in lines), key


def test_train_probe_help_names_layer_probe_and_task():
    done = subprocess.run([sys.executable, "-m", "train_probe", "-h"], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=60)
    lines = done.stdout.splitlines()
    assert any(line.strip().startswith("layer=16") and "one layer, a list" in line for line in lines), done.stdout
    assert any(line.split()[:1] == ["probe"] and "*linear," in line.split() and "samil" in line
               for line in lines), done.stdout
    assert any(line.split()[:1] == ["task"] and "*true_vs_all" in line and "multiclass" in line for line in lines)


@pytest.mark.parametrize("name", MODULES)
def test_help_imports_neither_torch_nor_lightning(name):
    done = subprocess.run([sys.executable, "-c", HELP_IMPORTS, MODULES[name]], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[-1] == "heavy: []", done.stdout.splitlines()[-1]


def test_hydra_help_is_still_hydras():
    done = subprocess.run([sys.executable, "-m", "truthfulqa", "--hydra-help"], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "Hydra (" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]


@pytest.mark.parametrize("module, args, line", [
    ("train_probe", ["probe=linaer"], "probe=linaer: no such probe; did you mean linear? (choices: ccs, linear, mean_diff, "
                                      "mlp, random_direction, samil, samil_reference, sawmil, spca, ttpd)"),
    ("train_probe", ["lyer=16"], "lyer: no such option; did you mean layer?"),
    ("train_probe", ["probe=mlp", "probe.dpth=2"], "probe.dpth: no such option; did you mean probe.depth?"),
    ("extract", ["model=smolm2"], "model=smolm2: no such model; did you mean smollm2? (choices: gemma3-270m, llama, "
                                  "smollm2, tiny)"),
])
def test_a_mistyped_choice_or_option_is_one_line_saying_what_was_meant(tmp_path, module, args, line):
    assert_one_error_line(run_module(module, *args, cwd=tmp_path), line)


def test_a_name_close_to_nothing_keeps_hydras_line():
    from hydra.errors import ConfigCompositionException, MissingConfigException

    far = MissingConfigException("Could not find 'probe/xyz'", missing_cfg_file="probe/xyz", options=["linear", "mlp"])
    assert misspelt_line(far) is None
    with pytest.raises(ConfigCompositionException) as err:
        compose_config("train_probe", "zzzz=1")
    assert misspelt_line(err.value) is None


def test_truthprobe_lists_the_commands_and_runs_one():
    done = subprocess.run([sys.executable, "-c", "from toolkit.entry import truthprobe; truthprobe()", "--help"],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and all(f"  {c} " in done.stdout for c in COMMANDS), done.stdout
    done = subprocess.run([sys.executable, "-c", "from toolkit.entry import truthprobe; truthprobe()", "train-probe",
                           "--help"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "layer=16" in done.stdout, done.stderr[-2000:]
    done = subprocess.run([sys.executable, "-c", "from toolkit.entry import truthprobe; truthprobe()", "trian-probe"],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "did you mean train-probe?" in done.stderr


def test_cell_paths_and_statements_are_taken_as_written():
    path = "results/m/d/linear/true_vs_all/entity_disjoint/layer=16/seed=0.json"
    assert quoted([f"method={path}", "n_boot=5"], ("method",)) == [f"method='{path}'", "n_boot=5"]
    assert quoted([f"probe={path}", "text=[a, b]"], ("cell", "text"), {"probe": "cell"}) == [f"cell='{path}'",
                                                                                           "text=[a, b]"]
    assert quoted(["text=it's = 2"], ("text",)) == ["text='it\\'s = 2'"]
    assert compose_config("ncb", *quoted([f"method={path}"], ("method",))).method == path


def test_no_option_resolves_an_environment_variable(tmp_path):
    """`${oc.env:SECRET}` in a free-text, name or path option used to be resolved: the secret landed in the
    store's attributes (and every cell copying them). Every command-line value is data."""
    env = {**ENV, "SECRET": "hunter2-do-not-leak"}
    done = subprocess.run([sys.executable, "-m", "extract", "model=tiny", "data=city_locations", "limit=4",
                           "layers=[1]", f"store_dir={tmp_path / 'activations'}", f"hydra.run.dir={tmp_path / 'logs'}",
                           "model.system_prompt=You answer. ${oc.env:SECRET}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    store = next((tmp_path / "activations").rglob("*.h5"))
    assert b"hunter2" not in store.read_bytes() and b"You answer. ${oc.env:SECRET}" in store.read_bytes()
    for args in (["data.statement_column=${oc.env:SECRET}"], ["store_dir=/x/${oc.env:SECRET}"]):
        cfg = compose_config("extract", *quoted(args, ()))
        assert "hunter2" not in str(OmegaConf.to_container(cfg, resolve=True)), args
    assert compose_config("extract", *quoted(["hydra.run.dir=logs/${now:%Y}"], ())) is not None   # Hydra's own


def test_a_refused_run_leaves_no_logs_and_a_real_run_logs_under_its_output_folder(tmp_path):
    """Every call, a refused one included, used to write logs/<entry>/<time>/ in the working directory: a
    run refused at option checking leaves nothing, a real one logs under <results_dir>/logs/<entry>/."""
    from tests.helpers import make_synthetic_store

    work, results = tmp_path / "work", tmp_path / "out" / "results"
    work.mkdir()
    store = tmp_path / "activations"
    make_synthetic_store(store)
    for args in (["layer=99"], ["probe=linaer"], ["lyer=3"], ["n_boot=0"]):
        done = subprocess.run([sys.executable, "-m", "train_probe", "model.name=synthetic", f"store_dir={store}",
                               f"results_dir={results}", *args], cwd=work, env={**ENV, "PYTHONPATH": str(ROOT)},
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
        assert list(work.iterdir()) == [] and not (tmp_path / "out").exists(), args
    done = subprocess.run([sys.executable, "-m", "train_probe", "model.name=synthetic", f"store_dir={store}",
                           f"results_dir={results}", "probe=mean_diff", "layer=1", "n_boot=10"], cwd=work,
                          env={**ENV, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert list(work.iterdir()) == []
    logs = list((results / "logs" / "train_probe").glob("*/train_probe.log"))
    assert len(logs) == 1 and logs[0].stat().st_size > 0


# a 64 MB tensor made and freed 50 times: the page faults each costs on average (fresh pages the kernel
# zeroes; with reuse, a few blocks still land on fresh pages when small allocations split a freed one:
# 330-2000 a block over 50, 1600-5700 over 20, so 50)
PAGE_FAULTS = """
import resource, sys
import torch
from toolkit.entry import reuse_freed_memory
if sys.argv[1] == "reuse":
    assert reuse_freed_memory()
x = torch.ones(8 << 20, dtype=torch.float64); del x
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(50):
    x = torch.ones(8 << 20, dtype=torch.float64); del x
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 50)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc and getrusage's page faults")
def test_reused_freed_memory_spares_the_page_faults_of_large_temporaries():
    faults = {mode: float(subprocess.run([sys.executable, "-c", PAGE_FAULTS, mode], cwd=ROOT, env=ENV, check=True,
                                         capture_output=True, text=True).stdout)
              for mode in ("reuse", "default")}
    assert faults["default"] > 10_000                    # every 64 MB block mapped afresh: 16 384 pages
    assert faults["reuse"] < faults["default"] / 3, faults


@pytest.mark.parametrize("module, args", [
    ("train_probe", ["seed=-1"]), ("train_probe", ["split_seed=4294967296"]), ("zero_shot", ["model=tiny", "seed=-1"]),
    ("truthfulqa", ["model=tiny", "seed=-1"]), ("ncb", ["method=zero_shot", "model=tiny", "split_seed=-1"]),
    ("experiments.sweep", ["seed=-1"])])
def test_a_seed_outside_numpys_range_is_one_line_naming_it(tmp_path, module, args):
    """seed=-1 / 4294967296 used to end in numpy's ValueError traceback (the sweep's re-raised from its pool)."""
    from tests.helpers import make_synthetic_store

    store = [] if "model=tiny" in args else ["model.name=synthetic", f"store_dir={tmp_path / 's'}"]
    if store:
        make_synthetic_store(tmp_path / "s", n_real=60, n_neither=30)
    done = run_module(module, *store, *args, f"results_dir={tmp_path / 'r'}", cwd=tmp_path)
    key, value = args[-1].split("=")
    assert_one_error_line(done, f"{key}={value} is outside 0..4294967295")
    assert not (tmp_path / "r").exists()
