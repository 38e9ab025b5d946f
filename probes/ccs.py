"""CCS, Contrast-Consistent Search (Burns, Ye, Klein & Steinhardt 2023, "Discovering Latent Knowledge in Language
Models Without Supervision", ICLR; arXiv:2212.03827): an unsupervised linear probe fitted on contrast pairs.

A contrast pair here is a statement x+ and its negation x- about the same entities (`Features.pair`: equal keys,
one affirmative and one negated row; `Features.negation` says which is which); exactly one of the two is true.
Each side is normalised on its own, as in the paper, so that what merely tells a negation apart is removed:

    x~+ = (x+ - mu+) / sigma+,   x~- = (x- - mu-) / sigma-      per-feature mean / std of the paired training rows
    p(x~) = sigmoid(theta . x~ + b)                             the probability that the statement is true

    L(theta, b) = 1/n sum_i [ (p(x~+_i) - (1 - p(x~-_i)))^2        consistency
                              + min(p(x~+_i), p(x~-_i))^2 ]        confidence

minimised by AdamW (full batch; the paper's lr 1e-3, weight decay 0.01, 1000 epochs) from `n_restarts` random
initialisations (nn.Linear's uniform(+-1/sqrt(d))), all optimised at once (AdamW acts elementwise, so the
restarts stay independent), keeping the lowest final loss. No label enters the fit. CCS cannot know which side
of its direction is "true": afterwards the sign of (theta, b) is fixed so that its balanced training accuracy is
at least 1/2 (the paper scores max(acc, 1 - acc); we fix it once, on the training labels, and keep it for evaluation).

Scoring: decision(x) = theta . x~ + b, each statement normalised by the statistics of its own polarity; rows of
unknown polarity (plain arrays, `negation` None) by the mean of the two sides' statistics (`coef_`, `intercept_`
are that map). Training rows without a partner are scored, not fitted on.

Tasks: CCS separates a statement from its negation's truth, so it serves task=true_vs_false (its design) and the
true / false one-vs-all heads (the same direction; a pair of two "neither" statements is fitted like any other
pair). A head whose labels put both members of every pair in one class (neither_vs_all, the multiclass task's
neither head) has nothing CCS could contrast: it is refused in one ProbeError line.
"""
from __future__ import annotations

import numpy as np
import torch

from probes.base import Probe, ProbeError, check_positive, draw_seed, resolve_device
from probes.features import Features, statement_vectors

__all__ = ["CCSProbe", "contrast_pairs", "ccs_loss"]


