"""The one pickle loader of ckptconv: builds plain data and never runs code named by the payload.

Cerebras checkpoints carry pickles (dill, protocol 4) in several places: the tree spec of legacy
H5 files, ``ObjectSerializer`` payloads, the ``__METADATA__`` object of the S3 layout; torch
archives carry ``data.pkl``. Any of them may come from an untrusted source, and unpickling
normally means calling whatever the payload names. :class:`RestrictedUnpickler` resolves every
global through the one allowlist of :mod:`ckptconv.formats.pickle_allowlist`; a pickle naming
anything else raises :class:`~ckptconv.core.errors.UnsafeCheckpoint` before a single call is made.
Malformed streams, and containers nested more than ``MAX_NESTING`` deep, raise
:class:`~ckptconv.core.errors.CorruptCheckpoint`. The outcome does not depend on the pickle
protocol: the same data pickled with protocol 0 or 5 loads (or is refused) alike.
"""

from __future__ import annotations

import collections
import io
import pickle
from typing import IO, Any

from ckptconv.core.errors import CheckpointError, CkptconvError, CorruptCheckpoint, UnsafeCheckpoint
from ckptconv.formats.pickle_allowlist import (
    MAX_NESTING,
    PickledLeafSpec,
    PickledTreeSpec,
    TorchDtype,
    _SafeNdarray,
    resolve_global,
)

__all__ = ["MAX_NESTING", "PickledLeafSpec", "PickledTreeSpec", "RestrictedUnpickler", "load_stream", "loads"]


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler whose globals come from the allowlist only; persistent ids are refused.

    ``weights_only`` narrows the allowlist to what ``torch.load(weights_only=True)`` accepts;
    ``dcp_metadata`` widens it by the classes of a distributed checkpoint's ``.metadata``.
    Subclasses that read external records (torch storages) override :meth:`persistent_load`.
    """

    def __init__(self, file: IO[bytes], *, weights_only: bool = False, dcp_metadata: bool = False) -> None:
        super().__init__(file)
        self.weights_only = weights_only
        self.dcp_metadata = dcp_metadata

    def find_class(self, module: str, name: str) -> Any:
        return resolve_global(module, name, weights_only=self.weights_only, dcp_metadata=self.dcp_metadata)

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpoint("the pickle uses persistent ids (external objects); refused")


def run(unpickler: pickle.Unpickler, what: str) -> Any:
    """``unpickler.load()`` with every failure typed and prefixed by ``what``."""
    try:
        return unpickler.load()
    except CheckpointError as e:
        raise type(e)(f"{what}: {e.message}", hint=e.hint, **e.details) from None
    except CkptconvError:  # e.g. a storage error while reading a persistent record: not a bad pickle
        raise
    except RecursionError:
        raise CorruptCheckpoint(f"{what}: the pickle is nested too deeply") from None
    except Exception as e:  # malformed streams raise a zoo of exception types
        raise CorruptCheckpoint(f"{what}: not a readable pickle ({type(e).__name__}: {e})") from None


def _finish(obj: Any, depth: int = 0) -> Any:
    """Numpy-array builders replaced by their arrays, torch dtype stand-ins by the dtypes."""
    if depth > MAX_NESTING:
        raise CorruptCheckpoint(f"the pickle nests containers more than {MAX_NESTING} deep")
    if isinstance(obj, _SafeNdarray):
        return obj.array
    if isinstance(obj, TorchDtype):
        import torch  # a pickle naming a torch dtype wants the dtype itself

        return getattr(torch, obj.name)
    if type(obj) is list:
        return [_finish(v, depth + 1) for v in obj]
    if type(obj) is tuple:
        return tuple(_finish(v, depth + 1) for v in obj)
    if type(obj) is dict:
        return {k: _finish(v, depth + 1) for k, v in obj.items()}
    if type(obj) is collections.OrderedDict:
        return collections.OrderedDict((k, _finish(v, depth + 1)) for k, v in obj.items())
    return obj


def load_stream(file: IO[bytes], *, what: str = "pickle", dcp_metadata: bool = False) -> Any:
    """The first pickle of ``file``, as plain data (see the module docstring); reads no further."""
    obj = run(RestrictedUnpickler(file, dcp_metadata=dcp_metadata), what)
    try:
        return _finish(obj)
    except CheckpointError as e:
        raise type(e)(f"{what}: {e.message}", hint=e.hint, **e.details) from None


def loads(data: bytes | bytearray | memoryview, *, what: str = "pickle", dcp_metadata: bool = False) -> Any:
    """Unpickle ``data`` allowing only plain data (see the module docstring).

    Raises UnsafeCheckpoint when the pickle names anything else, CorruptCheckpoint when it is
    malformed. ``what`` names the payload in error messages (e.g. "tree spec of legacy.mdl").
    ``dcp_metadata`` also allows the classes of a distributed checkpoint's ``.metadata``.
    """
    return load_stream(io.BytesIO(bytes(data)), what=what, dcp_metadata=dcp_metadata)


def try_loads(data: bytes | bytearray | memoryview) -> tuple[bool, Any]:
    """``(True, value)`` when ``data`` is a pickle of plain data, else ``(False, None)``; never raises."""
    try:
        return True, loads(data)
    except CheckpointError:
        return False, None
