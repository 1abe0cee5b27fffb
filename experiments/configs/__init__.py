"""Experiment presets (YAML), found by name: ``--config paper``."""
