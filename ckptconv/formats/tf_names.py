"""TensorFlow variable names as Cerebras checkpoint keys, and back.

A Cerebras checkpoint stores each key at its path (``a/b`` is dataset ``b`` in group ``a``), so
some TensorFlow names cannot be stored as they are:

- a variable whose name is also the group of other names: every TF1 variable trained with Adam
  (``layer_0/dense/bias`` beside its slots ``layer_0/dense/bias/Adam`` and ``.../Adam_1``);
- names with an empty path segment (a leading, trailing or doubled ``/``) or a ``.``/``..`` segment.

Such names are escaped, segment by segment, and every other name is kept as it is:

====================================  ==========================================
TensorFlow name                       Cerebras key
====================================  ==========================================
``%`` in a segment                    ``%25``
an empty segment                      ``%`` (``/a`` -> ``%/a``, ``a/`` -> ``a/%``)
a ``.`` / ``..`` segment              ``%2E`` / ``%2E%2E``
a variable that is also a group       its escaped name plus the segment ``%value``
====================================  ==========================================

so ``layer_0/dense/bias`` is stored as ``layer_0/dense/bias/%value`` beside
``layer_0/dense/bias/Adam``. Escaping only ever writes ``%`` as ``%25``, ``%2E`` or a lone ``%``,
so the mapping is one to one, and :func:`tf_name` undoes it exactly. Conversions from a TensorFlow
checkpoint to a Cerebras one apply :func:`cerebras_keys`; from a Cerebras checkpoint to
TensorFlow, :func:`tf_name` (a key without these escapes is its own TensorFlow name).
"""

from __future__ import annotations

from collections.abc import Iterable

from ckptconv.core.errors import KeyCollision

VALUE_SEGMENT = "%value"  # a variable stored below the group its name also is
_EMPTY = "%"
_SPECIAL = {"": _EMPTY, ".": "%2E", "..": "%2E%2E"}
_UNSPECIAL = {v: k for k, v in _SPECIAL.items()}


def _escape(segment: str) -> str:
    return _SPECIAL.get(segment) or segment.replace("%", "%25")


def _unescape(segment: str) -> str:
    if segment in _UNSPECIAL:
        return _UNSPECIAL[segment]
    return segment.replace("%25", "%")


def cerebras_keys(names: Iterable[str]) -> dict[str, str]:
    """TensorFlow name -> the Cerebras key it is stored under (the name itself when it can be)."""
    names = list(names)
    escaped = {n: "/".join(_escape(s) for s in n.split("/")) for n in names}
    groups = {k.rsplit("/", i)[0] for k in escaped.values() for i in range(1, k.count("/") + 1)}
    out = {n: f"{k}/{VALUE_SEGMENT}" if k in groups else k for n, k in escaped.items()}
    if len(set(out.values())) != len(out):  # cannot happen for distinct names; a guard for the invariant
        raise KeyCollision("two TensorFlow names escape to the same Cerebras key")
    return out


def tf_name(key: str) -> str:
    """The TensorFlow name a Cerebras key stands for (inverse of :func:`cerebras_keys`)."""
    segments = key.split("/")
    if len(segments) > 1 and segments[-1] == VALUE_SEGMENT:
        segments.pop()
    return "/".join(_unescape(s) for s in segments)
