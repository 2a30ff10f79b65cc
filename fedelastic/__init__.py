"""fedelastic: simulate federated and continual on-device training on emulated edge fleets."""

__version__ = "0.1.0"
