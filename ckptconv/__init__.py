"""ckptconv: convert deep-learning checkpoints between formats and model layouts.

The in-process API is the engine's own entry points, the functions the command line and the
workers call::

    from ckptconv import convert, convert_model, diff, inspect, plan

- :func:`convert` -- container conversion (``ckptconv convert SRC DST --to FORMAT``), staged,
  verified and published with its manifest; returns a :class:`ConvertResult`;
- :func:`convert_model` -- model-layout conversion (``ckptconv convert-model``), outputs named as
  the Model Zoo names them; returns a :class:`ConvertResult`;
- :func:`plan` -- dry run of a container conversion from metadata only (``ckptconv plan``);
  :func:`plan_model` is the dry run of a model conversion;
- :func:`inspect` -- format, release, keys, dtypes and shapes (``ckptconv inspect``);
- :func:`diff` -- compare two checkpoints tensor by tensor (``ckptconv diff``).

``progress`` callbacks receive :class:`Progress` snapshots (stage, tensors and bytes done and
total, throughput, ETA) a few times a second; ``cancelled`` is polled between tensors and stops the
run (nothing is published) when it returns True. Errors a caller can fix are
:class:`CkptconvError` subclasses with a ``code`` and a ``hint``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ckptconv.core.version import __version__

if TYPE_CHECKING:
    from ckptconv.core.errors import CkptconvError
    from ckptconv.engine.convert import convert, inspect
    from ckptconv.engine.convert import plan_conversion as plan
    from ckptconv.engine.diff import DiffResult
    from ckptconv.engine.diff import diff_checkpoints as diff
    from ckptconv.engine.execute import Progress
    from ckptconv.engine.layouts.api import convert_model, plan_model
    from ckptconv.engine.run import ConvertResult

# Name -> (module, attribute). Resolved on first access (module __getattr__) instead of imported
# here: Python imports this package before any of its modules, so importing the engine here would
# run it (and its imports: torch, h5py) in processes that never convert -- the API server among
# them. The type checker sees the imports above; the import-linter layers see the names as strings,
# and no lower layer imports this package (the version lives in ckptconv.core.version).
_EXPORTS: dict[str, tuple[str, str]] = {
    "convert": ("ckptconv.engine.convert", "convert"),
    "inspect": ("ckptconv.engine.convert", "inspect"),
    "plan": ("ckptconv.engine.convert", "plan_conversion"),
    "convert_model": ("ckptconv.engine.layouts.api", "convert_model"),
    "plan_model": ("ckptconv.engine.layouts.api", "plan_model"),
    "diff": ("ckptconv.engine.diff", "diff_checkpoints"),
    "DiffResult": ("ckptconv.engine.diff", "DiffResult"),
    "ConvertResult": ("ckptconv.engine.run", "ConvertResult"),
    "Progress": ("ckptconv.engine.execute", "Progress"),
    "CkptconvError": ("ckptconv.core.errors", "CkptconvError"),
}

__all__ = [
    "CkptconvError",
    "ConvertResult",
    "DiffResult",
    "Progress",
    "__version__",
    "convert",
    "convert_model",
    "diff",
    "inspect",
    "plan",
    "plan_model",
]


def __getattr__(name: str) -> Any:
    try:
        module, attr = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'ckptconv' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
