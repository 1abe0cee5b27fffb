"""Experiments: config, the rollout and trial loops, the run store, reports and the viewer."""
