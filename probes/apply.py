"""What `python -m apply_probe probe=<cell.json> data=<datapack>` does (apply_probe.py is its entry): score another datapack's store of the same
model with a saved probe and write a transfer cell; `text="..."` / `csv=<file>`: score your own
statements, extracted on the fly with the probe's model and template.

Transfer cells have a result cell's format (same metrics, abstention by the probe's conformal sets,
bootstrap intervals; `test` holds every scored row) and live at

    <results_dir>/<model>/<train datapack>-><eval datapack>/<method>/<task>/<split>/layer=<k>/seed=<s>.json

On the probe's own datapack exactly its cell's test rows are scored (the cell's test metrics are
reproduced); on another datapack every statement the task defines. A store of another model
(fingerprint), stored dtype, compute dtype, tokenizer, chat template or system prompt, or without the
probe's layer, is refused before anything is written.

Options are typed by `ApplyProbeSchema` (probes/schema.py; toolkit.schema.typed_options, the parser
every entry point uses) before any work: `overwrite=maybe` is one line, never a truthy string. `text=`
is data: it is read as written, never resolved (`${oc.env:X}` in a statement is scored as those
characters).
"""
from __future__ import annotations

import logging
import re
from functools import partial
from pathlib import Path

import numpy as np
import pandas as pd
from omegaconf import DictConfig, OmegaConf

from evaluation.tracking import check_tracker, tracking
from evaluation.cells import CellError, cell_path, cell_test, result_cell, write_cell, write_record
from evaluation.cell_metrics import cell_metrics, datapack_metrics
from evaluation.metrics import resampling_groups
from evaluation.splits import entity_groups
from evaluation.tasks import POSITIVE, task_targets
from toolkit.disk import atomic_write, WrittenMeanwhile
from toolkit.entry import quoted
from toolkit.errors import ToolkitError, check_count, check_name
from extract.models import resolve_device
from extract.on_the_fly import extract_statements, model_attrs, store_model
from toolkit.schema import typed_options
from extract.statements import LABELS
from extract.store import ActivationStore, StoreError, check_same_model, store_path, store_summary
from probes.artifacts import FittedProbe, load_probe
from probes.features import layer_features
from probes.schema import APPLY_HINTS, APPLY_QUOTED, APPLY_RENAMED, ApplyProbeSchema
from probes.token_view import token_view, view_html

log = logging.getLogger("apply_probe")
MAX_VIEW = 50      # statements on one per-token page at most


def trained_probe(cell_file) -> tuple[FittedProbe, dict]:
    """The saved probe of a train_probe cell and the cell's config."""
    probe = load_probe(cell_file)
    config = probe.cell["config"]
    if "split" not in probe.cell or not {"model", "data", "task"} <= set(config):
        raise CellError(f"{cell_file} is not a result cell of train_probe (no model, datapack, task or split)")
    return probe, config


def transfer_path(results_dir, cell: dict, eval_datapack: str) -> Path:
    """Where the transfer cell of a probe's cell on `eval_datapack` lives (names checked by cell_path)."""
    config = cell["config"]
    train = config["data"]["name"]
    own = cell_path(results_dir, config["model"]["name"], train, config["probe"]["name"], config["task"]["name"],
                    cell["split"]["kind"], cell["layer"], config["seed"])
    folder = f"{train}->{check_name(eval_datapack, 'data.name')}"
    return own.parents[5] / folder / own.relative_to(own.parents[4])


