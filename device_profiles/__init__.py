"""Built-in device profiles (TOML, schema v1; see SCHEMA.md). Data only: this file makes the folder a package so importlib.resources can find it."""
