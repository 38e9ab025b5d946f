"""A fitted probe as a folder in the Hugging Face model-repository layout: a *probe card*.

    README.md           YAML metadata (base model, its fingerprint and quantisation, tokenizer fingerprint,
                        chat-template hash, layer, token selection, task and label coding, datapack and its
                        sha256, split, metrics with intervals, conformal thresholds, command and commit),
                        then what the probe is and what its abstaining means
    model.safetensors   the heads' tensors (probes.saved_pair.heads_bytes: the same bytes as a cell's heads)
    config.json         the probe's part of a result cell (FittedProbe.to_cell), its evaluation where it has
                        one (metrics, split, method, task, provenance), and the sha256 and size of the other
                        two files

`save_card` writes the folder whole or not at all (a staging folder renamed into place); `read_card` (and so
`probes.artifacts.load_probe(folder)`) refuses, in one line, a card whose files do not match the hashes its
config.json records. Uploading is `huggingface_hub.HfApi().upload_folder(repo_id=..., folder_path=folder)`.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load as load_tensors

from evaluation.cells import CellError

from toolkit.disk import atomic_write
from evaluation.tasks import POSITIVE, TASKS
from extract.statements import LABELS
from probes.saved_pair import heads_bytes

CARD_FORMAT = "truthprobe-probe-card/1"
FILES = ("README.md", "model.safetensors")


def save_card(probe, folder, store=None, overwrite: bool = False) -> Path:
    """Write `probe` (a FittedProbe) as a card at `folder`; `store` (an ActivationStore, optional) gives the
    sha256 of the statements it was fitted on. An existing folder is refused unless `overwrite`."""
    folder = Path(folder)
    if folder.exists() and not overwrite:
        raise CellError(f"{folder} exists: choose another folder for the probe card, or overwrite=True")
    evaluated, own = probe.cell or {}, probe.to_cell()
    cell = {**evaluated, **own, "config": {**(evaluated.get("config") or {}), **own["config"]}}
    weights = heads_bytes(probe.heads, probe.layer)
    readme = card_readme(cell, datapack_sha256(store)).encode()
    config = {"format": CARD_FORMAT, "cell": {k: v for k, v in cell.items() if k not in ("test", "heads")},
              "files": {name: {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
                        for name, data in zip(FILES, (readme, weights))}}
    staging = folder.with_name(f".{folder.name}.staging-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        for name, data in zip((*FILES, "config.json"), (readme, weights, json.dumps(config, indent=1).encode())):
            atomic_write(staging / name, lambda f, data=data: f.write(data))
        if folder.exists():
            shutil.rmtree(folder)
        os.rename(staging, folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def is_card(path) -> bool:
    """Whether `path` is a folder holding a probe card's config.json."""
    return Path(path).is_dir() and (Path(path) / "config.json").is_file()


def read_card(folder) -> tuple[dict, dict[str, torch.Tensor]]:
    """(the card's cell block, the heads' tensors), after checking README.md and model.safetensors against the
    sizes and sha256 config.json records: a mismatch is one CellError naming the file."""
    folder = Path(folder)
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CellError(f"{folder / 'config.json'} is not a readable probe card config ({err})") from None
    if not isinstance(config, dict) or config.get("format") != CARD_FORMAT or not isinstance(config.get("files"), dict):
        raise CellError(f"{folder} is not a probe card of this toolkit (config.json has no format {CARD_FORMAT!r})")
    data = {}
    for name in FILES:
        record = config["files"].get(name) or {}
        try:
            data[name] = (folder / name).read_bytes()
        except OSError as err:
            raise CellError(f"{folder / name}: cannot read it ({err.strerror or err}): the card is incomplete") from None
        if len(data[name]) != record.get("bytes") or hashlib.sha256(data[name]).hexdigest() != record.get("sha256"):
            raise CellError(f"{folder / name} does not match the sha256 and size config.json records: the card was "
                            "changed after it was written; save it again from its result cell")
    return config["cell"], load_tensors(data["model.safetensors"])


