"""Training for real: the local trainer, vectorised cohorts, optimizers, device numerics, probes, pretraining,
evaluation, and Sparse Update's contribution analysis (it trains)."""
