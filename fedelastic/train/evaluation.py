"""Evaluation of a model on arrays: accuracy, mean cross-entropy and predictions per class."""

from __future__ import annotations

import numpy as np
import torch


def evaluate_model(model: torch.nn.Module, x: np.ndarray, y: np.ndarray, batch_size: int = 512) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) of ``model`` on ``x, y``."""
    accuracy, loss, _ = evaluate_predictions(model, x, y, batch_size)
    return accuracy, loss


def evaluate_predictions(
    model: torch.nn.Module, x: np.ndarray, y: np.ndarray, batch_size: int = 512
) -> tuple[float, float, np.ndarray]:
    """(accuracy, mean cross-entropy, predictions per class) of ``model`` on ``x, y``.

    The counts have one entry per output class (the model's logits); a NaN logit row counts
    for the class ``argmax`` gives it.
    """
    model.eval()
    correct, loss = 0, 0.0
    counts: np.ndarray | None = None
    with torch.no_grad():
        for start in range(0, len(y), batch_size):
            xb, yb = torch.from_numpy(x[start : start + batch_size]), torch.from_numpy(y[start : start + batch_size])
            out = model(xb)
            loss += torch.nn.functional.cross_entropy(out, yb, reduction="sum").item()
            predicted = out.argmax(1)
            correct += int((predicted == yb).sum())
            batch = torch.bincount(predicted, minlength=out.shape[1]).numpy()
            counts = batch if counts is None else counts + batch
    return correct / len(y), loss / len(y), counts if counts is not None else np.zeros(0, dtype=np.int64)
