"""Extraction: statements -> causal LM -> every layer's token-level hidden states -> HDF5 store."""
