"""Result cells: where they live, how they are written (atomically) and read back.

One cell = one JSON file per (model, datapack, method, task, split, layer, seed):

    <results_dir>/<model>/<datapack>/<method>/<task>/<split>/layer=<k|none>/seed=<s>.json

`method` is a probe name (linear, samil, ...) or a behavioural method (zero_shot_<enumeration>_<mode>);
`layer` is None for methods that read no layer ("none" in the path, null in the JSON).
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from toolkit.disk import atomic_write
from toolkit.provenance import provenance
from toolkit.errors import ToolkitError, check_name


class CellError(ToolkitError):
    """A result cell that is missing, truncated or not a cell."""


def cell_path(results_dir, model: str, datapack: str, method: str, task: str, split: str,
              layer: int | None, seed: int) -> Path:
    """The one place that names a cell's file; every name is checked to be one path component."""
    parts = [check_name(v, k) for k, v in (("model", model), ("data", datapack), ("probe", method),
                                           ("task", task), ("split", split))]
    return Path(results_dir).joinpath(*parts, f"layer={'none' if layer is None else int(layer)}",
                                      f"seed={int(seed)}.json")


CELL_PARTS = ("model", "datapack", "method", "task", "split", "layer", "seed")   # cell_path's components, in order


def cell_files(results_dir, model: str = "*", datapack: str = "*", method: str = "*", task: str = "*",
               split: str = "*") -> list[Path]:
    """The cell files under `results_dir` in cell_path's layout whose components match (glob patterns, `*` any;
    a transfer's datapack is `<train>-><eval>`), sorted: the one finder of cells."""
    return sorted(Path(results_dir).glob(f"{model}/{datapack}/{method}/{task}/{split}/layer=*/seed=*.json"))


def cell_parts(path) -> dict[str, str]:
    """A cell file's path components by name (CELL_PARTS: the path's last seven, as cell_path lays them out)."""
    return dict(zip(CELL_PARTS, Path(path).parts[-len(CELL_PARTS):]))


def method_name(base: str, calibration: str | None = None, conformal: str | None = None) -> str:
    """The one name of a method's cells folder: `base` (a probe's name, zero_shot_<enumeration>_<mode>)
    with +<calibration> / +<conformal> appended where they are not the defaults (out_of_fold_cv, lac),
    so cells of other procedures never replace or shadow the default ones."""
    extras = [x for x, default in ((calibration, "out_of_fold_cv"), (conformal, "lac")) if x not in (None, default)]
    return check_name("+".join([base, *extras]), "method")


def result_cell(*, config: dict, method: dict, layer: int | None, split: dict, metrics: dict, test: dict,
                **parts) -> dict:
    """A result cell (every writer builds it here): the run's `config` (probe / task / layer named as in
    a probe's cell, so reports treat every method alike), `method` (name and procedure), the `layer` read
    (None: none), the `split` summary, test `metrics`, the method's own `parts` (store, calibration,
    conformal state, ...) and `test` (cell_test)."""
    return {"config": config, "method": method, "layer": layer, "split": split, "metrics": metrics, **parts,
            "test": test}


def cell_test(rows, y, groups, scores, probs, sets, pred, **extra) -> dict:
    """A cell's `test` part, as plain lists: positions `rows` [n] among the task's statements, targets
    y [n], entity groups [n], scores [n, heads or 7], probs [n, K], sets bool [n, K] (or None: no sets)
    and pred [n] (-1 = abstain), with any `extra` columns (e.g. table_rows)."""
    plain = {"rows": rows, "y": y, "groups": groups, "scores": scores, "probs": probs,
             "sets": None if sets is None else sets.astype(int), "pred": pred, **extra}
    return {k: v.tolist() if hasattr(v, "tolist") else v for k, v in plain.items()}


def write_cell(path: Path, cell: dict, replace: bool = True) -> None:
    """A cell as JSON (NaN refused: every number in a cell is finite or null), atomically, with the
    provenance of its `config` (``replace``: see `atomic_write`)."""
    write_record(path, cell, cell.get("config"), replace=replace)


def write_record(path: Path, record: dict, config: dict | None, indent: int | None = None,
                 replace: bool = True) -> None:
    """A JSON object (NaN refused) atomically, with `"provenance"` (toolkit.provenance) of the
    resolved `config` that produced it (``replace``: see `atomic_write`)."""
    write_json(path, {**record, "provenance": provenance(config)}, indent, replace)


