"""Result cells in the experiment tracker researchers already use, logged as each cell is written.

`tracker=mlflow`: one MLflow run per cell in a local store, `<tracker_dir>/mlflow.db` (SQLite: MLflow's
filesystem store is in maintenance mode) with artifacts in `<tracker_dir>/artifacts/` (the cell's JSON and its
heads file); one experiment per model x datapack (a transfer: per model x train->eval datapack); the run is named
after the cell and holds the cell's params and metrics, the metrics at step = layer. Browse with
`mlflow ui --backend-store-uri sqlite:///<tracker_dir>/mlflow.db`.
`tracker=tensorboard`: each metric as a scalar by layer (step = layer) under the tag
`<model>/<datapack>/<method>/<task>/<metric>`, event files in `<tracker_dir>` (`tensorboard --logdir <tracker_dir>`).

`tracker_dir=null`: `mlruns/` or `tensorboard/` beside results_dir. Off by default; the options say where a run
is logged, not what its cells hold (evaluation.cells.RUN_OPTIONS). Several processes (a sweep's workers) log into
one folder: MLflow's writes are serialised by a lock file beside its database, TensorBoard's writers each keep
their own event file.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import math
from contextlib import contextmanager
from pathlib import Path

from evaluation.cells import read_cell
from toolkit.disk import waiting_lock
from toolkit.errors import ToolkitError

TRACKERS = {"mlflow": "mlruns", "tensorboard": "tensorboard"}    # tracker -> its folder beside results_dir


class TrackerError(ToolkitError):
    """A tracker option that cannot be used (unknown name, package not installed, folder not writable)."""


def check_tracker(name: str | None) -> None:
    """Refuse, in one line, a tracker that is not one of TRACKERS or whose package is not installed."""
    if name is None:
        return
    if name not in TRACKERS:
        raise TrackerError(f"tracker={name!r}: give one of {', '.join(TRACKERS)}, or null for none")
    try:
        found = importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):     # (a package masked in sys.modules)
        found = False
    if not found:
        raise TrackerError(f"tracker={name} needs the {name} package, which is not installed: pip install {name} "
                           "(or tracker=null)")


def tracker_folder(name: str, tracker_dir: str | None, results_dir) -> Path:
    """Where `name` logs: `tracker_dir`, or its folder (TRACKERS) beside `results_dir`."""
    return Path(tracker_dir) if tracker_dir is not None else Path(results_dir).absolute().parent / TRACKERS[name]


def cell_record(cell: dict) -> tuple[str, str, dict, dict]:
    """(experiment, run name, params, metrics) of a result cell: params the cell's identity (model, datapack,
    method, task, split, layer, seed, each head's chosen C and searched grid), metrics every finite number of its
    `metrics` (an interval `<m>_ci` as `<m>_ci_low` / `<m>_ci_high`) and `fit_seconds`."""
    config = cell["config"]
    transfer = cell.get("transfer")
    datapack = f"{transfer['train_data']}->{transfer['eval_data']}" if transfer else config["data"]["name"]
    method = (cell.get("method") or {}).get("name", config["probe"]["name"])
    task, layer, seed = config["task"]["name"], cell.get("layer"), config.get("seed")
    params = {"model": config["model"]["name"], "datapack": datapack, "method": method, "task": task,
              "split": cell["split"]["kind"], "layer": "none" if layer is None else layer, "seed": seed}
    heads = cell.get("probe_params") or {}
    for head, p in heads.items():
        key = "" if len(heads) == 1 else f".{head}"
        for name in ("C", "Cs"):
            if isinstance(p, dict) and p.get(name) is not None:
                params[f"{name}{key}"] = json.dumps(p[name])
    metrics = {}
    for name, value in cell.get("metrics", {}).items():
        if name.endswith("_ci") and isinstance(value, list) and len(value) == 2:
            metrics.update({f"{name}_low": value[0], f"{name}_high": value[1]})
        elif not isinstance(value, bool):
            metrics[name] = value
    if cell.get("fit_seconds") is not None:
        metrics["fit_seconds"] = cell["fit_seconds"]
    metrics = {k: float(v) for k, v in metrics.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
    run = f"{method} {task} layer={params['layer']} seed={seed}"
    return f"{params['model']}/{datapack}", run, params, metrics


def cell_files(path: Path, cell: dict) -> list[Path]:
    """The cell's file and the heads file it names (evaluation.cells / probes.saved_pair), if any."""
    heads = cell.get("heads")
    named = [path.with_name(heads["file"])] if isinstance(heads, dict) and isinstance(heads.get("file"), str) else []
    return [path, *(f for f in named if f.parent == path.parent and f.exists())]


