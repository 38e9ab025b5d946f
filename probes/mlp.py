"""Nonlinear probe: an MLP on standardised statement vectors.

Class-balanced BCE, AdamW, mini-batches, trained by a `lightning.Trainer` with `EarlyStopping` on the
balanced BCE of a held-out part of the training split (class-stratified; whole groups held out when
`groups` are given); the weights of the best held-out epoch are restored at the end. One Trainer step
is one epoch: `training_step` runs the epoch's mini-batches itself (manual optimisation), because
the Trainer's per-step hooks cost about half as much as a mini-batch of this size (a fit: 2.97 ->
2.06 s); the arithmetic, batch order and random stream are those of one Trainer step per mini-batch.
Inside the epoch the steps are plain torch (`loss.backward()`, the unwrapped optimizer): the trainer
runs at 32-bit precision on one device (probes.trainer.make_trainer), where Lightning's backward and
step wrappers add nothing but their calls (the same weights).

Determinism: every random choice (held-out split, initial weights, batch order, dropout) comes from
torch's global generator, which the caller seeds with `lightning.seed_everything`; with `seed` set,
the fit runs under its own forked generator state seeded with it instead (the global state is left
untouched).
"""
from __future__ import annotations

from contextlib import nullcontext

import numpy as np
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import EarlyStopping
from torch import nn
from torch.utils.data import DataLoader, Dataset

from probes.base import (Probe, ProbeError, balanced_weights, check_choice, check_positive, draw_seed, holdout_split,
                         resize_placeholders, standardiser)
from probes.features import Features, statement_vectors
from probes.trainer import FullBatch, make_trainer, quiet_lightning

__all__ = ["MLPProbe"]

_ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU, "silu": nn.SiLU, "tanh": nn.Tanh}


class _Rows(Dataset):
    """Rows of aligned tensors, fetched a whole batch at a time (`__getitems__`)."""

    def __init__(self, *tensors: torch.Tensor):
        self.tensors = tensors

    def __len__(self) -> int:
        return len(self.tensors[0])

    def __getitem__(self, i):
        return tuple(t[i] for t in self.tensors)

    def __getitems__(self, index):
        index = torch.as_tensor(index, dtype=torch.long)
        return tuple(t[index] for t in self.tensors)


def _as_batch(batch):
    return batch


