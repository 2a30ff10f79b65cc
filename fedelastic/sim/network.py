"""Network, pure numpy: each client's uplink and downlink are its profile's nominal figures times a
factor drawn from a named distribution, or figures read from a trace file.
"""

from __future__ import annotations

import numpy as np


def link_factors(distribution: str, num_clients: int, seed: int, sigma: float) -> np.ndarray:
    """Per-client multipliers of the nominal link rates (one factor per client, up and down alike).

    ``lognormal``: median 1 and log-standard deviation ``sigma`` (0.7 spreads the middle 90% of
    users over a factor of 10); ``nominal``: all ones.
    """
    if distribution == "nominal":
        return np.ones(num_clients)
    return np.random.default_rng([seed, 0x11E7]).lognormal(0.0, sigma, num_clients)
