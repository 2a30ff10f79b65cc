"""Flower glue: the ClientApp, the server (its round loop over the Grid) and the runner."""
