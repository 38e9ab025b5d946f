"""Statements under a context: the stress contexts (interference) and the stores of such inputs (stores), read by
`python -m ncb`'s stress tests and by `train_probe augment=...` (probes.augment) alike."""
