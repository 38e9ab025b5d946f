"""The C grid of the probes that choose C by cross-validation (linear, samil): its checks, the fallback C
when there are too few groups for folds, and the decade by which a grid is extended while its optimum sits
at an end (`beyond_grid`)."""
from __future__ import annotations

from probes.base import ProbeError, check_positive


def middle_of_grid(Cs) -> float:
    """The C taken without cross-validation (too few groups for folds): the middle of the grid `Cs`."""
    return Cs[len(Cs) // 2]


def check_C_grid(C, Cs, C_limits) -> None:
    """A probe's C options (linear, samil): `C` a number > 0 or None (chosen from `Cs` by CV, so `Cs` holds at
    least one C), every C of `Cs` a number > 0, `C_limits` as check_C_limits wants: else one ProbeError line."""
    if C is not None:
        check_positive("C", C)
    elif not Cs:
        raise ProbeError("Cs=[]: C is chosen from Cs by cross-validation, so give at least one, e.g. "
                         "Cs=[0.01,0.1,1], or a fixed C=1")
    for c in Cs:
        check_positive("Cs", c)
    check_C_limits(C_limits, Cs)


def check_C_limits(C_limits, Cs) -> tuple[float, float] | None:
    """`C_limits` as (lo, hi), or None (the grid `Cs` as given, never extended); a one-line ProbeError unless
    0 < lo <= min(Cs) and max(Cs) <= hi."""
    if C_limits is None:
        return None
    if not isinstance(C_limits, (list, tuple)) or len(C_limits) != 2:
        raise ProbeError(f"C_limits={C_limits!r}: give [lowest, highest] C the grid may be extended to, e.g. "
                         "[1e-6, 1e4], or null for the grid as given")
    lo, hi = (check_positive("C_limits", c) for c in C_limits)
    if Cs and not lo <= min(Cs) <= max(Cs) <= hi:
        raise ProbeError(f"C_limits={list(C_limits)} does not contain the grid Cs={list(Cs)}: widen C_limits")
    return float(lo), float(hi)


def beyond_grid(grid: list[float], best: float, C_limits: tuple[float, float] | None) -> float | None:
    """The next C to search when the CV optimum `best` lies at an end of the searched `grid`: a decade
    beyond that end, if it is within `C_limits` (lo, hi); None when `best` is interior, `C_limits` is None
    (no extension) or the bound is reached (the cell then records a C at the grid's edge, see
    probes.pipeline.grid_edge). Linear and samil bracket their optimum with it."""
    if C_limits is None or len(grid) < 2:
        return None
    lo, hi = C_limits
    step = float(f"{best * 10:.12g}") if best == max(grid) else float(f"{best / 10:.12g}") if best == min(grid) else None
    return step if step is not None and lo * (1 - 1e-9) <= step <= hi * (1 + 1e-9) else None
