"""Self-consistency, the point-wise baseline NCB is contrasted with (method=zero_shot, every setting run).

The paper samples n answers per target at temperature T and calls a target confident when they agree. An
answer here is one of the prompt's six options (a sampled token that is no option's is no answer, never
the majority). Given a target's S answer distributions q [S, 6] at temperature T (zero_shot.scoring.
PromptScorer: each exact, the probability that a token sampled at T is each option):

    agreement = max_j mean_s q[s, j]      the limit of the share of n samples giving the majority option
    unanimous = sum_j prod_s q[s, j]      the probability that the S sampled answers are all one option

direct: one exact distribution counts for all n samples (S = n copies: unanimous = sum_j q_j ** n), no
sampling. cot: n rationales sampled at T (truthfulqa.generate.Generator, top_p 1, seeded from `seed` and
each batch's first row), each followed by its exact answer distribution. reflection: n first answers drawn
from the direct distribution at T (its six options renormalised, numpy default_rng(seed)), each followed by
the exact distribution of the second turn's answer.

A target has *perfect* self-consistency when unanimous >= 1/2 (n samples agree more often than not; for
direct: q_max >= 2 ** (-1 / n), 0.977 for n = 30). Among the valid test targets with stress inputs whose
setting answers the clean statement right, the perfect ones are counted, their collapse under each
(interference, level) counted (the setting's answer on that input is wrong), and their top / bottom
`fractions` by NCB compared under stress (ncb.stress.stress_results). `expected_unanimous` = the sum of
unanimous over the pool: the expected number of pool targets whose n sampled answers would all agree.
"""
from __future__ import annotations

import numpy as np
import pandas as pd
from omegaconf import DictConfig

from ncb.neighbourhoods import select_groups
from ncb.stress import stress_results

PERFECT = 0.5


def agreement(q: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(agreement [M], unanimous [M], majority [M] int option) of q float [M, S, 6]: M targets' S answer
    distributions over the six options (module docstring)."""
    q = np.asarray(q, dtype=np.float64)
    mean = q.mean(axis=1)
    with np.errstate(divide="ignore"):
        unanimous = np.exp(np.log(q).sum(axis=1)).sum(axis=1)
    return mean.max(axis=1), unanimous, mean.argmax(axis=1)


def draw_first_answers(q: np.ndarray, n: int, seed: int) -> np.ndarray:
    """int [M, n]: n options drawn for each of M targets from q float [M, 6] (temperature-T option
    probabilities, renormalised over the six options), numpy default_rng(seed), targets in order."""
    rng = np.random.default_rng(seed)
    p = np.asarray(q, dtype=np.float64)
    p = p / p.sum(axis=1, keepdims=True)
    return np.stack([rng.choice(p.shape[1], size=n, p=row) for row in p]) if len(p) else np.zeros((0, n), int)


def report(setting: str, rows: np.ndarray, q: np.ndarray, clean: pd.Series, frame: pd.DataFrame,
           correct: np.ndarray, targets: pd.DataFrame, entities: np.ndarray, labels, cfg: DictConfig) -> dict:
    """Self-consistency of one setting on the targets `rows` (int [M], the group pool), q float [M, S, 6].

    clean: bool by row, the setting's answer on the clean statement right; frame / correct: the setting's
    stress inputs of those targets and whether its answer on each is right; targets: belief_targets
    indexed by row; labels: the enumeration's option labels. Returns {counts, collapse, results, targets}."""
    agree, unanimous, majority = agreement(q)
    perfect = (unanimous >= PERFECT) & clean[rows].to_numpy()
    chosen = rows[perfect]
    inputs = frame["target_row"].isin(chosen).to_numpy()
    collapse = []
    for (interference, level), part in frame[inputs].assign(ok=correct[inputs]).groupby(
            ["interference", "level"], sort=False):
        collapse.append({"interference": interference, "level": level, "n": int(len(part)),
                         "collapsed": int((~part["ok"]).sum()), "rate": float((~part["ok"]).mean())})
    ncb = targets.loc[chosen, "ncb"].to_numpy()
    groups = {f: tuple(chosen[g] for g in select_groups(ncb, targets.loc[chosen, "p_y"].to_numpy(), f,
                                                          bool(cfg.balance_by_py), int(cfg.n_bins)))
              for f in cfg.fractions}
    return {"counts": {"targets": int(len(rows)), "clean_correct": int(clean[rows].sum()),
                       "perfect": int(perfect.sum()), "expected_unanimous": float(unanimous.sum())},
            "collapse": collapse,
            "results": stress_results(frame[inputs], correct[inputs], groups, targets, entities, cfg, clean),
            "targets": [{"row": int(r), "setting": setting, "agreement": float(a), "unanimous": float(u),
                         "majority": labels[m], "perfect": bool(p)}
                        for r, a, u, m, p in zip(rows, agree, unanimous, majority, perfect)]}
