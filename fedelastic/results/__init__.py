"""What a run writes and how it is read back: the recorder, tables, status, summary, plots, idle analysis, continual metrics and statistics over seeds.

The names of the old module ``fedelastic.results`` (now in ``fedelastic.results.recorder``) still import
from here for one release, with a ``DeprecationWarning`` (issue 39)."""

from fedelastic._shim import forward_names

__getattr__ = forward_names(__name__, ("fedelastic.results.recorder",), __path__)
