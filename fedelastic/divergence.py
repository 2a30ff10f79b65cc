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
* **the predictions collapse to one class**: at least ``collapse_share`` of the test predictions
  fall in one class, on a test set with at least 3 classes whose own largest class is below that
  share, after an evaluation in which they did not (a model that starts collapsed, e.g. untrained,
  has not diverged until it has predicted more than one class). Default 0.95: with 3 or more
  classes such a model is at chance or below.

A check whose threshold is 0 is off. The detector is pure (numpy only) and deterministic.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Divergence:
    """The first round that showed divergence, and why (one line)."""

    round: int
    reason: str

    def to_dict(self) -> dict:
        return {"round": self.round, "reason": self.reason}


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
    ):
        self.loss_factor, self.norm_factor = loss_factor, norm_factor
        self.collapse_share, self.rejected_share = collapse_share, rejected_share
        self.classes = classes  # the model's output classes (0: unknown), for the loss floor ln(classes)
        self.loss_ref: float | None = None
        self.norm_ref: float | None = None
        self.spread = False  # an evaluation has seen predictions not collapsed
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
        ``test_loss``: the global model's test loss (None: not evaluated), used only as the loss
        reference when it is the first finite loss seen (the initial model's);
        ``norm``: the global weights' L2 norm after the round (round 0: the initial model, the
        reference); ``trained``/``rejected``: clients that trained, and how many of those sent a
        non-finite update; ``predicted``/``actual``: counts per class of the test predictions
        and of the test labels (None: not evaluated this round).
        """
        if self.loss_ref is None and test_loss is not None and math.isfinite(test_loss):
            self.loss_ref = self._floor(test_loss)
        reasons = [
            self._loss(train_loss),
            self._norm(norm),
            self._rejected(trained, rejected),
            self._collapse(predicted, actual),
        ]
        reason = "; ".join(r for r in reasons if r)
        if reason and self.first is None:
            self.first = Divergence(rnd, reason)
        return reason

    def state(self) -> dict:
        """What :meth:`load_state` needs to go on as if never stopped (plain numbers and text: a checkpoint keeps it)."""
        first = self.first
        return {
            "loss_ref": math.nan if self.loss_ref is None else self.loss_ref,
            "norm_ref": math.nan if self.norm_ref is None else self.norm_ref,
            "spread": self.spread,
            "classes": self.classes,
            "first_round": -1 if first is None else first.round,
            "first_reason": "" if first is None else first.reason,
        }

    def load_state(self, doc: dict) -> None:
        self.loss_ref = None if math.isnan(doc["loss_ref"]) else float(doc["loss_ref"])
        self.norm_ref = None if math.isnan(doc["norm_ref"]) else float(doc["norm_ref"])
        self.spread, self.classes = bool(doc["spread"]), int(doc["classes"])
        self.first = Divergence(int(doc["first_round"]), str(doc["first_reason"])) if doc["first_round"] >= 0 else None

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

    def _collapse(self, predicted: np.ndarray | None, actual: np.ndarray | None) -> str:
        if predicted is None or self.collapse_share <= 0:
            return ""
        labels = np.asarray(actual if actual is not None else predicted)
        if np.count_nonzero(labels) < 3 or collapse_share(labels) >= self.collapse_share:
            return ""  # too few classes, or a test set that is itself one class: nothing to tell
        share = collapse_share(np.asarray(predicted))
        if share < self.collapse_share:
            self.spread = True
            return ""
        if not self.spread:
            return ""  # collapsed from the start (e.g. untrained): not a collapse yet
        top = int(np.argmax(predicted))
        return f"{share:.1%} of the test predictions are class {top}"
