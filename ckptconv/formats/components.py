"""Checkpoints made of several sub-directories, one model component each (e.g. DPR's
``q_encoder/`` and ``ctx_encoder/``, each a Hugging Face model directory).

:class:`ComponentSource` reads them as one checkpoint: the entries of every component, in
component order, with their own keys (which must not collide). :class:`ComponentSink` writes one
checkpoint into the components: each entry goes to the first component whose key prefix it has,
through an ordinary sink of the format, so each sub-directory is a complete checkpoint of its own
(shards, index). The engine stages, verifies and publishes all of them as one output.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ckptconv.core.errors import KeyCollision, UnsupportedValue
from ckptconv.formats import sink_class
from ckptconv.formats.base import Entry, Extent, OutputFile, TensorSink, TensorSource
from ckptconv.formats.detect import open_source

if TYPE_CHECKING:
    from ckptconv.formats.tree import TreeSpec
    from ckptconv.storage.base import Storage


class ComponentSource(TensorSource):
    """The checkpoints in ``<uri>/<name>/`` for each of ``names``, read as one."""

    def __init__(self, storage: Storage, uri: str, names: Sequence[str]) -> None:
        super().__init__(storage, uri.rstrip("/"))
        self.format = "components"
        self.names = list(names)
        self.parts: dict[str, TensorSource] = {}
        self._component: dict[str, str] = {}  # key -> the component it was read from
        self._entries: list[Entry] = []
        try:
            for name in self.names:
                # Through the one view of the whole checkpoint: its versions are the job's.
                part = open_source(storage.join(self.uri, name), storage=storage)
                self.parts[name] = part
                for e in part.entries():
                    if e.key in self._component:
                        raise KeyCollision(f"{e.key!r} is in two components ({name} and another)", key=e.key)
                    self._component[e.key] = name
                    self._entries.append(e)
        except BaseException:
            self.close()
            raise

    def entries(self) -> list[Entry]:
        return list(self._entries)

    def read(self, key: str) -> Any:
        return self.parts[self._component[key]].read(key)

    def extent(self, key: str) -> Extent | None:
        return self.parts[self._component[key]].extent(key)

    def read_neighbours(self, keys: list[str]) -> list[Any]:
        names = {self._component[k] for k in keys}
        if len(names) > 1:  # not neighbours: neighbours lie in one file, so in one component
            return super().read_neighbours(keys)
        return self.parts[names.pop()].read_neighbours(keys)

    def component_of(self, key: str) -> str:
        """The sub-directory ``key`` was read from."""
        return self._component[key]

    def files(self) -> list[str]:
        return [f for part in self.parts.values() for f in part.files()]

    @property
    def info(self) -> dict[str, Any]:
        return {"components": {name: part.format for name, part in self.parts.items()}}

    def close(self) -> None:
        for part in self.parts.values():
            part.close()


class ComponentSink(TensorSink):
    """Writes ``<uri>/<name>/`` with a ``fmt`` sink for each ``(name, key prefix)`` of ``routes``."""

    def __init__(
        self, storage: Storage, uri: str, *, fmt: str, routes: Sequence[tuple[str, str]], **options: Any
    ) -> None:
        super().__init__(storage, uri.rstrip("/"), fmt=fmt, routes=routes, **options)
        self.format = fmt
        cls = sink_class(fmt)
        self.supports_links = cls.supports_links
        self.routes = list(routes)
        self.sinks = {name: cls(storage, storage.join(self.uri, name), **options) for name, _ in self.routes}
        self._sink_of: dict[str, TensorSink] = {}

    def _route(self, key: str) -> str:
        for name, prefix in self.routes:
            if key.startswith(prefix):
                return name
        raise UnsupportedValue(f"{key!r} belongs to no component ({', '.join(p for _, p in self.routes)})", key=key)

    def check(self, entries: Any) -> None:  # type: ignore[override]
        for sink in self.sinks.values():
            sink.check(entries)

    def _begin(self, entries: list[Entry], spec: TreeSpec | None) -> None:
        # Each component is a flat state dict of its own: ``spec`` (the whole tree) is not split.
        parts: dict[str, list[Entry]] = {name: [] for name, _ in self.routes}
        for e in entries:
            name = self._route(e.key)
            if e.kind == "link" and e.target and self._route(e.target) != name:
                raise UnsupportedValue(f"{e.key!r} links into another component ({e.target!r})", key=e.key)
            parts[name].append(e)
            self._sink_of[e.key] = self.sinks[name]
        for name, sink in self.sinks.items():
            sink.begin(parts[name], None)

    def _write(self, key: str, value: Any) -> None:
        self._sink_of[key].write(key, value)

    def _commit(self) -> list[OutputFile]:
        out: list[OutputFile] = []
        for sink in self.sinks.values():
            out.extend(sink.commit())
        return out

    def _abort(self) -> None:
        for sink in self.sinks.values():
            sink.abort()