def datapack_sha256(store) -> str | None:
    """The sha256 of the statements a store keeps (its `statements_sha256`, or computed for an older store)."""
    if store is None:
        return None
    from extract.store_writer import statement_columns, statements_digest

    recorded = store.attrs.get("statements_sha256")
    return str(recorded) if recorded is not None else statements_digest(statement_columns(store.table))


def template_sha256(text: str | None) -> str | None:
    return hashlib.sha256(text.encode()).hexdigest() if text else None


def card_readme(cell: dict, statements_sha256: str | None) -> str:
    """README.md of a card: YAML metadata (the fields of the module docstring), then prose."""
    store, config = cell.get("store") or {}, cell.get("config") or {}
    task = (config.get("task") or {}).get("name")
    spec, metrics = config.get("probe") or {}, cell.get("metrics") or {}
    prov, conformal = cell.get("provenance") or {}, cell.get("conformal") or {}
    coding = ({"0": "false", "1": "true", "2": "neither"} if task == "multiclass" else
              {"1": LABELS[POSITIVE[task]], "0": "rest" if task != "true_vs_false" else "false"} if task in TASKS else None)
    meta = {
        "library_name": "truthprobe", "tags": ["probing", "truthfulness", "conformal-prediction"],
        "base_model": store.get("model_id"), "base_model_label": store.get("model_label"),
        "model_fingerprint": store.get("model_fingerprint"), "tokenizer_fingerprint": store.get("tokenizer_fingerprint"),
        "chat_template": store.get("chat_template"), "chat_template_sha256": template_sha256(store.get("chat_template_text")),
        "system_prompt": store.get("system_prompt"), "compute_dtype": store.get("compute_dtype"),
        "stored_dtype": store.get("dtype"), "layer": cell.get("layer"), "hidden_size": store.get("hidden_size"),
        "probe": spec.get("name"), "tokens": spec.get("tokens"), "representation": spec.get("representation"),
        "task": task, "target_coding": coding, "datapack_labels": {str(k): v for k, v in LABELS.items()},
        "datapack": (config.get("data") or {}).get("name") or store.get("datapack"),
        "datapack_statements_sha256": statements_sha256,
        "split": {k: (cell.get("split") or {}).get(k) for k in ("kind", "seed", "sizes", "fingerprint")},
        "metrics": {k: metrics.get(k) for k in ("mcc", "mcc_ci", "wmcc", "wmcc_ci", "acceptance", "auroc",
                                                "auroc_ci", "ece", "n") if k in metrics},
        "conformal": {k: conformal.get(k) for k in ("method", "alpha", "mondrian", "thresholds", "n_cal")},
        "command": " ".join(prov.get("command") or []) or None, "git_commit": prov.get("git_commit"),
        "git_dirty": prov.get("git_dirty"), "toolkit_version": prov.get("toolkit_version"),
    }
    lines = ["---", *(f"{k}: {json.dumps(v)}" for k, v in meta.items()), "---", "",
             f"# {spec.get('name')} probe, {task}, layer {cell.get('layer')} of {store.get('model_label')}", "",
             f"A probe of the toolkit truthprobe, fitted on the hidden states after block {cell.get('layer')} "
             f"({spec.get('representation')} of the {spec.get('tokens')} tokens) of the datapack "
             f"{meta['datapack']} (split {meta['split']['kind']}). It gives class probabilities and a "
             f"split-conformal prediction set at level alpha = {conformal.get('alpha')}: a set of more than one "
             "class is an abstention (the probe does not commit to a label), guaranteed to hold the true class "
             f"with probability >= 1 - alpha on statements like the calibration split's.", "",
             "Load it with `probes.artifacts.load_probe(<this folder>)` (it checks README.md and model.safetensors "
             "against config.json's sha256), apply it with `python -m apply_probe probe=<this folder> text=...`.",
             ""]
    if metrics:
        lines += [f"Test split: MCC {metrics.get('mcc')} (95 % interval {metrics.get('mcc_ci')}), W-MCC "
                  f"{metrics.get('wmcc')}, acceptance {metrics.get('acceptance')}, n = {metrics.get('n')}.", ""]
    return "\n".join(lines)
