"""Runs: layouts, checkpoints and the formats models move in and out in."""
