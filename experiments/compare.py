"""`python -m experiments.compare A.json B.json [--n-boot 1000] [--seed 0]`: is cell A better than B?

(Plain arguments, not Hydra overrides: cell paths contain `=`, which Hydra's override grammar
would need quoted.)

Both cells must hold the same test rows (same datapack, task and split): probe vs probe, layer vs
layer, probe vs zero-shot. Paired bootstrap intervals and two-sided p-values (whole subject entities
resampled when the cells record their groups, else statements) of the differences a - b of each
estimand in ESTIMANDS, and McNemar's exact test twice: on the statements both accept, and on the
plain predictions of all statements. "mcc" compares each cell on its *own* accepted statements
(different rows for a and b when they abstain differently); "mcc_all" is the like-for-like
comparison without abstention.
"""
from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import numpy as np

from evaluation.cell_metrics import raw_auroc
from evaluation.cells import CellError
from evaluation.metrics import abstain_mcc, as_probs, mcc, wmcc
from evaluation.selective import aurc, mcnemar_exact, paired_bootstrap, paired_bootstrap_diff
from experiments.tables import report_cell
from toolkit.errors import check_count, run_entry

log = logging.getLogger(__name__)
ESTIMANDS = {   # what each key of compare_cells' result measures; every table names its rows' estimand thus
    "mcc": "MCC on accepted rows (conformal, abstentions excluded: each cell's own accepted rows)",
    "wmcc": "W-MCC (MCC on accepted rows x acceptance, all rows)",
    "mcc_all": "MCC without abstention (argmax, all rows)",
    "aurc": "AURC of the argmax prediction ranked by its confidence (all rows; lower is better)",
    "auroc": "AUROC of the raw probe scores (all rows; multiclass: one-vs-rest macro)",
    "mcnemar": "McNemar exact, conformal predictions, rows both cells accept",
    "mcnemar_all": "McNemar exact, argmax predictions, all rows",
}


def compare_cells(a: dict, b: dict, n_boot: int = 1000, seed: int = 0, names=("a", "b")) -> dict:
    """Paired comparison of two cells' test predictions (see the module docstring)."""
    ta, tb = a["test"], b["test"]
    if ta["rows"] != tb["rows"] or ta["y"] != tb["y"]:
        raise CellError(f"{names[0]} and {names[1]} were evaluated on different test rows: compare cells of the "
                        "same datapack, task and split")
    y = np.asarray(ta["y"], dtype=np.int64)
    groups = np.asarray(ta["groups"]) if ta.get("groups") is not None else None
    pred = [np.asarray(t["pred"], dtype=np.int64) for t in (ta, tb)]
    probs = [as_probs(np.asarray(t["probs"])) for t in (ta, tb)]
    plain, conf = [p.argmax(1) for p in probs], [p.max(1) for p in probs]

    scores = [np.asarray(t["scores"], dtype=np.float64) for t in (ta, tb)]

    def aurc_diff(i):
        return aurc(y[i], plain[0][i], conf[0][i]) - aurc(y[i], plain[1][i], conf[1][i])

    def auroc_diff(i):
        a_, b_ = raw_auroc(y[i], scores[0][i]), raw_auroc(y[i], scores[1][i])
        return np.nan if a_ is None or b_ is None else a_ - b_

    return {"n": int(y.size), "bootstrap": "iid" if groups is None else "cluster", "n_boot": int(n_boot),
            "mcc": paired_bootstrap_diff(y, *pred, abstain_mcc, groups=groups, n_boot=n_boot, seed=seed),
            "wmcc": paired_bootstrap_diff(y, *pred, wmcc, groups=groups, n_boot=n_boot, seed=seed),
            "mcc_all": paired_bootstrap_diff(y, *plain, mcc, groups=groups, n_boot=n_boot, seed=seed),
            "aurc": paired_bootstrap(aurc_diff, y.size, groups=groups, n_boot=n_boot, seed=seed),
            "auroc": paired_bootstrap(auroc_diff, y.size, groups=groups, n_boot=n_boot, seed=seed),
            "mcnemar": mcnemar_exact(y, *pred), "mcnemar_all": mcnemar_exact(y, *plain)}


def compare(args: argparse.Namespace) -> dict:
    """The comparison of the command line's two cells (each checked: experiments.tables.report_cell), logged
    and printed as JSON; --n-boot must be >= 1."""
    n_boot = check_count(args.n_boot, "--n-boot")
    result = compare_cells(report_cell(args.a), report_cell(args.b), n_boot, args.seed)
    for key in ("mcc", "wmcc", "mcc_all", "aurc", "auroc"):
        r = result[key]
        log.info("%s, a - b: %+.3f [%+.3f, %+.3f] (p = %.3g, %s bootstrap)", ESTIMANDS[key], r["diff"], *r["ci"],
                 r["p_value"], result["bootstrap"])
    for key in ("mcnemar", "mcnemar_all"):
        m = result[key]
        log.info("%s (%d statements): a right / b wrong %d, a wrong / b right %d, p = %.3g", ESTIMANDS[key],
                 m["n_both"], m["b"], m["c"], m["p_value"])
    print(json.dumps(result, indent=1))
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.compare", description=__doc__.splitlines()[0])
    parser.add_argument("a", type=Path, help="a result cell (.json)")
    parser.add_argument("b", type=Path, help="another cell with the same test rows")
    parser.add_argument("--n-boot", type=int, default=1000, help="paired bootstrap resamples")
    parser.add_argument("--seed", type=int, default=0)
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s %(levelname)s] %(message)s", datefmt="%H:%M:%S")
    run_entry(compare, parser.parse_args(argv), log=log)


if __name__ == "__main__":
    main()
