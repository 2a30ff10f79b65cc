"""One-sigma bands of emulated times and energies: how they are sized and how they combine (pure numpy).

* **Time, from leave-one-model-out errors.** A profile measured on ``n >= 2`` models is priced for
  each model by a fit to the *other* models; those ``n`` held-out step errors ``e_i`` size the band.
  Their RMS alone is too narrow when ``n`` is small (two models: the host's profile stated 16.8%
  and held 48% of held-out steps, benchmarks/studies/bands.md). If the errors are normal with mean 0,
  a new model's error ``e`` satisfies ``e / RMS(e_1..e_n) ~ t_n`` (Student's t, ``n`` degrees of
  freedom), so the band that holds a new model's error with the one-sigma probability (68.27%) is
  :func:`lomo_band`: ``t_n(0.8413) * RMS``. Two models: x1.32; three: x1.20; ten: x1.05.
* **Time, one model or none.** With one model nothing is held out; a profile with no measurement
  (a datasheet profile) has not even that. Their rules are stated in the profile's
  ``[uncertainty] step`` source (benchmarks/bands.py writes the figures).
* **Power.** A power measured by ``fedelastic profile measure`` carries its own spread
  (``[uncertainty] power``); a datasheet or placeholder power has none, and is taken to be within
  :data:`UNVERIFIED_POWER_BAND` (a stated convention, not a measurement).
* **Energy** of a trip ``E`` and its idle wait ``I``: ``sqrt((time_rel * E)**2 + (power_rel * (E + I))**2)``
  (time and power errors independent; the training time's relative band applied to the whole trip,
  radio included: conservative). :func:`trip_energy_band_j`.
* **Sums.** A profile's error is systematic (the same for every step it prices), so the bands of a
  run's rounds and clients add linearly, not in quadrature; a round's length, a maximum (or k-th
  arrival) over clients' times, moves by at most the largest client band.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

#: the probability of a normal one-sigma interval, and its upper tail point
ONE_SIGMA = math.erf(1 / math.sqrt(2))  # 0.6827
_UPPER = 0.5 + ONE_SIGMA / 2  # 0.8413

#: relative one-sigma step band of a profile measured on one model (nothing held out to size it):
#: the RMS error of the 40 held-out (model, selection) steps of this host's profile measured by
#: ``fedelastic profile measure`` on two models (2026-11-28, benchmarks/results/heldout.json)
SINGLE_MODEL_BAND = 0.19
SINGLE_MODEL_RULE = (
    "one model: nothing held out to size the band; the stated rule is the RMS held-out step error "
    f"of a host profile measured by fedelastic profile measure ({SINGLE_MODEL_BAND:.0%}, 40 held-out steps, "
    "benchmarks/studies/bands.md), never the in-sample residual"
)
LOMO_RULE = "t_n(0.8413) x RMS of the n leave-one-model-out step errors (fedelastic.cost.bands.lomo_band)"

#: relative one-sigma band of a power that no one measured on the device (datasheet figures,
#: mode budgets, wall-plug proxies, placeholders): a stated convention, not a measurement. The
#: shipped profiles' own sources disagree by about this much (raspberry_pi_4: 7.2 W under HPL
#: against 6.4 W under stress, 12%; a mode budget used as the draw is an upper bound).
UNVERIFIED_POWER_BAND = 0.3


def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (``p`` in (0.5, 1)).

    Its CDF is integrated numerically (the density on a fine grid, substituted ``x = tan(u)`` so that
    the tail is finite) and inverted by interpolation: accurate to about 1e-6 for ``df >= 1``.
    """
    if not 0.5 < p < 1 or df < 1:
        raise ValueError(f"t_quantile: p in (0.5, 1) and df >= 1, got p={p}, df={df}")
    u = np.linspace(0.0, math.pi / 2, 200_001)[:-1]
    x = np.tan(u)
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    density = np.exp(log_c - (df + 1) / 2 * np.log1p(x * x / df)) / np.cos(u) ** 2  # dx = du / cos^2
    cdf = 0.5 + np.concatenate([[0.0], np.cumsum((density[1:] + density[:-1]) / 2 * np.diff(u))])
    return float(np.interp(p, cdf, x))


def lomo_band(errors: np.ndarray | list[float], df: int | None = None) -> float:
    """The one-sigma (68.27%) band of a new model's relative step error, from ``n >= 2``
    leave-one-model-out errors: ``t_n(0.8413) * RMS(errors)``. ``df``: the number of models, where
    a model gave several errors (one per measured batch size; they are not independent)."""
    e = np.asarray(errors, float)
    n = int(e.size if df is None else df)
    if n < 2:
        raise ValueError(f"lomo_band needs at least two held-out models' errors, got {n}")
    return t_quantile(_UPPER, n) * float(np.sqrt(np.mean(e**2)))


def coverage(predicted: np.ndarray, real: np.ndarray, band: float) -> float:
    """Share of ``real`` within ``predicted * (1 +- band)`` (relative band, as the profiles state it)."""
    err = np.abs(np.asarray(predicted, float) / np.asarray(real, float) - 1)
    return float(np.mean(err <= band))


def power_band(device: Any) -> float:
    """Relative one-sigma band of a profile's powers: its ``[uncertainty] power`` (measured), else
    :data:`UNVERIFIED_POWER_BAND`."""
    q = getattr(device, "power_uncertainty", None)
    return UNVERIFIED_POWER_BAND if q is None else float(q.value)


def trip_energy_band_j(device: Any, energy: float, idle: float, train_s: float, train_band_s: float) -> float:
    """One-sigma band of a client's ``energy`` (its trip) and ``idle`` (its wait): the training
    time's relative band on the trip's energy, the power's band on both, independent."""
    time_rel = train_band_s / train_s if train_s > 0 else 0.0
    return float(math.hypot(time_rel * energy, power_band(device) * (energy + idle)))
