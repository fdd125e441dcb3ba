"""Checkpoint: a run's state saved and restored, onto any layout."""