class MLflowTracker:
    """One MLflow run per cell in `folder`/mlflow.db (artifacts: `folder`/artifacts/)."""

    def __init__(self, folder: Path):
        from mlflow import MlflowClient   # here: importing MLflow takes seconds

        for name in ("mlflow", "alembic"):       # (their INFO lines on creating the tables)
            logging.getLogger(name).setLevel(logging.WARNING)
        self.folder = folder
        with self._lock():
            self.client = MlflowClient(tracking_uri=f"sqlite:///{folder.absolute() / 'mlflow.db'}")
            self.client.search_experiments(max_results=1)    # creates or upgrades the tables under the lock
        self.experiments: dict[str, str] = {}

    @contextmanager
    def _lock(self):
        with waiting_lock(self.folder / ".mlflow.lock", lambda err: TrackerError(
                f"cannot write the MLflow store in {self.folder} ({err.strerror or err}): choose another "
                "tracker_dir")):
            yield

    def _experiment(self, name: str) -> str:
        if name not in self.experiments:
            found = self.client.get_experiment_by_name(name)
            self.experiments[name] = found.experiment_id if found is not None else self.client.create_experiment(
                name, artifact_location=(self.folder.absolute() / "artifacts" / name.replace("/", "__")).as_uri(),
                tags={"mlflow.experimentKind": "custom_model_development"})   # (the UI opens on its runs)
        return self.experiments[name]

    def log_cell(self, path: Path) -> None:
        """One run for the cell at `path` (as written), the cell and its heads file as artifacts."""
        from mlflow.entities import Metric, Param

        cell = read_cell(path)
        experiment, run_name, params, metrics = cell_record(cell)
        step = params["layer"] if isinstance(params["layer"], int) else 0
        with self._lock():
            run = self.client.create_run(self._experiment(experiment), run_name=run_name,
                                         tags={"cell": str(path), "commit": str(cell.get("provenance", {})
                                                                                .get("git_commit"))})
            run_id = run.info.run_id
            self.client.log_batch(run_id, params=[Param(k, str(v)) for k, v in params.items()],
                                  metrics=[Metric(k, v, 0, step) for k, v in metrics.items()])
            for f in cell_files(path, cell):
                self.client.log_artifact(run_id, str(f))
            self.client.set_terminated(run_id)

    def close(self) -> None:
        pass


class TensorBoardTracker:
    """Each cell's metrics as scalars by layer in `folder` (this process's own event file)."""

    def __init__(self, folder: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(folder))

    def log_cell(self, path: Path) -> None:
        """The metrics of the cell at `path` (as written) at step = its layer."""
        _, _, params, metrics = cell_record(read_cell(path))
        step = params["layer"] if isinstance(params["layer"], int) else 0
        prefix = "/".join(str(params[k]) for k in ("model", "datapack", "method", "task"))
        for name, value in metrics.items():
            self.writer.add_scalar(f"{prefix}/{name}", value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


@contextmanager
def tracking(name: str | None, tracker_dir: str | None, results_dir):
    """The tracker `name` logging into its folder (tracker_folder), closed on leaving; None for `name=None`."""
    if name is None:
        yield None
        return
    check_tracker(name)
    folder = tracker_folder(name, tracker_dir, results_dir)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise TrackerError(f"cannot create the {name} folder {folder} ({err.strerror or err}): choose another "
                           "tracker_dir") from None
    tracker = (MLflowTracker if name == "mlflow" else TensorBoardTracker)(folder)
    try:
        yield tracker
    finally:
        tracker.close()
