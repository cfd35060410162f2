"""Appliance simulator: the Cerebras-side models on CPU, strict checkpoint loading, ``verify`` against
Hugging Face ``transformers``, and a trainer loop that writes checkpoints the way the appliance does.

Heavy imports (torch, transformers) happen inside the submodules; importing this package is cheap.
"""

from __future__ import annotations

from typing import Any


def verify(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """See :func:`ckptconv.engine.simulator.verify.verify`."""
    from ckptconv.engine.simulator.verify import verify as _verify

    return _verify(*args, **kwargs)


def simulate(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """See :func:`ckptconv.engine.simulator.trainer.simulate`."""
    from ckptconv.engine.simulator.trainer import simulate as _simulate

    return _simulate(*args, **kwargs)


__all__ = ["simulate", "verify"]
