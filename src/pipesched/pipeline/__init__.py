"""The user's facade: a Pipeline, the stages it builds per kind of call, and its model checks."""

from pipesched.pipeline.facade import Pipeline

__all__ = ["Pipeline"]
