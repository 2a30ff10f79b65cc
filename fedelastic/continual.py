"""Deprecated: split into :mod:`fedelastic.results.continual`, :mod:`fedelastic.results.continual_metrics`.

The names of the old module ``fedelastic.continual`` (now in ``fedelastic.results.continual``, ``fedelastic.results.continual_metrics``) still import
from here for one release, with a ``DeprecationWarning`` (issue 39)."""

from fedelastic._shim import forward_names

__getattr__ = forward_names(__name__, ("fedelastic.results.continual", "fedelastic.results.continual_metrics"), None)
