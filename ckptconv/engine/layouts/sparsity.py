"""Sparsity masks across release 2.2: ``optimizer.sparsity`` -> model ``<p>_mask`` + top-level ``sparsity``.

Releases 2.0 and 2.1 keep sparsity in a sparsity optimizer wrapped around the real one; its state
dict sits under ``optimizer["sparsity"]``::

    {"state": {p: {"mask": bool tensor, ...}, ...},   # p = the model state-dict key of the parameter
     "param_groups": [{"param_names": [p, ...], "sparsity": {"step": ...} | float, ...}, ...],
     "step": int64 0-d tensor}                           # dynamic sparsity only

From 2.2 on, ``cstorch.sparse`` registers each mask as a persistent buffer ``<param>_mask`` next to
its parameter (so the model state dict holds ``<p>_mask``) and the trainer saves the algorithm's
state as the top-level ``sparsity`` entry (``{"step": ..., "sparsity": {p: schedule state}}``).

The Model Zoo's CS -> CS converter (``BaseCheckpointConverter_CS_CS.post_checkpoint_convert``,
since 2.2) moves one layout into the other: every ``state[p]["mask"]`` with ``p`` in the model
becomes ``model["<p>_mask"]``, ``optimizer["sparsity"]`` is removed, and the new top-level
``sparsity`` holds ``step`` (if the optimizer had one) and ``sparsity = {p: {"index":
param_group["sparsity"]["step"]}}`` for the groups whose ``sparsity`` is a dict with a ``step``
(only when there is any). Here the move is planned from metadata (the tree spec and the entries):
nothing is read, each mask is copied as it is (dtype and bits), one tensor per step.

Deliberate differences: the move happens when the target release is 2.2 or newer (the Model Zoo
does it on any CS -> CS conversion, which leaves a 2.0/2.1 target unable to load its masks); a
parameter renamed on the way (2.0 -> 2.1 embeddings) keeps its mask under its new name; a mask
the Model Zoo would drop silently (its parameter is not in the model) or overwrite with is a
:class:`~ckptconv.core.errors.SparsityStateError`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from ckptconv.core.errors import SparsityStateError
from ckptconv.engine.plan import Step
from ckptconv.formats.base import Entry
from ckptconv.formats.links import link_root
from ckptconv.formats.tree import DICT, LIST, ODICT, TUPLE, TreeSpec

MASK_RELEASE = (2, 2)  # first release that keeps masks in the model and the state at the top level
MODEL = "model"
OPTIMIZER = "optimizer"
SPARSITY = "sparsity"
METADATA = "__metadata__"
MASK_SUFFIX = "_mask"

_DICTS = (DICT, ODICT)
_HINT = (
    "the sparsity state does not belong to this model checkpoint; convert the checkpoint it was saved with, "
    "or remove optimizer.sparsity to convert it without its masks"
)


@dataclass
class MaskMove:
    """What the move adds and takes away; ``None`` from :func:`plan_mask_move` when there is nothing to move."""

    mask_steps: list[Step]  # model.<p'>_mask, in the order of optimizer.sparsity.state
    state_steps: list[Step]  # the new top-level `sparsity` entry
    state_spec: TreeSpec  # its tree node
    consumed: frozenset[str]  # every source key below optimizer.sparsity (none is copied as it is)
    dropped: list[str]  # the consumed keys written nowhere
    warnings: list[str] = field(default_factory=list)


def sparsity_optimizer(spec: TreeSpec | None) -> TreeSpec | None:
    """The ``optimizer.sparsity`` node when it holds a ``state`` (the Model Zoo's condition), else None."""
    node = _child(spec, OPTIMIZER)
    node = _child(node, SPARSITY)
    if node is None or node.type not in _DICTS or _child(node, "state") is None:
        return None
    return node


def plan_mask_move(
    spec: TreeSpec | None,
    by_key: Mapping[str, Entry],
    params: Mapping[str, str | None],
) -> MaskMove | None:
    """Plan the move of ``optimizer.sparsity`` (see the module docstring).

    ``params`` maps each model state-dict key of the source (as the sparsity optimizer names its
    parameters: the flat key without the top-level ``model.``) to its key in the output model
    state dict, or to None when the conversion does not write that parameter.
    """
    node = sparsity_optimizer(spec)
    if node is None:
        return None
    assert spec is not None
    if _child(spec, SPARSITY) is not None:
        raise SparsityStateError(
            "the checkpoint has both optimizer.sparsity (releases 2.0-2.1) and a top-level sparsity entry (2.2+)",
            hint="it mixes two releases' sparsity state; convert a checkpoint saved by one release",
        )
    base = f"{OPTIMIZER}.{SPARSITY}"
    consumed = frozenset(_leaf_keys(node, base))
    used: set[str] = set()
    warnings: list[str] = []

    # Masks -> model["<p>_mask"].
    outputs = {v for v in params.values() if v is not None}
    state = _child(node, "state")
    assert state is not None
    if state.type not in _DICTS:
        raise SparsityStateError(f"{base}.state is not a dict of per-parameter states", hint=_HINT)
    mask_steps: list[Step] = []
    lost: list[str] = []
    for label, per_param in zip(state.child_labels(), state.children, strict=True):
        p = str(label)
        where = f"{base}.state[{p!r}]"
        if per_param.type not in _DICTS:
            raise SparsityStateError(f"{where} is not a dict (expected {{'mask': tensor}})", hint=_HINT)
        mask = _child(per_param, "mask")
        if mask is None:
            continue  # nothing to move; the Model Zoo skips it too
        mask_key = f"{base}.state.{p}.mask"
        if not mask.is_leaf:
            raise SparsityStateError(f"{where}['mask'] is a container, not a tensor", hint=_HINT)
        mask_entry = _resolved(by_key, mask_key)
        if mask_entry.kind not in ("tensor", "array"):
            raise SparsityStateError(f"{where}['mask'] is {_kind(mask_entry)}, not a tensor", hint=_HINT)
        if p not in params:
            raise SparsityStateError(
                f"{where} holds a sparsity mask for {p!r}, which is not a parameter of the model{_near(p, params)}",
                hint=_HINT,
                parameter=p,
            )
        out = params[p]
        if out is None:
            lost.append(p)
            continue
        param = _resolved(by_key, f"{MODEL}.{p}")
        if param.shape is not None and mask_entry.shape is not None and tuple(param.shape) != tuple(mask_entry.shape):
            raise SparsityStateError(
                f"the sparsity mask of {p!r} has shape {list(mask_entry.shape)} "
                f"but the parameter has {list(param.shape)}",
                hint=_HINT,
                parameter=p,
            )
        new = out + MASK_SUFFIX
        if new in outputs:
            raise SparsityStateError(
                f"the model already has {new!r}; the sparsity mask of {p!r} cannot be moved there",
                hint="the checkpoint holds masks in the model and in optimizer.sparsity; convert a checkpoint "
                "saved by one release",
                parameter=p,
            )
        outputs.add(new)
        mask_steps.append(copy_step(f"{MODEL}.{new}", mask_key, by_key))
        used.add(mask_key)
    if lost:
        warnings.append(
            f"{len(lost)} sparsity masks were dropped with their parameters, which this conversion does not write: "
            + ", ".join(lost[:20])
        )

    # The rest of the sparsity optimizer -> the top-level `sparsity` entry.
    labels: list[str] = []
    children: list[TreeSpec] = []
    state_steps: list[Step] = []
    step = _child(node, "step")
    if step is not None:
        labels.append("step")
        children.append(step)
        state_steps += _copy_tree(step, f"{base}.step", f"{SPARSITY}.step", by_key, used)
    schedules = _schedules(node, base, by_key)
    if schedules:
        names: dict[str, tuple[str, TreeSpec]] = {}
        for name, (src, sub) in schedules.items():
            names[params.get(name) or name] = (src, sub)
        labels.append(SPARSITY)
        children.append(TreeSpec(DICT, list(names), [TreeSpec(DICT, ["index"], [sub]) for _, sub in names.values()]))
        for name, (src, sub) in names.items():
            state_steps += _copy_tree(sub, src, f"{SPARSITY}.{SPARSITY}.{name}.index", by_key, used)

    warnings.append(
        f"{len(mask_steps)} sparsity masks moved from optimizer.sparsity into the model as <parameter>_mask; "
        "the sparsity optimizer's step and schedule state became the top-level sparsity entry"
    )
    dropped = [k for k in _leaf_keys(node, base) if k not in used]
    return MaskMove(mask_steps, state_steps, TreeSpec(DICT, labels, children), consumed, dropped, warnings)


def moved_spec(spec: TreeSpec, move: MaskMove) -> TreeSpec:
    """``spec`` (an output spec, top level a dict) without ``optimizer.sparsity`` and with the
    top-level ``sparsity`` node, placed before ``__metadata__`` (the release record stays last)."""
    labels = list(spec.child_labels())
    children = list(spec.children)
    names = [str(x) for x in labels]
    if OPTIMIZER in names:
        i = names.index(OPTIMIZER)
        opt = children[i]
        keep = [(lab, c) for lab, c in zip(opt.child_labels(), opt.children, strict=True) if str(lab) != SPARSITY]
        children[i] = TreeSpec(opt.type, [lab for lab, _ in keep], [c for _, c in keep])
    at = names.index(METADATA) if METADATA in names else len(names)
    labels.insert(at, SPARSITY)
    children.insert(at, move.state_spec)
    return TreeSpec(spec.type, labels, children)


def downgrade_warning(spec: TreeSpec | None, model_keys: list[str], target: str) -> str | None:
    """A warning when a 2.2+ checkpoint's sparsity state goes to a release before 2.2, which keeps it
    in ``optimizer.sparsity`` instead: the Model Zoo has no reverse move, and neither is one made here."""
    present = set(model_keys)
    masks = [k for k in model_keys if k.endswith(MASK_SUFFIX) and k[: -len(MASK_SUFFIX)] in present]
    has_state = _child(spec, SPARSITY) is not None
    if not has_state and not masks:
        return None
    found = [f"{len(masks)} <parameter>_mask model entries"] + (["a top-level sparsity entry"] if has_state else [])
    return (
        f"the checkpoint keeps sparsity as 2.2+ does ({', '.join(found)}); release {target} expects the masks "
        "in optimizer.sparsity and there is no conversion back, so they are copied as they are and that "
        "release will not load them as sparsity masks"
    )


# --- helpers ----------------------------------------------------------------------------------


def _child(node: TreeSpec | None, label: str) -> TreeSpec | None:
    if node is None or node.type not in _DICTS:
        return None
    for lab, c in zip(node.child_labels(), node.children, strict=True):
        if str(lab) == label:
            return c
    return None


def _leaf_keys(node: TreeSpec, prefix: str) -> list[str]:
    return [f"{prefix}.{k}" if k else prefix for k in node.keys()]  # noqa: SIM118 - TreeSpec.keys() is a list


def _resolved(by_key: Mapping[str, Entry], key: str) -> Entry:
    final = link_root(key, by_key)
    if final not in by_key:
        raise SparsityStateError(f"{key} is listed in the checkpoint's tree spec but has no stored value")
    return by_key[final]


def copy_step(out_key: str, src_key: str, by_key: Mapping[str, Entry]) -> Step:
    """A step writing the value of ``src_key`` (links followed) unchanged at ``out_key``."""
    e = _resolved(by_key, src_key)
    if e.kind == "value":
        return Step(Entry(out_key, "value", value=e.value))
    return Step(replace(e, key=out_key, target=None), (e.key,))


def _copy_tree(node: TreeSpec, src: str, dst: str, by_key: Mapping[str, Entry], used: set[str]) -> list[Step]:
    steps = []
    for k in node.keys():  # noqa: SIM118 - TreeSpec.keys() lists flat leaf keys; it is not a dict
        s = f"{src}.{k}" if k else src
        steps.append(copy_step(f"{dst}.{k}" if k else dst, s, by_key))
        used.add(s)
    return steps


def _kind(e: Entry) -> str:
    if e.kind == "value":
        return "None" if e.value is None else f"a {type(e.value).__name__}"
    return f"an {e.kind}" if e.kind[0] in "aeiou" else f"a {e.kind}"


def _near(p: str, params: Mapping[str, str | None]) -> str:
    inner = "model."
    other = p[len(inner) :] if p.startswith(inner) else inner + p
    return f" (the model has {other!r})" if other in params else ""


def _schedules(node: TreeSpec, base: str, by_key: Mapping[str, Entry]) -> dict[str, tuple[str, TreeSpec]]:
    """Parameter name -> (source key, node) of its group's ``sparsity.step``, for every group whose
    ``sparsity`` is a dict with a ``step``; a later group wins a name listed twice (as in a dict)."""
    groups = _child(node, "param_groups")
    if groups is None or groups.is_leaf:
        return {}
    if groups.type not in (LIST, TUPLE, *_DICTS):
        raise SparsityStateError(f"{base}.param_groups is not a list of parameter groups", hint=_HINT)
    out: dict[str, tuple[str, TreeSpec]] = {}
    for label, group in zip(groups.child_labels(), groups.children, strict=True):
        where = f"{base}.param_groups.{label}"
        if group.type not in _DICTS:
            raise SparsityStateError(f"{where} is not a dict", hint=_HINT)
        step = _child(_child(group, SPARSITY), "step")
        if step is None:
            continue
        names = _child(group, "param_names")
        if names is None or names.type not in (LIST, TUPLE):
            raise SparsityStateError(f"{where} has a sparsity schedule but no list of param_names", hint=_HINT)
        for i, leaf in enumerate(names.children):
            key = f"{where}.param_names.{i}"
            e = _resolved(by_key, key) if leaf.is_leaf else None
            if e is None or e.kind != "value" or not isinstance(e.value, str):
                raise SparsityStateError(f"{key} is not a parameter name (a string)", hint=_HINT)
            out[e.value] = (f"{where}.{SPARSITY}.step", step)
    return out
