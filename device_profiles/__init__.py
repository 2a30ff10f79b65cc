"""Built-in device profiles (TOML, schema v1; see the README). Data only: this file makes the folder a package so importlib.resources can find it."""