def contrast_pairs(negation: np.ndarray, pair: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(affirmative rows [P], negated rows [P]): for every key of `pair` (>= 0) held by exactly two rows, one
    affirmative and one negated, those two rows (keys in increasing order)."""
    negation, pair = np.asarray(negation, dtype=bool), np.asarray(pair, dtype=np.int64)
    keys, counts = np.unique(pair[pair >= 0], return_counts=True)
    rows = np.flatnonzero(np.isin(pair, keys[counts == 2]))
    rows = rows[np.argsort(pair[rows], kind="stable")].reshape(-1, 2)     # [P, 2], each row one key
    mixed = negation[rows[:, 0]] != negation[rows[:, 1]]
    rows = rows[mixed]
    first_negated = negation[rows[:, 0]]
    return np.where(first_negated, rows[:, 1], rows[:, 0]), np.where(first_negated, rows[:, 0], rows[:, 1])


def ccs_loss(logit_pos: torch.Tensor, logit_neg: torch.Tensor) -> torch.Tensor:
    """The CCS loss [R] of R probes: logits [P, R] of the affirmative and negated sides of P pairs."""
    p_pos, p_neg = torch.sigmoid(logit_pos), torch.sigmoid(logit_neg)
    consistency = (p_pos - (1.0 - p_neg)).square().mean(0)
    confidence = torch.minimum(p_pos, p_neg).square().mean(0)
    return consistency + confidence


class CCSProbe(Probe):
    """Contrast-Consistent Search on statement / negation pairs (unsupervised; sign fixed on training labels).

    Args:
        n_restarts: random initialisations, the lowest final loss kept (the paper: 10).
        epochs: full-batch AdamW steps (1000); lr: its learning rate (1e-3); weight_decay: its decay (0.01).
        var_normalize: divide each side by its per-feature std after centring (the paper's normalisation);
            False: centre only.
        seed: seed of the initialisations; None -> drawn from torch's global generator (the pipeline seeds it).
        representation: "last" or "mean" statement vectors; tokens: "statement" or "all" (see LinearProbe).
        accelerator: device of the optimisation ("auto" -> cuda when available).
    """

    width_buffer = "weight"
    supported_tasks = ("true_vs_false", "true_vs_all", "false_vs_all")   # see the module docstring

    def __init__(self, n_restarts: int = 10, epochs: int = 1000, lr: float = 1e-3, weight_decay: float = 0.01,
                 var_normalize: bool = True, seed: int | None = None, representation: str = "last",
                 accelerator: str = "auto", tokens: str = "statement"):
        super().__init__()
        self.n_restarts, self.epochs, self.lr, self.weight_decay = n_restarts, epochs, lr, weight_decay
        self.var_normalize, self.seed = var_normalize, seed
        self.representation, self.accelerator, self.tokens = representation, accelerator, tokens
        self._check_params()
        for name in ("weight", "mean_affirmative", "std_affirmative", "mean_negated", "std_negated"):
            self.register_buffer(name, torch.zeros(0))
        self.register_buffer("bias", torch.zeros(()))
        self._params: dict = {}

    def _check_params(self) -> None:
        super()._check_params()
        for name in ("n_restarts", "epochs"):
            check_positive(name, getattr(self, name), integer=True)
        check_positive("lr", self.lr)
        check_positive("weight_decay", self.weight_decay, allow_zero=True)
        if self.seed is not None:
            check_positive("seed", self.seed, integer=True, allow_zero=True)

    def _side(self, X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean = X.mean(0)
        std = X.std(0, unbiased=False) if self.var_normalize else torch.ones_like(mean)
        return mean, torch.where(std > 1e-8 * max(float(std.max()), 1.0), std, torch.ones_like(std))

    def _fit(self, train: Features, y: np.ndarray, folds: list | None = None) -> "CCSProbe":   # (folds: unused)
        if train.negation is None or train.pair is None:
            raise ProbeError("probe=ccs needs contrast pairs: give Features with `negation` (bool [N]) and `pair` "
                             "(int [N], equal for a statement and its negation), as train_probe sets from the store")
        pos, neg = contrast_pairs(train.negation, train.pair)
        if len(pos) == 0:
            raise ProbeError(f"probe=ccs: none of the {len(train)} training statements has its negation among them: "
                             "CCS needs statement / negation pairs (same object_1 and object_2)")
        if not (y[pos] != y[neg]).any():
            raise ProbeError("probe=ccs: every contrast pair holds two statements of one class under this head's "
                             "labels (neither_vs_all?): CCS contrasts a statement with its negation, use "
                             "task=true_vs_false")
        device = resolve_device(self.accelerator)
        X = statement_vectors(train, self.representation).to(device=device, dtype=torch.float32)
        (m_pos, s_pos), (m_neg, s_neg) = self._side(X[pos]), self._side(X[neg])
        Xp, Xn = (X[pos] - m_pos) / s_pos, (X[neg] - m_neg) / s_neg
        theta, b, losses = self._optimise(Xp, Xn, draw_seed(self.seed))
        best = int(torch.argmin(losses))
        self.weight, self.bias = theta[best].detach().cpu(), b[best].detach().cpu()
        self.mean_affirmative, self.std_affirmative = m_pos.cpu(), s_pos.cpu()
        self.mean_negated, self.std_negated = m_neg.cpu(), s_neg.cpu()
        scores = self._decision(train)
        hits = (scores > 0) == (y == 1)
        sign = -1.0 if (hits[y == 1].mean() + hits[y == 0].mean()) / 2 < 0.5 else 1.0   # balanced accuracy
        self.weight, self.bias = sign * self.weight, sign * self.bias
        self._params = {"representation": self.representation, "var_normalize": bool(self.var_normalize),
                        "n_pairs": int(len(pos)), "n_train": int(len(train)),
                        "n_unpaired": int(len(train) - 2 * len(pos)), "labels_in_fit": False, "sign": int(sign),
                        "loss": round(float(losses[best]), 8),
                        "restart_losses": [round(float(v), 8) for v in losses]}
        return self

    def _optimise(self, Xp: torch.Tensor, Xn: torch.Tensor, seed: int):
        """(theta [R, d], b [R], final losses [R]) of R = n_restarts probes, trained together."""
        d, R = Xp.shape[1], int(self.n_restarts)
        generator = torch.Generator().manual_seed(seed)
        bound = 1.0 / np.sqrt(d)
        theta = ((torch.rand(R, d, generator=generator) * 2 - 1) * bound).to(Xp.device).requires_grad_()
        b = ((torch.rand(R, generator=generator) * 2 - 1) * bound).to(Xp.device).requires_grad_()
        optimizer = torch.optim.AdamW([theta, b], lr=float(self.lr), weight_decay=float(self.weight_decay))
        with torch.enable_grad():
            for _ in range(int(self.epochs)):
                optimizer.zero_grad()
                ccs_loss(Xp @ theta.T + b, Xn @ theta.T + b).sum().backward()
                optimizer.step()
        with torch.no_grad():
            losses = ccs_loss(Xp @ theta.T + b, Xn @ theta.T + b)
        return theta.detach(), b.detach(), losses.cpu()

    def _normalised(self, data: Features) -> torch.Tensor:
        X = statement_vectors(data, self.representation).to(self.weight.device, dtype=torch.float32)
        if data.negation is None:
            mean = (self.mean_affirmative + self.mean_negated) / 2
            std = (self.std_affirmative + self.std_negated) / 2
            return (X - mean) / std
        negated = torch.as_tensor(np.asarray(data.negation, dtype=bool))[:, None]
        return torch.where(negated, (X - self.mean_negated) / self.std_negated,
                           (X - self.mean_affirmative) / self.std_affirmative)

    @torch.no_grad()
    def _decision(self, data: Features) -> np.ndarray:
        return (self._normalised(data).double() @ self.weight.double() + float(self.bias)).cpu().numpy()

    @property
    def coef_(self) -> np.ndarray:
        """float [d]: decision = X @ coef_ + intercept_ for statements of unknown polarity (see the module)."""
        std = ((self.std_affirmative + self.std_negated) / 2).double()
        return (self.weight.double() / std).cpu().numpy()

    @property
    def intercept_(self) -> float:
        mean = ((self.mean_affirmative + self.mean_negated) / 2).double()
        return float(self.bias) - float(self.coef_ @ mean.cpu().numpy())
