"""Flower glue: the ClientApp, the server strategy and the runner."""