def apply_to_store(cell_file, eval_datapack: str, store_dir, results_dir, overwrite: bool = False,
                   tracker=None) -> Path:
    """Score `eval_datapack`'s store of the probe's model with the probe of `cell_file`; returns the
    transfer cell's path (an existing one is kept unless `overwrite`); `tracker` (evaluation.tracking) logs the
    cell written."""
    probe, config = trained_probe(cell_file)
    path = transfer_path(results_dir, probe.cell, eval_datapack)
    if path.exists() and not overwrite:
        log.info("%s exists (overwrite=true recomputes it)", path)
        return path
    with ActivationStore(store_path(store_dir, config["model"]["name"], eval_datapack)) as store:
        check_same_model(probe.store, store.attrs, str(store.path))
        if probe.layer not in store.layers:
            raise StoreError(f"{store.path} does not hold layer {probe.layer}, the probe's layer (stored: "
                             f"{store.layers}): extract it (layers=...) first")
        table = store.table
        rows, y = task_targets(table["label"].to_numpy(), config["task"]["name"])
        own = eval_datapack == config["data"]["name"]
        positions = np.asarray(probe.cell["test"]["rows"], dtype=np.int64) if own else np.arange(len(rows))
        if own and (positions.max(initial=-1) >= len(rows) or y[positions].tolist() != probe.cell["test"]["y"]):
            raise ToolkitError(f"{store.path} holds other statements than the probe's test rows (re-extracted "
                               "since?): retrain the probe on this store")
        features = layer_features(store, probe.layer, probe.representation, probe.tokens).subset(rows[positions])
        summary = store_summary(store)
        groups = entity_groups(table)[rows[positions]]
    out = probe.score_all(features)
    y = y[positions]
    metrics = cell_metrics(y, out["scores"], out["probs"], out["pred"], out["sets"],
                           groups=resampling_groups(config["bootstrap"], groups), seed=config["seed"],
                           n_boot=config["n_boot"])
    metrics.update(datapack_metrics(eval_datapack, config["task"]["name"], table, rows[positions], out["probs"],
                                    config["seed"], config["n_boot"]))   # e.g. a truth probe on TruthfulQA answers
    cell = result_cell(
        config={**config, "data": {"name": eval_datapack}}, method=probe.cell.get("method"),
        transfer={"probe_cell": str(cell_file), "train_data": config["data"]["name"], "eval_data": eval_datapack,
                  "rows": "the probe's test split" if own else "every statement of the task"},
        layer=probe.layer, split={"kind": probe.cell["split"]["kind"], "scored": "test" if own else "all"},
        store=summary, probe_store=probe.store, metrics=metrics,
        calibration_metrics=probe.cell.get("calibration_metrics", {}),  # of the probe, on its own datapack
        test=cell_test(positions, y, groups, out["scores"], out["probs"], out["sets"], out["pred"]))
    try:
        write_cell(path, cell, replace=overwrite)
        if tracker is not None:
            tracker.log_cell(path)
    except WrittenMeanwhile:     # another run of this probe on this store: the same cell, kept
        log.info("%s was written meanwhile by another run of this probe and store: kept", path)
    log.info("%s -> %s: MCC %.3f, W-MCC %.3f, acceptance %.3f (%d statements): %s", config["data"]["name"],
             eval_datapack, metrics["mcc"], metrics["wmcc"], metrics["acceptance"], metrics["n"], path)
    predicted = np.unique(np.asarray(out["pred"])[np.asarray(out["pred"]) >= 0])
    if len(predicted) == 1:
        log.warning("the probe predicted one label (%s) for every statement it did not abstain on: MCC is 0 by "
                    "definition there, not a measured chance level", class_names(config["task"]["name"])[int(predicted[0])])
    return path


def class_names(task: str) -> list[str]:
    """Names of a task's classes 0..K-1: false / true / neither, or "not <positive>" / "<positive>"."""
    if task == "multiclass":
        return [LABELS[k] for k in sorted(LABELS)]
    positive = LABELS[POSITIVE[task]]
    return ["false" if task == "true_vs_false" else f"not {positive}", positive]


