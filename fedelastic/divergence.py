"""Deprecated: moved to :mod:`fedelastic.sim.divergence` (issue 39); this path goes in fedelastic 0.2."""

from fedelastic._shim import forward

forward(__name__, "fedelastic.sim.divergence")
