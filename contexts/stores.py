"""Stores of inputs with a context (contexts.interference frames): the stress inputs of `python -m ncb` and the
augmented training inputs of `train_probe augment=...` (probes.augment), each extracted at the layers that read
them (one forward pass serves probes at several layers) into a store of its own beside the clean one,

    <store_dir>/<model>/<datapack>.<purpose>.<split kind>-seed<split seed>.L<layer>[-<layer>...].h5  (+ .csv)

by the extraction machinery (extract.run.extract: resumable, a store of other inputs or settings refused),
in the clean store's dtype, so a probe reads them as it reads the clean statements (tokens=statement: the
statement's own tokens, never the context's).
"""
from __future__ import annotations

import pandas as pd

from evaluation.splits import Split
from toolkit.errors import check_name
from extract.run import extract
from extract.store import ActivationStore, store_path
from toolkit.schema import literal_config
from contexts.interference import write_datapack


def input_store_name(datapack: str, purpose: str, split: Split, layers: list[int]) -> str:
    """The datapack name of a context store: `<datapack>.<purpose>.<split kind>-seed<s>.L<layer>[-<layer>...]`
    (layers ascending)."""
    tag = "-".join(str(k) for k in sorted({int(k) for k in layers}))
    return check_name(f"{datapack}.{purpose}.{split.kind}-seed{split.seed}.L{tag}", "data.name")


def extract_inputs(frame: pd.DataFrame, name: str, model: dict, store_dir: str, layers: list[int], dtype: str,
                   overwrite: bool, options: dict) -> ActivationStore:
    """The inputs of `frame` (contexts.interference.COLUMNS) written as the datapack CSV `<name>.csv` and extracted
    at `layers` into the store `<store_dir>/<model name>/<name>.h5` (resumed where a run stopped; overwrite:
    re-extracted). model: the model's config (conf/model/); dtype: the stored dtype (the clean store's);
    options: batch_tokens, window_tokens, window_mb (as python -m extract)."""
    csv = write_datapack(frame, store_path(store_dir, model["name"], name).with_suffix(".csv"))
    config = {"model": model, "data": {"name": name, "source": "csv", "path": str(csv), "statement_column": "statement",
                                       "label_column": None},
              "store_dir": str(store_dir), "layers": sorted({int(k) for k in layers}), "dtype": dtype, "limit": None,
              "overwrite": bool(overwrite), **options}
    return ActivationStore(extract(literal_config(config)))
