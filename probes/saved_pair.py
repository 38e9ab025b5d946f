"""A result cell and its fitted heads as one pair on disk:

    results/.../layer=<k>/seed=<s>.json                         the cell (`heads`: file, sha256, bytes)
    results/.../layer=<k>/seed=<s>.<sha16>.probe.safetensors    the heads' tensors (head<i>.<name>)

The heads file is named by its content hash and the cell, renamed into place last, names it
(write_probe_cell); read_heads checks the file's size and sha256 against the cell before parsing it.
"""
from __future__ import annotations

import hashlib
import json
import re
from glob import escape as glob_escape
from pathlib import Path

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from evaluation.cells import CellError, check_same_settings, read_cell, write_cell

from toolkit.disk import atomic_write
from toolkit.disk import waiting_lock
from toolkit.errors import check_name
from probes.base import Probe

SUFFIX = ".probe.safetensors"


def artifact_path(cell_file: Path) -> Path:
    """The heads' file a cell names (its `heads.file`, beside it): seed=<s>.<sha16>.probe.safetensors."""
    cell_file = Path(cell_file)
    heads = read_cell(cell_file).get("heads")
    if not isinstance(heads, dict) or not isinstance(heads.get("file"), str):
        raise CellError(f"{cell_file} names no saved probe (written by an older version): rerun train_probe "
                        "with overwrite=true")
    return cell_file.with_name(check_name(heads["file"], "heads.file"))


def heads_bytes(heads: list[Probe], layer: int | None) -> bytes:
    """Every tensor of every head's state_dict, as `head<i>.<name>`, in safetensors format, the layer the
    heads were fitted at in its metadata (`layer`: a cell whose `layer` was edited is refused on reading)."""
    tensors = {f"head{i}.{k}": v.detach().cpu().contiguous() for i, head in enumerate(heads)
               for k, v in head.state_dict().items() if isinstance(v, torch.Tensor)}
    return save_tensors(tensors, metadata={"layer": json.dumps(layer)})


def _metadata(data: bytes) -> dict:
    """The `__metadata__` of safetensors bytes (its header: 8 bytes of length, then JSON)."""
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n]).get("__metadata__") or {}


def write_probe_cell(path: Path, cell: dict, heads: list[Probe], overwrite: bool = True) -> bool:
    """A cell and its fitted heads as one pair. The heads go to a file named by their content hash
    (seed=<s>.<sha16>.probe.safetensors), the cell, written last, names that file and its sha256 and
    size: the cell's rename is the one commit point, so any interruption leaves the old pair or the new
    one. Heads no cell names (the old pair's, a killed writer's) are removed; a per-cell lock file
    (.seed=<s>.json.lock, kept) serialises concurrent writers of one cell. Under that lock, a cell found
    at `path` is never replaced by one without evaluation (a saved probe: its `metrics` empty) when it
    holds one, and with ``overwrite=False`` (another run wrote it meanwhile) it is kept when made with the
    same settings (returns False) and refused when not (CellError). Returns True when written."""
    path = Path(path)
    data = heads_bytes(heads, cell.get("layer"))
    digest = hashlib.sha256(data).hexdigest()
    heads_file = path.with_name(f"{path.stem}.{digest[:16]}{SUFFIX}")
    path.parent.mkdir(parents=True, exist_ok=True)
    with _cell_lock(path):
        if path.exists():
            if not cell.get("metrics") and _evaluated(path):
                raise CellError(f"{path} is an evaluated result cell: saving a probe there would erase its "
                                "metrics and test rows; save to another path")
            if not overwrite:
                check_same_settings(path, cell["config"])
                return False
        atomic_write(heads_file, lambda f: f.write(data))
        try:
            write_cell(path, {**cell, "heads": {"file": heads_file.name, "sha256": digest, "bytes": len(data)}})
        finally:
            _remove_unnamed_heads(path)
    return True


def _evaluated(cell_file: Path) -> bool:
    """Whether the cell at `cell_file` holds an evaluation (metrics); an unreadable one holds nothing."""
    try:
        return bool(read_cell(cell_file).get("metrics"))
    except CellError:
        return False


def _remove_unnamed_heads(cell_file: Path) -> None:
    """Delete the heads files of `cell_file`'s stem that its cell does not name (all of them if the cell
    does not exist or is unreadable: they belong to no pair)."""
    try:
        keep = read_cell(cell_file).get("heads", {}).get("file")
    except CellError:
        keep = None
    for f in cell_file.parent.glob(f"{glob_escape(cell_file.stem)}*{SUFFIX}"):
        rest = f.name[len(cell_file.stem):-len(SUFFIX)]
        if f.name != keep and (rest == "" or re.fullmatch(r"\.[0-9a-f]{16}", rest)):
            f.unlink(missing_ok=True)


def _cell_lock(cell_file: Path):
    return waiting_lock(cell_file.with_name(f".{cell_file.name}.lock"), lambda err: CellError(
        f"cannot write in {cell_file.parent} ({err.strerror or err}): free space or choose another output folder"))


def read_heads(cell_file: Path, cell: dict) -> dict[str, torch.Tensor]:
    """The tensors of the heads file the cell names, after checking its size and sha256 against the
    cell's record (before parsing it); any mismatch or damage is one CellError naming both files."""
    heads = cell.get("heads")
    if not isinstance(heads, dict) or not {"file", "sha256", "bytes"} <= set(heads):
        raise CellError(f"{cell_file} names no saved probe (written by an older version): rerun train_probe "
                        "with overwrite=true")
    weights = Path(cell_file).with_name(check_name(str(heads["file"]), "heads.file"))
    try:
        size = weights.stat().st_size
        if size != heads["bytes"]:
            raise CellError(f"{weights} has {size} bytes, but {cell_file} records {heads['bytes']}: it is not the "
                            "probe this cell was fitted with; rerun train_probe with overwrite=true")
        data = weights.read_bytes()
    except FileNotFoundError:
        raise CellError(f"{cell_file} has no saved probe ({weights.name}): rerun train_probe with overwrite=true") \
            from None
    except OSError as err:
        raise CellError(f"cannot read {weights} ({err.strerror or err})") from None
    if hashlib.sha256(data).hexdigest() != heads["sha256"]:
        raise CellError(f"{weights} does not match the sha256 that {cell_file} records: it is not the probe this "
                        "cell was fitted with; rerun train_probe with overwrite=true")
    try:
        tensors, metadata = load_tensors(data), _metadata(data)
    except Exception as err:   # safetensors raises its own error types
        raise CellError(f"{weights} is not a readable probe ({err}): rerun train_probe with overwrite=true") from None
    if "layer" in metadata and json.loads(metadata["layer"]) != cell.get("layer"):   # (heads of older versions: none)
        raise CellError(f"{cell_file} says layer {cell.get('layer')}, but its heads were fitted at layer "
                        f"{json.loads(metadata['layer'])}: the cell was edited; restore its layer or rerun train_probe")
    return tensors


def cell_of_heads(path: Path) -> Path:
    """The cell of a heads file (seed=<s>[.<sha16>].probe.safetensors -> seed=<s>.json); other paths as given."""
    if not path.name.endswith(SUFFIX):
        return path
    stem = path.name[: -len(SUFFIX)]
    return path.with_name(re.sub(r"\.[0-9a-f]{16}$", "", stem) + ".json")