def apply_to_statements(cell_file, statements: list[str], store_dir, results_dir, name: str = "text",
                        batch_tokens: int = 4096, device: str = "auto", overwrite: bool = False,
                        view: str | None = None) -> Path:
    """Score `statements` with the probe of `cell_file`, extracting them now with the model of the
    probe's store (its recorded config); prints one line per statement and writes
    <results_dir>/<model>/apply/<name>.<datapack>.<method>.<task>.layer=<k>.seed=<s>.json (an earlier
    one is refused before any work unless `overwrite`: give another `name`): per statement its probabilities,
    set and label, and its tokens (those the probe reads) with their scores at the probe's layer
    (FittedProbe.token_scores). `view="html"`: the per-token page beside it (.html, every stored layer)."""
    probe, config = trained_probe(cell_file)
    model, train = config["model"]["name"], config["data"]["name"]
    stem = ".".join([name, train, config["probe"]["name"], config["task"]["name"], f"layer={probe.layer}",
                     f"seed={config['seed']}"])
    out_path = Path(results_dir) / check_name(model, "model.name") / "apply" / f"{check_name(stem, 'name')}.json"
    outputs = [out_path] + ([out_path.with_suffix(".html")] if view else [])
    for path in outputs:
        if path.exists() and not overwrite:
            raise ToolkitError(f"{path} exists (an earlier run with name={name}): give name=<another name>, or "
                               "overwrite=true to replace it")
    if view and len(statements) > MAX_VIEW:
        raise ToolkitError(f"view=html shows at most {MAX_VIEW} statements ({len(statements)} given): score them "
                           "without view=, or view a few")
    with ActivationStore(store_path(store_dir, model, train)) as store:
        attrs, where = store.attrs, f"the model recorded in {store.path}"
    loaded = store_model(attrs, device)
    check_same_model(probe.store, {**attrs, **model_attrs(loaded)}, where)
    memory = extract_statements(loaded, statements, [int(k) for k in attrs["layers"]] if view else probe.layer,
                                attrs["dtype"], batch_tokens)
    out = probe.score_all(layer_features(memory, probe.layer, probe.representation, probe.tokens))
    names = class_names(config["task"]["name"])
    token_text = partial(token_strings, loaded.tokenizer)
    views = [token_view(probe, memory, i, text, token_text, names, None if view else [probe.layer])
             for i, text in enumerate(statements)]
    results = []
    for i, text in enumerate(statements):
        in_set = [names[k] for k in np.flatnonzero(out["sets"][i])]
        pred = int(out["pred"][i])
        results.append({"statement": text, "probs": dict(zip(names, out["probs"][i].tolist())),
                        "set": in_set, "pred": names[pred] if pred >= 0 else None,
                        "scores": out["scores"][i].tolist(), "tokens": views[i]["tokens"],
                        "token_scores": views[i]["layers"][probe.layer]["scores"]})
        probs = ", ".join(f"p({n})={p:.3f}" for n, p in zip(names, out["probs"][i]))
        print(f"{probs}  set={{{', '.join(in_set)}}}  {'-> ' + names[pred] if pred >= 0 else 'abstains'}  {text}")
    record = {"probe_cell": str(cell_file), "model": config["model"]["name"], "train_data": config["data"]["name"],
              "task": config["task"]["name"], "method": config["probe"]["name"], "layer": probe.layer,
              "alpha": config["alpha"], "classes": names, "statements": results}
    write_record(out_path, record, {"probe_cell": str(cell_file), "statements": statements, "name": name,
                                    "batch_tokens": batch_tokens, "device": device}, indent=1, replace=overwrite)
    log.info("%d statements scored: %s", len(statements), out_path)
    if view:
        write_view(outputs[1], views, probe, config, loaded.label, overwrite)
    return out_path


