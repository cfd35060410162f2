"""ckptconv: convert deep-learning checkpoints between formats and model layouts."""

__version__ = "0.1.0"
