"""The ``pipesched`` command line."""

from pipesched.cli.main import main

__all__ = ["main"]
