"""Part sizes, drops and entity overlap of the default entity-disjoint split on the Trilemma datapacks.

    python -m experiments.split_stats            # a Markdown table on stdout (about 10 s)

One row per datapack and `disjoint_calibration_test` setting (the conf/split/entity_disjoint.yaml
config with split_seed 0; `true` is the default): the train / calibration / test / dropped counts,
the dropped share of the datapack, the subject entities (object_1) and all entities (object_1 and
object_2, the split's entity_columns) that calibration shares with test, and the share of test rows
whose subject / any entity occurs in calibration.
"""
from __future__ import annotations

import pandas as pd
from omegaconf import OmegaConf

from evaluation.splits import make_split
from toolkit.config import compose_config
from extract.statements import TRILEMMA, load_statements


def mentioned(table, rows, columns) -> set:
    """Distinct non-empty strings of `columns` in `rows`."""
    return {v for c in columns for v in table[c].to_numpy()[rows].tolist()} - {""}


def rows() -> list[dict]:
    cfg = OmegaConf.to_container(compose_config("train_probe", "split=entity_disjoint").split, resolve=True)
    out = []
    for name in TRILEMMA:
        table = load_statements(name)
        for disjoint in (False, True):
            split = make_split(table, **{**cfg, "disjoint_calibration_test": disjoint})
            summary = split.summary()
            cal_subjects = mentioned(table, split.calibration, ["object_1"])
            cal_entities = mentioned(table, split.calibration, summary["params"]["entity_columns"])
            test_subjects = table["object_1"].to_numpy()[split.test]
            out.append({"datapack": name, "disjoint_calibration_test": disjoint, **split.sizes(),
                        "dropped %": round(100 * summary["dropped_fraction"], 1),
                        "cal/test shared subjects": len(cal_subjects & set(test_subjects)),
                        "cal/test shared entities": len(cal_entities & mentioned(
                            table, split.test, summary["params"]["entity_columns"])),
                        "test rows with a cal subject %": round(
                            100 * float(pd.Series(test_subjects).isin(cal_subjects).mean()), 1),
                        "test rows with a cal entity %": round(
                            100 * summary["test_rows_sharing_calibration_entity"], 1)})
    return out


def main() -> None:
    table = rows()
    header = list(table[0])
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in table:
        print("| " + " | ".join(str(row[k]).lower() if isinstance(row[k], bool) else str(row[k])
                               for k in header) + " |")


if __name__ == "__main__":
    main()