def write_json(path: Path, value, indent: int | None = None, replace: bool = True) -> None:
    """Any JSON value (NaN refused, numpy scalars as numbers), atomically (``replace``: see `atomic_write`)."""
    data = json.dumps(value, allow_nan=False, indent=indent, default=_plain).encode()
    atomic_write(path, lambda f: f.write(data), replace)


def _plain(x):
    """numpy scalars as Python numbers; anything else JSON cannot hold as its string."""
    return x.item() if hasattr(x, "item") else str(x)


def check_cell_source(path: Path, cell: dict, model: str, datapack: str) -> None:
    """Refuse (CellError) a cell fitted on another model or datapack than the run's `model` / `datapack`."""
    config = cell["config"]
    found = (config.get("model", {}).get("name"), config.get("data", {}).get("name"))
    if found != (model, datapack):
        raise CellError(f"{path} is a cell of model {found[0]!r}, datapack {found[1]!r}, not {model!r}, {datapack!r}: "
                        "give a cell of this model and datapack (or set model= / data= to its own)")


# options that say where and how a run ran, not what its cell holds (a rerun may change them freely)
RUN_OPTIONS = frozenset({"store_dir", "results_dir", "threads", "layer", "overwrite", "trainer", "workers", "tracker",
                         "tracker_dir"})


def _flat(value, prefix: str = "") -> dict:
    """A nested config as {dotted option: value}."""
    if not isinstance(value, dict):
        return {prefix: value}
    return {k: v for key, item in value.items() for k, v in _flat(item, f"{prefix}{key}.").items()} if value \
        else {prefix: value}


def settings_mismatch(found: dict, wanted: dict) -> list[str]:
    """The options (dotted, `name: found -> wanted`) on which a cell's config `found` and a run's `wanted`
    differ, leaving out RUN_OPTIONS and options only one of them has (a cell of an older version)."""
    a, b = ({k.rstrip("."): v for k, v in _flat({k: v for k, v in c.items() if k not in RUN_OPTIONS}).items()}
            for c in (found, wanted))
    return [f"{k}: {a[k]!r} -> {b[k]!r}" for k in sorted(a.keys() & b.keys())
            if json.dumps(a[k], sort_keys=True, default=str) != json.dumps(b[k], sort_keys=True, default=str)]


def settings_key(config: dict) -> str:
    """A short hash of what a cell's `config` says about how its probe was made, leaving out RUN_OPTIONS and
    what tells the cells of one sweep apart (task, seed): cells of one (probe, task) with other keys were made
    with other settings (compare them with settings_mismatch)."""
    kept = {k: v for k, v in config.items() if k not in RUN_OPTIONS | {"task", "seed"}}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:12]


def check_same_settings(path: Path, config: dict) -> None:
    """Refuse (CellError) an existing cell at `path` made with other settings than `config` (the config the
    run would write there): skipping it would report a result of other settings as this run's."""
    differ = settings_mismatch(read_cell(path)["config"], config)
    if differ:
        raise CellError(f"{path} exists with other settings ({'; '.join(differ[:3])}"
                        f"{'; ...' if len(differ) > 3 else ''}): overwrite=true recomputes it, or write to "
                        "another results_dir")


def read_cell(path: Path) -> dict:
    """A cell written by `write_cell`; a one-line CellError naming the file otherwise. Deleting is advised only
    for a damaged cell (a file named like one, `seed=<s>.json`, that does not read as one); a folder or another
    file (an apply output, the user's own CSV) is named as not a cell, never to be deleted."""
    path = Path(path)
    if path.is_dir():
        raise CellError(f"{path} is a folder, not a result cell: give one cell file, "
                        "<results_dir>/<model>/<datapack>/<probe>/<task>/<split>/layer=<k>/seed=<s>.json")
    damaged = re.fullmatch(r"seed=\d+\.json", path.name) is not None
    fix = ("delete it and rerun the command that wrote it" if damaged else
           "give a result cell written by train_probe (<...>/layer=<k>/seed=<s>.json)")
    try:
        cell = json.loads(path.read_text())
    except FileNotFoundError:
        raise CellError(f"{path}: no such result cell") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CellError(f"{path} is not a readable result cell ({err}): {fix}") from None
    if not isinstance(cell, dict) or not {"metrics", "config", "test"} <= set(cell):
        raise CellError(f"{path} is not a result cell (no metrics / config / test): {fix}")
    return cell
