"""Appliance simulator: the Cerebras-side models on CPU, strict checkpoint loading, ``verify`` against
Hugging Face ``transformers`` (``verify.verify``), and a trainer loop that writes checkpoints the way
the appliance does (``trainer.simulate``).

Heavy imports (torch, transformers) happen inside the submodules; importing this package is cheap.
"""
