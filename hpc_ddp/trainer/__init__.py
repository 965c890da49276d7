"""The built-in trainer: a config-driven classifier loop written against the public API."""
