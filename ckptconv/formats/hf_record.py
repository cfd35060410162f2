"""The ckptconv record of Hugging Face style files (safetensors, torch pickles and their indexes).

What a Hugging Face style file cannot say (the nesting, non-tensor values, links, which tensors
were numpy arrays, opaque objects) travels as one JSON record: in the safetensors header's
``__metadata__`` of a single file, in the index's ``metadata`` when sharded.

``build_record`` makes it from the entries, ``parse_record`` checks one read back, and
``entries_from_record`` rebuilds the entries a reader lists.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ckptconv.core.bounded import load_json
from ckptconv.core.errors import CorruptCheckpoint, UnsupportedFormat
from ckptconv.formats.base import Entry
from ckptconv.formats.links import link_root
from ckptconv.formats.tree import TreeSpec

if TYPE_CHECKING:
    pass


RECORD_KEY = "ckptconv"
RECORD_VERSION = 1
_RECORD_KINDS = ("value", "link", "array", "object")


def plain_value(v: Any) -> bool:
    """True for the values a record (JSON) keeps exactly."""
    return v is None or type(v) in (bool, int, float, str)


def build_record(entries: list[Entry], spec: TreeSpec | None) -> dict[str, Any] | None:
    """The record for ``entries``; None when they are plain tensors in a flat dict."""
    special: dict[str, dict[str, Any]] = {}
    for e in entries:
        if e.kind == "value":
            special[e.key] = {"kind": "value", "value": e.value}
        elif e.kind == "link":
            special[e.key] = {"kind": "link", "target": e.target}
        elif e.kind == "array":
            special[e.key] = {"kind": "array"}
        elif e.kind == "object":
            special[e.key] = {"kind": "object", "encoding": str(e.meta.get("encoding", "dill"))}
    if spec is None and not special:
        return None
    record: dict[str, Any] = {"version": RECORD_VERSION, "keys": [e.key for e in entries]}
    if spec is not None:
        record["spec"] = spec.to_json()
    record["entries"] = special
    return record


def parse_record(raw: Any, where: str) -> dict[str, Any]:
    """Validate a record read from a file (a JSON string in a header, an object in an index)."""
    if isinstance(raw, str):
        raw = load_json(raw, what=f"{where}: the {RECORD_KEY} metadata")
    if not isinstance(raw, dict) or type(raw.get("version")) is not int:
        raise CorruptCheckpoint(f"{where}: the {RECORD_KEY} metadata has no version")
    if raw["version"] > RECORD_VERSION:
        raise UnsupportedFormat(
            f"{where} was written by a newer ckptconv (record version {raw['version']})",
            hint="upgrade ckptconv to read it",
        )
    keys, special = raw.get("keys"), raw.get("entries", {})
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys) or len(set(keys)) != len(keys):
        raise CorruptCheckpoint(f"{where}: the {RECORD_KEY} metadata has no valid key list")
    if not isinstance(special, dict) or not set(special) <= set(keys):
        raise CorruptCheckpoint(f"{where}: the {RECORD_KEY} metadata describes keys it does not list")
    for key, info in special.items():
        if not isinstance(info, dict) or info.get("kind") not in _RECORD_KINDS:
            raise CorruptCheckpoint(f"{where}: {key!r} has an invalid record")
        if info["kind"] == "value" and not plain_value(info.get("value")):
            raise CorruptCheckpoint(f"{where}: {key!r} has a value that is not a plain scalar")
        if info["kind"] == "link" and info.get("target") not in keys:
            raise CorruptCheckpoint(f"{where}: link {key!r} points at a key that does not exist")
        if info["kind"] == "object" and not isinstance(info.get("encoding"), str):
            raise CorruptCheckpoint(f"{where}: object {key!r} has no encoding")
    if "spec" in raw and not isinstance(raw["spec"], str):
        raise CorruptCheckpoint(f"{where}: the {RECORD_KEY} spec is not a string")
    return raw


def entries_from_record(
    record: dict[str, Any] | None, stored: dict[str, Entry], where: str
) -> tuple[list[Entry], TreeSpec | None]:
    """The checkpoint's entries and spec from what the files hold (``stored``: tensors and links
    found in them, by key) and the record, if any. Objects are stored as 1-D uint8 tensors."""
    if record is None:
        return list(stored.values()), None
    keys: list[str] = record["keys"]
    special: dict[str, dict[str, Any]] = record.get("entries", {})
    listed = set(keys)
    unlisted = [k for k in stored if k not in listed]
    if unlisted:
        raise CorruptCheckpoint(f"{where}: {unlisted[:5]} are stored but missing from the {RECORD_KEY} key list")
    spec = TreeSpec.from_json(record["spec"]) if "spec" in record else None
    entries: list[Entry] = []
    for key in keys:
        info = special.get(key, {"kind": "tensor"})
        kind = info["kind"]
        if kind == "value":
            entries.append(Entry(key, "value", value=info.get("value")))
            continue
        if kind == "link":
            entries.append(Entry(key, "link", target=info["target"]))
            continue
        have = stored.get(key)
        if have is None or have.kind not in ("tensor", "array"):
            raise CorruptCheckpoint(f"{where}: {key!r} has no data")
        if kind == "object":
            if have.dtype != "uint8" or len(have.shape or ()) != 1:
                raise CorruptCheckpoint(f"{where}: object {key!r} is not stored as bytes")
            entries.append(Entry(key, "object", meta={"nbytes": have.nbytes, "encoding": info["encoding"]}))
        else:
            entries.append(Entry(key, kind, have.dtype, have.shape, meta=dict(have.meta)))
    return with_link_shapes(entries, where), spec


def with_link_shapes(entries: list[Entry], where: str) -> list[Entry]:
    """Links carry the dtype and shape of what they finally alias; cycles (LinkCycle) and links to
    nothing are refused."""
    by_key = {e.key: e for e in entries}
    out = []
    for e in entries:
        if e.kind == "link":
            root = link_root(e.key, by_key)
            if root not in by_key:
                raise CorruptCheckpoint(f"{where}: link {e.key!r} points nowhere")
            r = by_key[root]
            e = Entry(e.key, "link", r.dtype, r.shape, target=e.target, meta=dict(r.meta))
        out.append(e)
    return out
