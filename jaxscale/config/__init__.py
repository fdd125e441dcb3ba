"""Config: the typed config, read from YAML and overrides and checked (no jax)."""
