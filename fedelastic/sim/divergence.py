"""Divergence: when a run's training has broken down, said as a status rather than left in the figures.

The server feeds a :class:`Detector` once per round (:meth:`Detector.observe`) with what it
knows after aggregating and (when it evaluates) testing the global model. A round shows
divergence when

* **the training loss is non-finite**, or above ``loss_factor`` x its reference: the first
  finite loss the run shows (the initial model's test loss, else the first round's mean train
  loss), but at least ``ln(classes)`` (the loss of a uniform guess),
  so that a pretrained model whose first loss is tiny may still meet new classes without being
  called diverged. Default 10: 10 x ``ln(classes)`` (23 for ten classes) is the loss of a model
  wrong on every sample by a margin of ~23 logits on average, far above a sound run's (the two
  below: at most 1.6), while the broken runs seen passed it within a round (215, then 3.8e15,
  then NaN);
* **the global weights' L2 norm is non-finite, or above ``norm_factor`` x the initial norm.**
  Default 100: sound runs stay within a few times their start (small_cnn on digits, 15 rounds to
  0.98 accuracy: 1.23x at lr 0.05, 1.72x at lr 0.2 without weight decay), while the broken runs
  seen grew it by 1e12 (lr 50: 8.9 to 8.7e13 in one round);
* **more than ``rejected_share`` of the round's trained clients sent non-finite updates**
  (rejected, not averaged). Default 0.5: a lone bad client leaves the global model untouched
  (its row says ``rejected``), a majority means the setting itself breaks training;
* **the global model's test loss is non-finite** (NaN or inf: the model broke, even if later
  rounds bring it back);
* **the predictions collapse to one class while the model got worse, and stay so**: in
  ``collapse_rounds`` consecutive evaluations at least ``collapse_share`` of the test predictions
  fall in one class (on a test set with at least 3 classes whose own largest class is below that
  share) *and* the test loss is above ``(1 + collapse_margin)`` x the lowest test loss the run
  had shown before. A collapse alone is not divergence: a model early in training, barely
  trained or training few parameters, often predicts one class for a while as its loss falls
  (0.103 accuracy, all class 3, at a test loss of 2.3017 below its initial 2.3047); a model that
  trains nothing keeps its loss; and a pretrained model meeting new classes on skewed clients
  may collapse for one round with its loss 12% up, then recover (0.16 four rounds later).
  Defaults 0.95, 0.05 and 2, chosen on 240 traced runs (``benchmarks/divergence_rule.py``,
  ``docs/reference/divergence.md``).

A check whose threshold is 0 is off. The detector is pure (numpy only) and deterministic.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Divergence:
    """The first round that showed divergence, why (one line), and which checks fired
    (``loss``, ``norm``, ``rejected``, ``test_loss``, ``collapse``)."""

    round: int
    reason: str
    checks: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return {"round": self.round, "reason": self.reason, "checks": list(self.checks)}


def advice(divergence: dict, *, lr: float, bn_mode: str, pretrained: bool) -> str:
    """The setting most likely at fault for a divergence (``Divergence.to_dict()``), in one sentence.

    Non-finite values (NaN/inf client updates, train or test loss) in the first round, with no
    finite figure that blew up beside them, point at the data or the model's forward: no step was
    large yet. Otherwise the step size is at fault, with frozen BatchNorm statistics (which let
    activations grow unchecked) named beside it.
    """
    reason = str(divergence.get("reason", ""))
    exploded = "is above" in reason  # a finite loss or norm beyond its bound: steps too large
    non_finite = "rejected" in (divergence.get("checks") or ()) or " is nan" in reason or " is inf" in reason
    if non_finite and not exploded and int(divergence.get("round", 0)) <= 1:
        return (
            "non-finite values from the first round: check the data for NaN/inf values and the model's "
            f"forward; if both are sound, lower train.lr (now {lr:g})"
        )
    frozen = bn_mode == "frozen" or (bn_mode == "auto" and pretrained)
    tail = ' or set train.bn_mode = "train" (frozen BatchNorm statistics let activations grow)' if frozen else ""
    return f"lower train.lr (now {lr:g}){tail}"


def collapse_share(predicted: np.ndarray) -> float:
    """The share of predictions in the most-predicted class (0.0 with no predictions)."""
    total = float(np.sum(predicted))
    return float(np.max(predicted)) / total if total > 0 else 0.0


def weight_norm(state: dict[str, np.ndarray], names: Collection[str] | None = None) -> float:
    """The L2 norm of the floating tensors of ``state`` named in ``names`` (all, if None).

    NaN if any floating tensor of ``state``, named or not (e.g. BatchNorm's running statistics),
    holds a NaN or an inf.
    """
    total = 0.0
    for name, value in state.items():
        if value.dtype.kind != "f":
            continue
        if names is None or name in names:
            flat = value.ravel().astype(np.float64, copy=False)
            total += float(flat @ flat)
        elif not np.isfinite(value).all():
            return math.nan
    return math.sqrt(total) if math.isfinite(total) else math.nan


class Detector:
    """Fed once per round; :attr:`first` holds the first :class:`Divergence` (None while none)."""

    def __init__(
        self,
        loss_factor: float = 10.0,
        norm_factor: float = 100.0,
        collapse_share: float = 0.95,
        rejected_share: float = 0.5,
        classes: int = 0,
        collapse_margin: float = 0.05,
        collapse_rounds: int = 2,
    ):
        self.loss_factor, self.norm_factor = loss_factor, norm_factor
        self.collapse_share, self.rejected_share = collapse_share, rejected_share
        self.collapse_margin, self.collapse_rounds = collapse_margin, collapse_rounds
        self.best_test_loss = math.inf  # the lowest finite test loss so far
        self.streak = 0  # consecutive evaluations collapsed and worse than the best before them
        self.classes = classes  # the model's output classes (0: unknown), for the loss floor ln(classes)
        self.loss_ref: float | None = None
        self.norm_ref: float | None = None
        self.first: Divergence | None = None

    def observe(
        self,
        rnd: int,
        *,
        train_loss: float | None = None,
        test_loss: float | None = None,
        norm: float | None = None,
        trained: int = 0,
        rejected: int = 0,
        predicted: np.ndarray | None = None,
        actual: np.ndarray | None = None,
    ) -> str:
        """Why round ``rnd`` shows divergence ('' if it does not); the first such round is kept in :attr:`first`.

        ``train_loss``: the mean train loss of the clients whose updates were used (None: none);
        ``test_loss``: the global model's test loss (None: not evaluated); the first finite one
        (the initial model's) is the loss reference;
        ``norm``: the global weights' L2 norm after the round (round 0: the initial model, the
        reference); ``trained``/``rejected``: clients that trained, and how many of those sent a
        non-finite update; ``predicted``/``actual``: counts per class of the test predictions
        and of the test labels (None: not evaluated this round).
        """
        if self.loss_ref is None and test_loss is not None and math.isfinite(test_loss):
            self.loss_ref = self._floor(test_loss)
        checks = {
            "loss": self._loss(train_loss),
            "norm": self._norm(norm),
            "rejected": self._rejected(trained, rejected),
            "test_loss": "" if test_loss is None or math.isfinite(test_loss) else f"the test loss is {test_loss:g}",
            "collapse": self._collapse(predicted, actual, test_loss),
        }
        if test_loss is not None and math.isfinite(test_loss):
            self.best_test_loss = min(self.best_test_loss, test_loss)
        reason = "; ".join(r for r in checks.values() if r)
        if reason and self.first is None:
            self.first = Divergence(rnd, reason, tuple(k for k, r in checks.items() if r))
        return reason

    def state(self) -> dict:
        """What :meth:`load_state` needs to go on as if never stopped (plain numbers and text: a checkpoint keeps it)."""
        first = self.first
        return {
            "loss_ref": math.nan if self.loss_ref is None else self.loss_ref,
            "norm_ref": math.nan if self.norm_ref is None else self.norm_ref,
            "classes": self.classes,
            "best_test_loss": self.best_test_loss,
            "streak": self.streak,
            "first_round": -1 if first is None else first.round,
            "first_reason": "" if first is None else first.reason,
            "first_checks": "" if first is None else ",".join(first.checks),
        }

    def load_state(self, doc: dict) -> None:
        self.loss_ref = None if math.isnan(doc["loss_ref"]) else float(doc["loss_ref"])
        self.norm_ref = None if math.isnan(doc["norm_ref"]) else float(doc["norm_ref"])
        self.classes = int(doc["classes"])
        self.best_test_loss = float(doc.get("best_test_loss", math.inf))  # a checkpoint from before: fresh
        self.streak = int(doc.get("streak", 0))
        checks = tuple(c for c in str(doc.get("first_checks", "")).split(",") if c)
        self.first = (
            Divergence(int(doc["first_round"]), str(doc["first_reason"]), checks) if doc["first_round"] >= 0 else None
        )

    def _loss(self, loss: float | None) -> str:
        if loss is None:
            return ""
        if not math.isfinite(loss):
            return f"the mean train loss is {loss:g}"
        if self.loss_ref is None:
            self.loss_ref = self._floor(loss)
            return ""
        if self.loss_factor > 0 and loss > self.loss_factor * self.loss_ref:
            return f"the mean train loss {loss:.4g} is above {self.loss_factor:g} x its reference {self.loss_ref:.4g}"
        return ""

    def _floor(self, loss: float) -> float:
        return max(loss, math.log(self.classes) if self.classes > 1 else 0.0)

    def _norm(self, norm: float | None) -> str:
        if norm is None:
            return ""
        if not math.isfinite(norm):
            return f"the global weights' norm is {norm:g}"
        if self.norm_ref is None or self.norm_ref <= 0:
            self.norm_ref = norm
            return ""
        if self.norm_factor > 0 and norm > self.norm_factor * self.norm_ref:
            return f"the global weights' norm {norm:.4g} is above {self.norm_factor:g} x the initial {self.norm_ref:.4g}"
        return ""

    def _rejected(self, trained: int, rejected: int) -> str:
        if trained <= 0 or rejected <= 0 or rejected / trained <= self.rejected_share:
            return ""
        return f"{rejected} of {trained} clients that trained sent non-finite updates"

    def _collapse(self, predicted: np.ndarray | None, actual: np.ndarray | None, test_loss: float | None) -> str:
        if predicted is None or self.collapse_share <= 0 or test_loss is None or not math.isfinite(test_loss):
            return ""  # not evaluated (the streak goes on), off, or a non-finite test loss (its own check)
        labels = np.asarray(actual if actual is not None else predicted)
        if np.count_nonzero(labels) < 3 or collapse_share(labels) >= self.collapse_share:
            return ""  # too few classes, or a test set that is itself one class: nothing to tell
        share = collapse_share(np.asarray(predicted))
        bound = (1 + self.collapse_margin) * self.best_test_loss
        worse = share >= self.collapse_share and test_loss > bound
        self.streak = self.streak + 1 if worse else 0
        if self.streak < max(self.collapse_rounds, 1):
            return ""  # not collapsed, collapsed as the loss falls (barely trained), or not for long yet
        top = int(np.argmax(predicted))
        return (
            f"{share:.1%} of the test predictions are class {top} and the test loss {test_loss:.4g} is above "
            f"{1 + self.collapse_margin:g} x the best before ({self.best_test_loss:.4g}), "
            f"{self.streak} evaluations running"
        )
