"""Choosing what a client trains: the strategy interface and registry, and the budgeted selectors (pure numpy;
the strategy contract is :mod:`fedelastic.testing`).

The names of the old module ``fedelastic.selection`` (now in ``fedelastic.selection.strategy``) still import
from here for one release, with a ``DeprecationWarning`` (issue 39)."""

from fedelastic._shim import forward_names

__getattr__ = forward_names(__name__, ("fedelastic.selection.strategy",), __path__)
