"""Extraction: statements -> causal LM -> every layer's token-level hidden states -> HDF5 store.

`open_store` and `ActivationStore` (extract.store) are imported on first use: `import extract` stays light."""
from __future__ import annotations

import importlib

__all__ = ["ActivationStore", "open_store"]


def __getattr__(name: str):
    if name not in __all__:
        raise AttributeError(f"module 'extract' has no attribute {name!r}")
    return getattr(importlib.import_module("extract.store"), name)


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
