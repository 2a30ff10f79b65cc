"""Deadline budgets, pure numpy: a client with ``steps`` local steps, a full-training step time ``T``,
a probe overhead ``P`` and a communication time ``C`` finishes full training in ``C + P + steps * T``.
Under a deadline ``D`` it gets ``rho = (D - C - P) / (steps * T)`` (at most 1), or, without elastic
selection, ``floor((D - C) / T)`` steps.
"""

from __future__ import annotations

import math

import numpy as np


def local_steps(num_examples: int, batch_size: int, epochs: int, max_steps: int = 0) -> int:
    """Local steps of one round: ``epochs`` passes in batches, capped at ``max_steps`` (0: no cap)."""
    steps = epochs * math.ceil(num_examples / batch_size)
    return min(steps, max_steps) if max_steps else steps


def full_round_time_s(comm_s: float, steps: int, full_step_s: float, probe_s: float = 0.0) -> float:
    """Download, full local training (and its probes) and upload of one client."""
    return comm_s + probe_s + steps * full_step_s


def deadline_rho(deadline_s: float, comm_s: float, steps: int, full_step_s: float, probe_s: float = 0.0) -> float:
    """The step-time fraction that lets a client's round end by ``deadline_s`` (at most 1; <= 0: none)."""
    if steps <= 0:
        return 1.0
    return min(1.0, (deadline_s - comm_s - probe_s) / (steps * full_step_s))


def deadline_rho_steps(
    deadline_s: float, comm_s: float, steps: int, full_step_s: float, probe_s: float, min_rho: float
) -> tuple[float, int]:
    """Rho and steps when rho may not fall below ``min_rho``: fewer steps at ``min_rho`` or more instead.

    Elastic selection shortens only the backward pass, so a step never costs less than its forward
    share; past that point the only way to meet a deadline is fewer steps. Returns ``(rho, steps)``;
    ``steps = 0`` when not one step at ``min_rho`` fits.
    """
    rho = deadline_rho(deadline_s, comm_s, steps, full_step_s, probe_s)
    if rho >= min_rho or steps <= 0:
        return rho, steps
    budget = deadline_s - comm_s - probe_s
    fit = min(steps, math.floor(budget / (min_rho * full_step_s) + 1e-9))
    if fit <= 0:
        return rho, 0
    return min(1.0, budget / (fit * full_step_s)), fit


def deadline_steps(deadline_s: float, comm_s: float, full_step_s: float, steps: int) -> int:
    """How many full-training steps (at most ``steps``) fit before ``deadline_s``."""
    fit = math.floor((deadline_s - comm_s) / full_step_s + 1e-9)
    return int(min(steps, max(fit, 0)))


def deadline_from_quantile(full_times_s: list[float] | np.ndarray, quantile: float) -> float:
    """The deadline as a quantile of the sampled clients' full-training round times."""
    return float(np.quantile(np.asarray(full_times_s, float), quantile))
