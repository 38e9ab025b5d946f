"""Structure-aware probe training (the probe analogue of SAT, Xu et al., arXiv:2601.05905) and its control:
the augmented training inputs of `python -m train_probe augment=structure_aware | neutral`.

structure_aware  every training-part statement about an entity, under each stress context of conf/stress/
                 (contexts.interference.perturbations) whose claims quote training-part statements only
                 (sources = split.train): the target's entity is a training entity, and the neighbour claim
                 is drawn among training statements, so no calibration or test entity enters training.
neutral          the control: the same inputs (targets, number, each context's word count), every context
                 replaced by the neutral passage cut to its word count (contexts.interference.control_text): a
                 context is present, no claim is. Against structure_aware it separates a shift caused by any
                 context from a change of belief under a misleading one.

Each input keeps its target's label (the probe is asked to give the statement the same answer whatever
the context) and its target's entity as its group (cross-validation folds keep an entity's clean and
augmented rows together). per_statement=k keeps k inputs of each target, drawn with the run's seed (the
same draw for both kinds). The inputs are extracted at one layer into
`<store_dir>/<model>/<datapack>.augment-<kind>[-k<k>-seed<s>].<split>-seed<split seed>.L<layer>.h5`
(contexts.stores).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from evaluation.splits import Split
from toolkit.errors import ToolkitError
from extract.store import ActivationStore, check_same_model, store_summary
from contexts.interference import control_text, perturbations
from contexts.stores import extract_inputs, input_store_name
from probes.schema import AUGMENTS


def training_inputs(table: pd.DataFrame, split: Split, stress: dict, neutral: str, kind: str,
                    per_statement: int | None = None, seed: int = 0) -> pd.DataFrame:
    """The augmented inputs (contexts.interference.COLUMNS) of the training statements of `split` that have an
    entity (object_1): `kind` structure_aware or neutral (see the module docstring)."""
    if kind not in AUGMENTS:
        raise ToolkitError(f"augment.kind={kind!r}: use one of {', '.join(AUGMENTS)}")
    train = np.asarray(split.train, dtype=np.int64)
    targets = np.sort(train[table["object_1"].to_numpy()[train] != ""])
    frame = perturbations(table, targets, stress, neutral, sources=train)
    if per_statement is not None and len(frame):
        rng = np.random.default_rng(seed)
        groups = frame.groupby("target_row", sort=True).indices.values()
        frame = frame.iloc[np.sort(np.concatenate([rng.permutation(g)[:per_statement] for g in groups]))]
    if kind == "neutral":
        frame = frame.assign(context=[control_text(neutral, len(c.split())) + "\n" for c in frame["context"]],
                             claim_rows=[[] for _ in range(len(frame))])
    return frame.reset_index(drop=True)


@dataclass
class Augmentation:
    """The augmented training inputs of one run and where their stores go.

    kind, per_statement  the options (conf/augment/)
    frame    the inputs (contexts.interference.COLUMNS), A rows: target_row (the clean table row), label, ...
    name     the stores' purpose, augment-<kind>[-k<k>-seed<s>] (contexts.stores.input_store_name)
    model, store_dir, options, overwrite   how they are extracted (contexts.stores.extract_inputs)
    """
    kind: str
    per_statement: int | None
    frame: pd.DataFrame
    name: str
    model: dict
    store_dir: str
    options: dict
    overwrite: bool

    def store(self, clean: ActivationStore, split: Split, layer: int, datapack: str) -> ActivationStore:
        """The inputs extracted at `layer` (resumed, or kept when complete) in the clean store's dtype, checked
        to be of the clean store's model and to hold the inputs in frame order."""
        name = input_store_name(datapack, self.name, split, [layer])
        store = extract_inputs(self.frame, name, self.model, self.store_dir, [layer], clean.attrs["dtype"],
                               self.overwrite, self.options)
        check_same_model(store_summary(clean), store_summary(store), str(store.path))
        if not np.array_equal(store.table["statement"].to_numpy(), self.frame["statement"].to_numpy()):
            raise ToolkitError(f"{store.path} holds other inputs than this run's augmentation: rerun with "
                               "overwrite=true to re-extract it")
        return store

    def summary(self, store: ActivationStore) -> dict:
        """What a cell records of the augmentation: kind, per_statement, the store, the inputs by
        interference and the training statements they copy."""
        return {"kind": self.kind, "per_statement": self.per_statement, "store": str(store.path),
                "inputs": int(len(self.frame)), "statements": int(self.frame["target_row"].nunique()),
                "by_interference": {str(k): int(v)
                                    for k, v in self.frame["interference"].value_counts(sort=False).items()}}


def augmentation(options: dict, table: pd.DataFrame, split: Split, model: dict, store_dir: str, seed: int,
                 overwrite: bool) -> Augmentation:
    """The Augmentation of train_probe's `augment` options (conf/augment/: kind, per_statement, stress,
    extract) for the clean `table` and its `split`."""
    kind, k = options["kind"], options["per_statement"]
    frame = training_inputs(table, split, options["stress"]["interferences"], options["stress"]["neutral"], kind,
                            k, seed)
    if frame.empty:
        raise ToolkitError(f"augment={kind}: the training statements give no input with a context (no entity with "
                           "a true and a false affirmative statement): augment a datapack with entities")
    name = f"augment-{kind}" + ("" if k is None else f"-k{k}-seed{seed}")
    return Augmentation(kind, k, frame, name, model, store_dir, dict(options["extract"]), overwrite)
