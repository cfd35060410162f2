"""Command-line flags generated from a job kind's options model, and the options read back from them.

A kind's options are written once, as its pydantic model in :mod:`ckptconv.jobs.kinds`: the flag
``--hf-shard-size`` of the option ``hf_shard_size``, its type, its choices, its range, its default and
its help all come from the model's field, so an option added to a model is a flag at once. Values are
checked by the model itself (the same check the HTTP API applies); a refused value is one
``invalid_request`` line naming the flag, or the typed error of a check the model makes with the
engine's tables (``unknown_model``).

The only flags written by hand are the other spellings in :data:`ALIASES`: the original Cerebras
tools' names (``--shuffle_seed``, ``-s``), switches that set one value (``--full-verify``,
``--non-strict``) and shorthand values (``bf16``), kept so existing run books go on working.
"""

from __future__ import annotations

import argparse
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from ckptconv.core.errors import CkptconvError, InvalidRequest
from ckptconv.jobs.kinds import JobKind, get_kind

DTYPE_SHORTHANDS = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "f16": "float16",
    "half": "float16",
    "fp32": "float32",
    "f32": "float32",
    "float": "float32",
    "fp64": "float64",
    "f64": "float64",
    "double": "float64",
}


NO_PRESET: Any = object()


@dataclass(frozen=True)
class Alias:
    """Other spellings of one option's flag, and how the command line treats the option."""

    flags: tuple[str, ...] = ()  # more names of the option's own flag
    own_flag: bool = True  # False: only ``switches`` set it (its own name means something else there)
    switches: tuple[tuple[str, Any], ...] = ()  # flags that set one value
    shorthands: Mapping[str, str] = field(default_factory=dict)  # short values accepted for the model's
    engine_checks: bool = False  # passed as typed: the engine refuses an unknown value with its own error
    preset: Any = NO_PRESET  # the value the command always gives, with no flag

    @property
    def fixed(self) -> bool:
        return self.preset is not NO_PRESET


# (kind, option) -> its other spellings. The one table of flags not generated from the models.
ALIASES: dict[tuple[str, str], Alias] = {
    ("convert", "dtype"): Alias(shorthands=DTYPE_SHORTHANDS),
    # `convert --verify` is the model form's (the Model Zoo's) switch; the container check has its own.
    ("convert", "verify"): Alias(own_flag=False, switches=(("--full-verify", "full"),)),
    ("verify", "config"): Alias(flags=("--cs-config",)),
    ("verify", "strict"): Alias(switches=(("--non-strict", False),)),
    # The command's exit status is the verdict (1 on a mismatch), so a mismatch is not an error there.
    ("verify", "fail_on_mismatch"): Alias(preset=False),
    # The command line converts in its own process: parts fanned out to workers are the service's.
    ("convert", "parallelism"): Alias(preset=1),
    ("convert-model", "parallelism"): Alias(preset=1),
    ("dataloader-state", "iter_dir"): Alias(flags=("--worker_data_iter_files_dir", "-w")),
    # The original script took any type name and refused an unknown one with its own error.
    ("dataloader-state", "dataloader_type"): Alias(flags=("--dataloader_type", "-d"), engine_checks=True),
    ("dataloader-state", "shuffle_seed"): Alias(flags=("--shuffle_seed", "-s")),
}

NO_ALIAS = Alias()


def dest(kind: str, option: str) -> str:
    """Where argparse keeps an option of a kind (kinds share option names: ``verify``)."""
    return f"{kind}.{option}"


def flag(option: str) -> str:
    return "--" + option.replace("_", "-")


def switch_flag(option: str, default: Any) -> str:
    """A boolean option is a switch away from its default: ``--fold-lora``, ``--no-fold-mup``."""
    return flag(option) if default is not True else "--no-" + option.replace("_", "-")


def _plain(annotation: Any) -> Any:
    """The annotation without ``None`` and ``Annotated`` (an optional option's flag is simply not given)."""
    while True:
        origin = get_origin(annotation)
        if origin is Annotated:
            annotation = get_args(annotation)[0]
        elif origin in (Union, types.UnionType):
            args = [a for a in get_args(annotation) if a is not type(None)]
            if len(args) != 1:
                return Union[tuple(args)]  # noqa: UP007 - rebuilt from its arguments
            annotation = args[0]
        else:
            return annotation


def _value_type(kind: str, option: str, annotation: Any) -> tuple[Any, dict[str, Any]]:
    """argparse's ``type`` and extra keywords for a value of ``annotation``."""
    if annotation in (int, float):
        return annotation, {}
    if annotation is str:
        return str, {}
    if get_origin(annotation) is Literal:
        choices = [str(c) for c in get_args(annotation)]
        # Shown, not enforced by argparse: the model refuses other values with a typed error.
        return str, {"metavar": "{" + ",".join(choices) + "}"}
    if get_origin(annotation) in (Union, types.UnionType):  # sizes: a byte count or "5GB"
        return str, {}
    raise TypeError(f"option {option!r} of job kind {kind!r}: no command-line type for {annotation!r}")


BOUNDS = (
    (annotated_types.Gt, "gt", ">"),
    (annotated_types.Ge, "ge", ">="),
    (annotated_types.Lt, "lt", "<"),
    (annotated_types.Le, "le", "<="),
)


