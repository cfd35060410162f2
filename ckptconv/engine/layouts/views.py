"""A checkpoint seen under other key names, so a family's plan can run on part of a checkpoint.

Wrappers (a DPO policy, a DPR encoder, LLaVA's parts) hold a model's keys under a prefix. :class:`KeyView`
renames them to what the model's own table expects and hides the rest; a plan made over the view
is then turned back to the checkpoint's own keys with :func:`plan_on_source`, so execution reads
the real source and nothing is copied.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ckptconv.core.errors import ConversionError
from ckptconv.engine.plan import Plan
from ckptconv.formats.base import Entry, Extent, TensorSource
from ckptconv.formats.tree import TreeSpec, flat_dict_spec


class KeyView(TensorSource):
    """``inner`` with each key renamed by ``rename`` (None hides the entry; ``hidden`` lists them)."""

    def __init__(self, inner: TensorSource, rename: Callable[[str], str | None]) -> None:
        super().__init__(inner.storage, inner.uri)
        self.inner = inner
        self.format = inner.format
        self.original: dict[str, str] = {}
        self.hidden: list[str] = []
        self._entries: list[Entry] = []
        for e in inner.entries():
            key = rename(e.key)
            if key is None:
                self.hidden.append(e.key)
                continue
            target = e.target
            if e.kind == "link" and e.target:
                target = rename(e.target)
                if target is None:
                    raise self.hidden_link(e)
            self.original[key] = e.key
            self._entries.append(replace(e, key=key, target=target))

    def hidden_link(self, e: Entry) -> Exception:
        """The error for a visible entry aliasing a hidden one (subclasses say it in their terms)."""
        return ConversionError(f"{e.key} links to {e.target}, which is outside the part being converted")

    def entries(self) -> list[Entry]:
        return list(self._entries)

    @property
    def spec(self) -> TreeSpec | None:
        spec = self.inner.spec
        if spec is None or spec.is_leaf:
            return spec
        return replace_model_spec(spec, [k[len("model.") :] for k in self.original if k.startswith("model.")])

    @property
    def info(self) -> dict[str, Any]:
        return self.inner.info

    def read(self, key: str) -> Any:
        return self.inner.read(self.original[key])

    def extent(self, key: str) -> Extent | None:
        return self.inner.extent(self.original[key])

    def read_neighbours(self, keys: list[str]) -> list[Any]:
        return self.inner.read_neighbours([self.original[k] for k in keys])

    def files(self) -> list[str]:
        return self.inner.files()


def replace_model_spec(spec: TreeSpec, inner_keys: list[str]) -> TreeSpec:
    """``spec`` with its ``model`` child replaced by a flat dict of ``inner_keys`` (how a
    ``state_dict()`` nests), of the type the child had."""
    labels = [str(label) for label in spec.child_labels()]
    children = list(spec.children)
    flat = flat_dict_spec(inner_keys)
    if "model" in labels:
        i = labels.index("model")
        children[i] = TreeSpec(children[i].type, flat.context, flat.children)
    return TreeSpec(spec.type, list(spec.context), children)


def plan_on_source(plan: Plan, view: KeyView, *, drop_hidden: bool = True) -> Plan:
    """A plan made over ``view`` reading the viewed checkpoint's own keys (and naming them in its
    dropped and unmatched lists). The keys the view hides are listed as dropped unless
    ``drop_hidden`` is false (a part of a composite model: they are the other parts' keys)."""
    steps = [replace(s, inputs=tuple(view.original.get(k, k) for k in s.inputs)) for s in plan.steps]
    dropped = [view.original.get(k, k) for k in plan.dropped] + (view.hidden if drop_hidden else [])
    unmatched = [view.original.get(k, k) for k in plan.unmatched]
    return replace(plan, steps=steps, dropped=dropped, unmatched=unmatched)


def rename_outputs(plan: Plan, rename: Callable[[str], str | None]) -> Plan:
    """``plan`` with its output keys (and link targets) renamed; None drops the step."""
    steps = []
    dropped = list(plan.dropped)
    for s in plan.steps:
        key = rename(s.out.key)
        if key is None:
            dropped.append(s.out.key)
            continue
        target = rename(s.out.target) if s.out.kind == "link" and s.out.target else s.out.target
        steps.append(replace(s, out=replace(s.out, key=key, target=target)))
    return replace(plan, steps=steps, dropped=dropped)