def view_row(cell_file, eval_datapack: str, row: int, store_dir, results_dir, overwrite: bool = False,
             device: str = "auto") -> Path:
    """The per-token page of row `row` of `eval_datapack`'s store (the probe's model; every stored layer), at
    <results_dir>/<model>/apply/row=<r>.<datapack>.<train>.<method>.<task>.layer=<k>.seed=<s>.html."""
    probe, config = trained_probe(cell_file)
    model = config["model"]["name"]
    stem = ".".join([f"row={row}", check_name(eval_datapack, "data.name"), config["data"]["name"],
                     config["probe"]["name"], config["task"]["name"], f"layer={probe.layer}", f"seed={config['seed']}"])
    path = Path(results_dir) / check_name(model, "model.name") / "apply" / f"{stem}.html"
    if path.exists() and not overwrite:
        raise ToolkitError(f"{path} exists: overwrite=true replaces it")
    with ActivationStore(store_path(store_dir, model, eval_datapack)) as store:
        check_same_model(probe.store, store.attrs, str(store.path))
        if not 0 <= row < store.n_statements:
            raise ToolkitError(f"row={row}: {store.path} holds rows 0..{store.n_statements - 1}")
        if probe.layer not in store.layers:
            raise StoreError(f"{store.path} does not hold layer {probe.layer}, the probe's layer: extract it first")
        loaded = store_model(store.attrs, device)
        statement = str(store.table["statement"].iloc[row])
        view = token_view(probe, store, row, statement, partial(token_strings, loaded.tokenizer),
                          class_names(config["task"]["name"]))
    write_view(path, [view], probe, config, loaded.label, overwrite)
    return path


def token_strings(tokenizer, ids) -> list[str]:
    """Each token id [T] as the text it stands for (decoded alone: a leading space shows as one)."""
    return [tokenizer.decode([int(i)]) for i in ids]


def write_view(path: Path, views: list[dict], probe: FittedProbe, config: dict, model_label: str,
               overwrite: bool) -> None:
    """The per-token page of `views` at `path` (probes.token_view.view_html), whole or not at all."""
    title = f"{config['probe']['name']} {config['task']['name']}, layer {probe.layer}: token by token"
    about = (f"Probe {config['probe']['name']} for {config['task']['name']} fitted on {config['data']['name']} at "
             f"layer {probe.layer} of {model_label} (alpha = {config['alpha']}).")
    page = view_html(views, title, about).encode()
    atomic_write(path, lambda f: f.write(page), replace=overwrite)
    log.info("per-token view: %s", path)




def raw_text(cfg: DictConfig):
    """`text=` as written (None if not given): user text is data, and the command line escapes `${...}`
    (toolkit.entry.quoted), so an interpolation or an environment variable, set or not, is scored as
    those characters."""
    return OmegaConf.to_container(cfg, resolve=True).get("text")


def validate(cfg: DictConfig) -> dict:
    """The options other than `text`, typed by ApplyProbeSchema (a value it cannot read, e.g.
    overwrite=maybe, is one ToolkitError line naming it), with batch_tokens and an explicit name checked."""
    options = {k: v for k, v in OmegaConf.to_container(cfg, resolve=False).items() if k != "text"}
    if isinstance(options.get("data"), dict):   # of a data group only the datapack's name is used here
        options["data"] = {"name": options["data"].get("name")}
    checked = typed_options(OmegaConf.create(options), ApplyProbeSchema, APPLY_HINTS)
    check_count(checked["batch_tokens"], "batch_tokens")
    if checked["name"] is not None:
        check_name(checked["name"], "name")
    resolve_device(checked["device"], "device")
    check_tracker(checked["tracker"])
    if checked["row"] is not None and checked["row"] < 0:
        raise ToolkitError(f"row={checked['row']}: give {APPLY_HINTS['row']}")
    if checked["row"] is not None and checked["data"] is None:
        raise ToolkitError(f"row={checked['row']} names a row of a datapack's store: give data=<datapack> too")
    return checked


def text_statements(text) -> list[str]:
    """The statements of `text=` (one or a list), each a string (a number, null or a mapping in the list
    is refused: quote it)."""
    items = text if isinstance(text, list) else [text]
    for i, item in enumerate(items):
        if not isinstance(item, str):
            raise ToolkitError(f"text=: item {i + 1} is {item!r} ({type(item).__name__}), not a statement: give "
                               "statements as quoted strings, e.g. text=\"['1984 is a year.', 'Paris is in France.']\"")
    return [t.strip() for t in items]


