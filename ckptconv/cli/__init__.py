"""The ``ckptconv`` command line: a front end over the job handlers and the engine."""

from ckptconv.cli.main import main

__all__ = ["main"]
