"""Making a device's profile: measuring layers and kernels on this host, importing Chrome traces, fitting
the roofline, writing the TOML, and the ``fedelastic profile`` commands."""
