"""C grids that bracket the CV optimum (probes.grid.beyond_grid): an optimum planted outside a probe's
default grid is found by extending the grid a decade at a time, equals the choice of a wide grid searched
from the start, and is flagged (probes.pipeline.grid_edge) only where the documented bound stops it."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from probes.base import ProbeError
from probes.grid import beyond_grid
from probes.features import Features
from probes.linear import LinearProbe
from probes.pipeline import grid_edge
from probes.samil import SAwMILProbe
from probes.samil.synthetic import make_planted_bags


def test_beyond_grid_steps_a_decade_outwards_within_the_limits():
    grid = [10.0, 100.0, 1000.0]
    assert beyond_grid(grid, 1000.0, (0.1, 1e5)) == 10000.0
    assert beyond_grid(grid, 10.0, (0.1, 1e5)) == 1.0
    assert beyond_grid(grid, 100.0, (0.1, 1e5)) is None             # interior
    assert beyond_grid([1e3, 1e4, 1e5], 1e5, (0.1, 1e5)) is None      # the bound
    assert beyond_grid(grid, 1000.0, None) is None                   # no extension asked for
    assert beyond_grid([0.001, 0.01], 0.001, (1e-6, 1e4)) == 0.0001


def test_limits_that_do_not_hold_the_grid_are_one_line():
    with pytest.raises(ProbeError, match=r"C_limits=\[1.0, 10.0\] does not contain the grid"):
        LinearProbe(Cs=(0.1, 1.0), C_limits=(1.0, 10.0))
    with pytest.raises(ProbeError, match="C_limits"):
        SAwMILProbe(C_limits=(0.1,))


def _separable(n=1500, d=5, seed=0):
    """Nearly separable rows: the held-out log-loss keeps falling beyond C = 10 (the default grid's top)."""
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d)).astype(np.float32)
    y = (X @ rng.normal(size=d) * 8 + rng.normal(size=n) > 0).astype(int)
    return X, y


def test_linear_finds_an_optimum_above_its_default_grid():
    X, y = _separable()
    fixed = LinearProbe(accelerator="cpu", seed=0, C_limits=None).fit(X, y).params()
    assert fixed["C"] == 10.0 and grid_edge(fixed) == "upper"          # today's grid: stuck at its edge
    extended = LinearProbe(accelerator="cpu", seed=0).fit(X, y)
    wide = LinearProbe(accelerator="cpu", seed=0, Cs=tuple(10.0 ** k for k in range(-3, 5)), C_limits=None).fit(X, y)
    e, w = extended.params(), wide.params()
    assert e["C"] > 10.0 and e["C"] == w["C"] and e["C"] < max(e["Cs"])      # found, and interior
    assert grid_edge(e) is None
    assert e["Cs"] == w["Cs"][: len(e["Cs"])]                                # the decades it searched
    assert e["cv_loss"] == pytest.approx(w["cv_loss"][: len(e["Cs"])], abs=1e-5)
    assert np.allclose(extended.decision_function(X), wide.decision_function(X), atol=1e-4)


def test_linear_at_its_bound_is_flagged():
    X, y = _separable()
    params = LinearProbe(accelerator="cpu", seed=0, C_limits=(1e-3, 100.0)).fit(X, y).params()
    assert params["Cs"][-1] == 100.0
    if params["C"] == 100.0:
        assert grid_edge(params) == "upper"


def _bags(shift=2.5):
    """128-dimensional bags with a weak planted shift: held-out AUROC peaks at C = 1 (0.75; 0.67 at C = 10,
    the default grid's bottom), a strong regulariser's optimum below the grid."""
    X, off, y, _, _ = make_planted_bags(240, 128, shift=shift, seed=5)
    return Features(torch.as_tensor(X), torch.as_tensor(off), np.arange(240) // 2), y


def test_samil_finds_an_optimum_below_its_default_grid():
    train, y = _bags()
    fixed = SAwMILProbe(accelerator="cpu", C_limits=None).fit(train, y).params()
    assert fixed["C"] == 10.0 and grid_edge(fixed) == "lower"
    extended = SAwMILProbe(accelerator="cpu").fit(train, y).params()
    wide = SAwMILProbe(accelerator="cpu", Cs=(0.1, 1.0, 10.0, 100.0, 1000.0), C_limits=None).fit(train, y).params()
    assert extended["C"] == wide["C"] == 1.0 and grid_edge(extended) is None
    assert extended["Cs"] == [0.1, 1.0, 10.0, 100.0, 1000.0]
    for C, value in wide["cv_auroc"].items():       # warm starts from other neighbours: the same optima
        assert extended["cv_auroc"][C] == pytest.approx(value, abs=2e-3)


def test_samil_on_a_faint_signal_climbs_to_its_bound_and_is_flagged():
    train, y = _bags(shift=0.5)            # CV AUROC 0.53-0.55, still rising at the bound
    params = SAwMILProbe(accelerator="cpu", C_limits=(10.0, 1e4)).fit(train, y).params()
    assert params["Cs"] == [10.0, 100.0, 1000.0, 1e4] and params["C"] == 1e4
    assert grid_edge(params) == "upper"