class MLPProbe(Probe):
    """MLP probe.

    Args:
        hidden: width of each hidden layer; depth: number of hidden layers (0 -> a linear model).
        dropout: dropout after each hidden activation; activation: "gelu" | "relu" | "silu" | "tanh".
        weight_decay, lr: AdamW settings; batch_size: mini-batch size.
        max_epochs: epoch cap; patience: epochs without a better held-out loss before stopping.
        val_fraction: fraction of the training split held out for early stopping.
        class_weight: "balanced" or None (loss weights; the held-out loss is balanced the same way).
        representation: "last" or "mean" statement vectors; tokens: "statement" or "all" (see LinearProbe).
        accelerator: passed to the Trainer; seed: see the module docstring (None: global generator).
    """

    def __init__(self, hidden: int = 256, depth: int = 1, dropout: float = 0.2,
                 activation: str = "gelu", weight_decay: float = 1e-2, lr: float = 1e-3,
                 batch_size: int = 128, max_epochs: int = 200, patience: int = 10,
                 val_fraction: float = 0.15, class_weight: str | None = "balanced",
                 representation: str = "last", accelerator: str = "auto", seed: int | None = None,
                 tokens: str = "statement"):
        super().__init__()
        self.hidden, self.depth, self.dropout, self.activation = hidden, depth, dropout, activation
        self.weight_decay, self.lr, self.batch_size, self.max_epochs = weight_decay, lr, batch_size, max_epochs
        self.patience, self.val_fraction, self.class_weight = patience, val_fraction, class_weight
        self.representation, self.accelerator, self.seed, self.tokens = representation, accelerator, seed, tokens
        self._check_params()
        self.register_buffer("mean", torch.zeros(0))
        self.register_buffer("std", torch.ones(0))
        self.net: nn.Module | None = None
        self._best: tuple[float, int, dict] | None = None
        self._batches: DataLoader | None = None
        self._val_loss = float("inf")
        self._params: dict = {}

    def _check_params(self) -> None:
        super()._check_params()
        check_choice("activation", self.activation, sorted(_ACTIVATIONS))
        for name in ("hidden", "batch_size", "max_epochs", "patience"):
            check_positive(name, getattr(self, name), integer=True)
        check_positive("depth", self.depth, integer=True, allow_zero=True)
        check_positive("lr", self.lr)
        check_positive("weight_decay", self.weight_decay, allow_zero=True)
        check_positive("dropout", self.dropout, allow_zero=True)
        if not 0.0 < self.val_fraction < 1.0:
            raise ProbeError(f"val_fraction={self.val_fraction}: use a value in (0, 1)")

    def _build(self, d: int) -> nn.Sequential:
        layers, width = [], d
        for _ in range(self.depth):
            layers += [nn.Linear(width, self.hidden), _ACTIVATIONS[self.activation]()]
            if self.dropout > 0:
                layers.append(nn.Dropout(float(self.dropout)))
            width = self.hidden
        layers.append(nn.Linear(width, 1))
        return nn.Sequential(*layers)

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        """Logits [N] of raw (unstandardised) statement vectors."""
        return self.net((X - self.mean) / self.std).squeeze(-1)

    # -- Lightning hooks ----------------------------------------------------------------------
    def _loss(self, batch) -> torch.Tensor:
        X, y, s = batch
        return (s * F.binary_cross_entropy_with_logits(self(X), y, reduction="none")).sum() / s.sum()

    automatic_optimization = False

    def training_step(self, batch, batch_idx):
        """One epoch: an AdamW step on each mini-batch of `self._batches`."""
        optimizer = self.optimizers(use_pl_optimizer=False)
        losses = []
        for rows in self._batches:
            rows = tuple(t.to(self.device) for t in rows)
            optimizer.zero_grad()
            loss = self._loss(rows)
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
        self.log("train_loss", torch.stack(losses).mean(), on_step=False, on_epoch=True, batch_size=1)   # (for a logger)

    def validation_step(self, batch, batch_idx):
        loss = self._loss(batch)  # one batch: the whole held-out part
        self.log("val_loss", loss, on_step=False, on_epoch=True, batch_size=len(batch[0]))
        self._val_loss = float(loss)
        return loss

    def on_validation_epoch_end(self):
        loss = self._val_loss
        if self._best is None or loss < self._best[0]:
            state = {k: v.detach().cpu().clone() for k, v in self.net.state_dict().items()}
            self._best = (loss, self.current_epoch, state)

    def configure_optimizers(self):
        # foreach: one call a step for all parameters (on the CPU torch's default loops over them in Python); the
        # same arithmetic bit for bit (a SmolLM2 layer job's five cells identical)
        return torch.optim.AdamW(self.net.parameters(), lr=float(self.lr), weight_decay=float(self.weight_decay),
                                 foreach=True)

    # -- Probe interface --------------------------------------------------------------------------
    def _fit(self, train: Features, y: np.ndarray, folds: list | None = None) -> "MLPProbe":   # (folds: unused)
        X = statement_vectors(train, self.representation).cpu()
        groups = None if train.groups is None else np.asarray(train.groups)
        if self.seed is None:
            rng_scope = nullcontext()
        else:
            devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
            rng_scope = torch.random.fork_rng(devices=devices)
        with rng_scope:
            if self.seed is not None:
                torch.manual_seed(self.seed)
            fit_idx, val_idx = holdout_split(y, groups, float(self.val_fraction), draw_seed(None))
            self.mean, self.std = standardiser(X)
            self.net = self._build(X.shape[1])
            self._best = None
            data = [(X[i], torch.from_numpy(y[i].astype(np.float32)),
                     torch.from_numpy(balanced_weights(y[i], self.class_weight))) for i in (fit_idx, val_idx)]
            generator = torch.Generator().manual_seed(draw_seed(None))
            self._batches = DataLoader(_Rows(*data[0]), batch_size=self.batch_size, shuffle=True,
                                       generator=generator, collate_fn=_as_batch)
            # one item an epoch, drawing its loader seed from a generator of its own (not the global one)
            epochs = DataLoader(FullBatch(), batch_size=None, generator=torch.Generator())
            val_loader = DataLoader(FullBatch(*data[1]), batch_size=None)
            stop = EarlyStopping(monitor="val_loss", mode="min", patience=self.patience)
            with quiet_lightning():
                trainer = make_trainer(self.accelerator, self.max_epochs, callbacks=[stop])
                trainer.fit(self, epochs, val_loader)
        best_loss, best_epoch, state = self._best
        self.net.load_state_dict(state)
        self._best, self._batches = None, None
        self.eval()
        self._params = {"hidden": self.hidden, "depth": self.depth, "dropout": float(self.dropout),
                        "activation": self.activation, "weight_decay": float(self.weight_decay),
                        "lr": float(self.lr), "batch_size": self.batch_size,
                        "representation": self.representation, "class_weight": self.class_weight,
                        "best_epoch": int(best_epoch), "epochs_run": int(trainer.current_epoch),
                        "val_loss": round(best_loss, 6), "n_val": int(len(val_idx))}
        return self

    @torch.no_grad()
    def _decision(self, data: Features) -> np.ndarray:
        was_training = self.training
        self.eval()
        X = statement_vectors(data, self.representation)
        device = self.mean.device
        out = torch.cat([self(X[s:s + 8192].to(device)) for s in range(0, len(X), 8192)]) if len(X) else torch.zeros(0)
        self.train(was_training)
        return out.double().cpu().numpy()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        resize_placeholders(self, state_dict, prefix)
        first = state_dict.get(prefix + "net.0.weight")
        if self.net is None and first is not None:  # build the network before its weights load
            self.net = self._build(first.shape[1])
            self.eval()
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
