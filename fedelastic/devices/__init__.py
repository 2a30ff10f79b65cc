"""What a device is: its profile (schema, loading, the registry, fleet assignment), the sampled kernel predictors
a profile holds, and units.

The names of the old module ``fedelastic.devices`` (now in ``fedelastic.devices.profile``) still import
from here for one release, with a ``DeprecationWarning`` (issue 39)."""

from fedelastic._shim import forward_names

__getattr__ = forward_names(__name__, ("fedelastic.devices.profile",), __path__)
