"""Probes of a layer's activations: scikit-learn binary classifiers on arrays (probes.base) and the
fitted, calibrated probes you keep (probes.artifacts). The names below are imported on first use, so
`import probes.features` does not load Lightning."""
from __future__ import annotations

import importlib

_WHERE = {"fit_probe": "probes.artifacts", "load_probe": "probes.artifacts", "FittedProbe": "probes.artifacts",
          "LinearProbe": "probes.linear", "MLPProbe": "probes.mlp", "MeanDiffProbe": "probes.mean_diff",
          "SAwMILProbe": "probes.samil", "RandomDirectionProbe": "probes.random_direction",
          "TTPDProbe": "probes.ttpd", "SupervisedPCAProbe": "probes.spca", "CCSProbe": "probes.ccs"}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'probes' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
