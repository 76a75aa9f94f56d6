"""Checks of the user's model that warn where running it in micro-batches changes its numbers."""