def _bounds(info: FieldInfo) -> str:
    """The model's range of a number, as help shows it (``>= 0, <= 64``)."""
    found = []
    for m in info.metadata:
        found += [f"{word} {getattr(m, attr)}" for klass, attr, word in BOUNDS if isinstance(m, klass)]
    return ", ".join(found)


def _help(info: FieldInfo, *, default: Any, extra: str = "") -> str:
    text = info.description or ""
    notes = [n for n in (_bounds(info), extra) if n]
    if default is not None and not isinstance(default, bool):
        notes.append(f"default {default}")
    if notes:
        text = f"{text} ({'; '.join(notes)})" if text else "; ".join(notes)
    return text.replace("%", "%%")


def _shorthand_type(base: Any, shorthands: Mapping[str, str]) -> Any:
    def convert(value: str) -> Any:
        return shorthands.get(value.lower(), base(value))

    return convert


def add_kind_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    kind_name: str,
    *,
    required: bool = True,
    only: tuple[str, ...] | None = None,
    exclude: tuple[str, ...] = (),
) -> None:
    """Add a flag for every option of ``kind_name`` (or those in ``only``, but those in ``exclude``) to ``parser``.

    ``required=False`` leaves the model's required options optional on the command line (a command
    with two forms checks them itself).
    """
    kind = get_kind(kind_name)
    for option, info in kind.options.model_fields.items():
        if (only is not None and option not in only) or option in exclude:
            continue
        alias = ALIASES.get((kind_name, option), NO_ALIAS)
        if alias.fixed:
            continue
        default = None if info.is_required() else info.default
        to = dest(kind_name, option)
        annotation = _plain(info.annotation)
        for switch, value in alias.switches:
            parser.add_argument(
                switch,
                dest=to,
                action="store_const",
                const=value,
                default=default,
                help=f"{option} = {value!r}: " + _help(info, default=None),
            )
        if not alias.own_flag:
            continue
        if annotation is bool:
            parser.add_argument(
                switch_flag(option, default),
                *alias.flags,
                dest=to,
                action="store_false" if default is True else "store_true",
                default=default,
                help=_help(info, default=None, extra="on unless this flag is given" if default is True else ""),
            )
            continue
        value_type, extra = _value_type(kind_name, option, annotation)
        extra.setdefault("metavar", option.upper())
        if alias.shorthands:
            value_type = _shorthand_type(value_type, alias.shorthands)
        parser.add_argument(
            flag(option),
            *alias.flags,
            dest=to,
            type=value_type,
            default=default,
            required=required and info.is_required(),
            help=_help(info, default=default, extra=", ".join(alias.shorthands) if alias.shorthands else ""),
            **extra,
        )


def given_options(args: argparse.Namespace, kind_name: str) -> dict[str, Any]:
    """The options of ``kind_name`` set on the command line to other than their defaults."""
    kind = get_kind(kind_name)
    out = {}
    for option, info in kind.options.model_fields.items():
        value = getattr(args, dest(kind_name, option), None)
        if value is not None and value != (None if info.is_required() else info.default):
            out[option] = value
    return out


def flags_of(kind_name: str, option: str) -> str:
    """The flag(s) that set an option, as a message names them."""
    info = get_kind(kind_name).options.model_fields[option]
    alias = ALIASES.get((kind_name, option), NO_ALIAS)
    names = [s for s, _ in alias.switches]
    if alias.own_flag and not alias.fixed:
        annotation = _plain(info.annotation)
        default = None if info.is_required() else info.default
        names.insert(0, switch_flag(option, default) if annotation is bool else flag(option))
    return "/".join(names)


def kind_options(args: argparse.Namespace, kind_name: str) -> BaseModel:
    """The options model of ``kind_name`` from the parsed flags, checked as the HTTP API checks them."""
    kind: JobKind = get_kind(kind_name)
    raw: dict[str, Any] = {}
    unchecked: dict[str, Any] = {}
    for option in kind.options.model_fields:
        alias = ALIASES.get((kind_name, option), NO_ALIAS)
        if alias.fixed:
            value = alias.preset
        elif hasattr(args, dest(kind_name, option)):
            value = getattr(args, dest(kind_name, option))
        else:
            continue  # a command offering some options only: the model's default
        (unchecked if alias.engine_checks else raw)[option] = value
    try:
        options = kind.options.model_validate(raw, strict=False)
    except ValidationError as e:
        raise _refusal(kind_name, e) from None
    return options.model_copy(update=unchecked)


def _refusal(kind_name: str, e: ValidationError) -> CkptconvError:
    """One error for the values a model refused: the typed error of a model's own check (an unknown
    model name is ``unknown_model`` with its hint) when it is the only one, else one line per flag."""
    fields = get_kind(kind_name).options.model_fields
    problems: dict[str, str] = {}
    typed: list[CkptconvError] = []
    for err in e.errors():
        option = str(err["loc"][0]) if err["loc"] else ""
        where = flags_of(kind_name, option) if option in fields else option
        # One line per flag: of a union's errors (a size: a number or "5GB") the last, the text's.
        problems[where] = str(err["msg"]).removeprefix("Value error, ")
        cause = getattr((err.get("ctx") or {}).get("error"), "__cause__", None)
        if isinstance(cause, CkptconvError):
            typed.append(cause)
    if len(problems) == 1 and len(typed) == 1:
        return typed[0]
    message = "; ".join(f"{where}: {msg}" for where, msg in problems.items())
    return InvalidRequest(message, hint="see --help for the accepted values")
