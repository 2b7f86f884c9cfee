"""Settings: what each one means, its default and flag (config/settings.py), and the TOML file that sets
them (file.py)."""