def csv_statements(csv: str) -> list[str]:
    """The `statement` column of the CSV file `csv`, one per row: a blank or whitespace-only row is refused
    with its row number (dropping it would shift every later result against the file's rows)."""
    try:
        frame = pd.read_csv(csv, dtype=str, keep_default_na=False, skip_blank_lines=False)
    except (OSError, pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as err:
        raise ToolkitError(f"csv={csv}: not a readable CSV ({str(err).splitlines()[0]})") from None
    if "statement" not in frame:
        raise ToolkitError(f"csv={csv}: no column 'statement' (columns: {list(frame.columns)})")
    statements = frame["statement"].str.strip()
    blank = [i + 2 for i in np.flatnonzero((statements == "").to_numpy())]      # the header is row 1
    if blank:
        raise ToolkitError(f"csv={csv}: row{'s' if len(blank) > 1 else ''} {', '.join(map(str, blank[:5]))}"
                           f"{', ...' if len(blank) > 5 else ''} (the header is row 1) hold{'s' if len(blank) == 1 else ''} "
                           "no statement: remove the row or write its statement")
    return statements.tolist()


def default_name(csv: str | None) -> str:
    """The output name of text= / csv= scores when name= is not given: `text`, or the CSV file's stem made
    one safe file name (`my statements.csv` -> `my_statements`; `csv` if nothing of it is left)."""
    if csv is None:
        return "text"
    safe = re.sub(r"\.{2,}", ".", re.sub(r"[^A-Za-z0-9._+=,-]+", "_", Path(csv).stem)).lstrip("._+=,-")
    return safe or "csv"


def apply(cfg: DictConfig):
    """The command: exactly one of data= (a store), text= or csv= (statements); every option is checked
    before any work."""
    text = raw_text(cfg)
    opts = validate(cfg)
    given = [k for k, v in (("data", opts["data"]), ("text", text), ("csv", opts["csv"])) if v is not None]
    if len(given) != 1:
        raise ToolkitError(f"give exactly one of data=<datapack>, text=\"...\" or csv=<file> (got "
                           f"{', '.join(given) or 'none'})")
    if opts["cell"] is None:
        raise ToolkitError("probe=<cell.json> is required: the result cell whose saved probe to apply")
    if given == ["data"]:
        if not isinstance(opts["data"], dict) or opts["data"].get("name") is None:
            raise ToolkitError("data= names no datapack: give data=<datapack> (or data=csv data.name=<store name>)")
        if opts["row"] is not None:
            if opts["view"] is None:
                raise ToolkitError(f"row={opts['row']} is read by view=html only: add view=html, or drop row=")
            return view_row(opts["cell"], opts["data"]["name"], opts["row"], opts["store_dir"], opts["results_dir"],
                            opts["overwrite"], opts["device"])
        with tracking(opts["tracker"], opts["tracker_dir"], opts["results_dir"]) as tracker:
            return apply_to_store(opts["cell"], opts["data"]["name"], opts["store_dir"], opts["results_dir"],
                                  opts["overwrite"], tracker)
    statements = text_statements(text) if given == ["text"] else csv_statements(opts["csv"])
    if not statements or any(s == "" for s in statements):
        raise ToolkitError(f"{given[0]}=: an empty statement or none at all: give text to score")
    return apply_to_statements(opts["cell"], statements, opts["store_dir"], opts["results_dir"],
                               opts["name"] or default_name(opts["csv"]), opts["batch_tokens"], opts["device"],
                               opts["overwrite"], opts["view"])


def hydra_arguments(args: list[str]) -> list[str]:
    """Command-line arguments as Hydra overrides: `probe=<path>` becomes `cell='<path>'` (`probe` is a
    config group, and cell paths hold `=`); `cell=`, `csv=`, `text=` values are taken as written
    (toolkit.entry.quoted; `text=[...]` lists are left as written)."""
    return quoted(args, APPLY_QUOTED, APPLY_RENAMED)
