"""Model-layout conversion entry points: plan (dry run), convert a checkpoint, convert a config.

Outputs are named as the Model Zoo names them (reference §1.6): in the output directory (default:
beside the input), ``<base>_to_cs-X.Y.mdl`` with ``<config>_to_cs-X.Y.yaml``, or a directory
``<base>_to_hf/`` holding the shards, their index and ``config.json``. ``<base>`` is the input
name without its trailing alphabetic extensions (``pytorch_model.bin.index.json`` ->
``pytorch_model``, ``checkpoint_1.7.mdl`` -> ``checkpoint_1.7``).

Deviations from the Model Zoo, on purpose:

- a single ``.safetensors`` file or a Hugging Face directory is accepted as input;
- the converted config is written beside the converted checkpoint (one atomic publication);
- ``cs-current`` is the newest release this build knows (cs-2.9), not an installed package's;
- HF -> CS writes ``__cstorch_version__`` = the target release, so ``cs-auto`` reads it back.
"""

from __future__ import annotations

import functools
import posixpath
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptconv.core.errors import InvalidRequest
from ckptconv.core.uri import basename, normalize_uri, parent
from ckptconv.engine.convert import h5_compression_options
from ckptconv.engine.cs_yaml import dump_cs_yaml
from ckptconv.engine.fanout import AutoParallelism, resolve_parallelism, run_fanout, run_part
from ckptconv.engine.layouts import upgrades
from ckptconv.engine.layouts.config_files import dump_hf_json, find_hf_config, load_config
from ckptconv.engine.layouts.config_plan import ConfigResult
from ckptconv.engine.layouts.family import COMPOSITE
from ckptconv.engine.layouts.models import build_plan, convert_config_dict, planner_of
from ckptconv.engine.layouts.planner import Request
from ckptconv.engine.layouts.registry import model_table
from ckptconv.engine.layouts.upgrades import parse_model_format
from ckptconv.engine.plan import Plan
from ckptconv.engine.run import ConvertResult, run_plan
from ckptconv.formats.components import ComponentSink, ComponentSource
from ckptconv.formats.detect import open_source
from ckptconv.storage import open_storage
from ckptconv.storage.pinned import pin_reads

if TYPE_CHECKING:  # for annotations only
    from ckptconv.engine.execute import Progress
    from ckptconv.formats.base import TensorSource

DEFAULT_HF_SHARD_SIZE = "10GB"


# --- config documents ------------------------------------------------------------------------


# --- names ----------------------------------------------------------------------------------


def strip_extensions(name: str) -> str:
    """Drop every trailing purely alphabetic extension: ``pytorch_model.bin.index.json`` -> ``pytorch_model``."""
    parts = name.split(".")
    while len(parts) > 1 and re.fullmatch(r"[A-Za-z]+", parts[-1]):
        parts.pop()
    return ".".join(parts)


def _source_base(source: Any) -> str:
    if source.format == "components":
        return "pytorch_model"  # what the Model Zoo names a checkpoint packed from component directories
    uri = source.uri.rstrip("/")
    name = basename(uri)
    if source.format == "dcp":
        # A distributed checkpoint is its directory (step-1000/), also when named by its .metadata.
        return basename(parent(uri)) if name == ".metadata" else name
    if "." in name:
        return strip_extensions(name)
    files = [f for f in source.files() if f.rstrip("/") != uri]
    index = [f for f in files if f.endswith(".index.json")]
    pick = index[0] if index else (files[0] if files else uri)
    base = strip_extensions(basename(pick))
    return re.sub(r"-\d{5}-of-\d{5}$", "", base)


def output_names(source: Any, config_uri: str | None, tgt_node: str, *, output_dir: str | None) -> tuple[str, str]:
    """(checkpoint target URI, config file path relative to the target's parent)."""

    src_uri = source.uri.rstrip("/")
    storage = open_storage(src_uri)
    base = _source_base(source)
    if output_dir is None:
        # Beside the input file; for a directory source (an HF model directory), inside it.
        output_dir = parent(src_uri) if storage.exists(src_uri) else src_uri
    if tgt_node == "hf":
        target = storage.join(output_dir.rstrip("/"), f"{base}_to_hf")
        return target, f"{base}_to_hf/config.json"
    cfg_base = strip_extensions(basename(config_uri)) if config_uri else "config"
    target = storage.join(output_dir.rstrip("/"), f"{base}_to_{tgt_node}.mdl")
    return target, f"{cfg_base}_to_{tgt_node}.yaml"


def planned_target(source: Any, plan: Plan, config: Any, output_dir: str | None) -> str:
    """Where a conversion with ``plan`` would write its checkpoint."""
    cfg_uri = config if isinstance(config, str) else None
    if cfg_uri is None and plan.extras.get("source_format") == "hf":
        cfg_uri = find_hf_config(source.uri)
    return output_names(source, cfg_uri, _target_label(plan), output_dir=output_dir)[0]


def _target_label(plan: Plan) -> str:
    """The target format as output names spell it (``cs-2.9``, or ``cs-2.9-dpo`` for a wrapper)."""
    return plan.extras.get("target_label", plan.extras["target_format"])


def output_target(
    src_uri: str,
    tgt_fmt: str,
    config: Any,
    output_dir: str | None,
    *,
    model: str | None = None,
    src_fmt: str | None = None,
) -> str:
    """The checkpoint target of a conversion, from the request alone (opens the source's metadata)."""
    tgt = parse_model_format(tgt_fmt, side="target")
    source, _ = _open(src_uri, model, src_fmt)
    try:
        return output_names(source, config if isinstance(config, str) else None, tgt, output_dir=output_dir)[0]
    finally:
        source.close()


# --- planning -------------------------------------------------------------------------------


def open_model_source(uri: str, model: str | None = None, src_fmt: str | None = None, fmt: str | None = None) -> Any:
    """The source of a model conversion: the checkpoint at ``uri``, or for a model whose Hugging
    Face side is several directories (DPR, LLaVA), those directories read as one."""

    table = model_table(model) if model is not None else None
    if table is not None and table.kind == COMPOSITE and src_fmt == "hf":
        uri = normalize_uri(uri)
        return ComponentSource(pin_reads(open_storage(uri)), uri, table.components)
    return open_source(uri, fmt)


def _open(src: Any, model: str | None = None, src_fmt: str | None = None) -> tuple[Any, bool]:
    if isinstance(src, str):
        return open_model_source(src, model, src_fmt), True
    return src, False


def _request(model: str, src_fmt: str, tgt_fmt: str, options: Mapping[str, Any]) -> Request:
    return Request(
        model=model,
        src_fmt=src_fmt,
        tgt_fmt=tgt_fmt,
        drop_unmatched_keys=bool(options.get("drop_unmatched_keys", False)),
        fold_lora=bool(options.get("fold_lora", False)),
        fold_mup=bool(options.get("fold_mup", True)),
    )


def _config_for(source: Any, config: Any, src_fmt: str) -> tuple[dict[str, Any] | None, str | None]:
    doc, uri = load_config(config)
    if doc is None and src_fmt == "hf":
        found = find_hf_config(source.uri)
        if found is not None:
            doc, uri = load_config(found)
    return doc, uri


def _warn_unmapped_config_keys(plan: Plan, conf: ConfigResult) -> None:
    """Config keys no rule maps are left out of the converted config, as the Model Zoo leaves them
    (it logs "Key not matched"); say which, so a lost setting is not a surprise."""
    if conf.ignored:
        plan.warnings.append(
            f"{len(conf.ignored)} config keys not converted (Key not matched: no rule maps them): "
            + ", ".join(conf.ignored)
        )


def plan_model(
    src: Any,
    *,
    model: str,
    src_fmt: str,
    tgt_fmt: str,
    config: str | Mapping[str, Any] | None = None,
    export_safetensors: bool = False,
    h5_compression: str = "none",
    **options: Any,
) -> Plan:
    """Dry run: the plan of a model conversion (matched, unmatched and dropped keys, the converted
    config, warnings) from metadata only. Unmatched keys are listed, not raised; options the
    output's format refuses (``h5_compression`` for a Hugging Face output) are, as the run refuses them."""
    source, opened = _open(src, model, src_fmt)
    try:
        doc, _ = _config_for(source, config, src_fmt)
        plan, conf = build_plan(source, doc, _request(model, src_fmt, tgt_fmt, options), strict=False)
        h5_compression_options(_output_format(plan, export_safetensors), h5_compression)
        _warn_unmapped_config_keys(plan, conf)
        return plan
    finally:
        if opened:
            source.close()


def _output_format(plan: Plan, export_safetensors: bool) -> str:
    """The container format a model conversion with ``plan`` writes."""
    if plan.extras["target_format"] == "hf":
        return "safetensors" if export_safetensors else "torch"
    return "cs-h5"


@dataclass
class ModelOutput:
    """What a model conversion writes, all of it from the source's metadata and config (so every
    part of a fanned-out conversion derives the same plan and names)."""

    plan: Plan
    to: str
    target: str
    sink_options: dict[str, Any]
    extra_files: dict[str, bytes]
    extras: dict[str, Any]
    sink_factory: Callable[..., Any] | None = None
    reopen: Callable[..., Any] | None = None


def model_output(
    source: TensorSource,
    dst: str | None,
    *,
    model: str,
    src_fmt: str,
    tgt_fmt: str,
    config: str | Mapping[str, Any] | None = None,
    drop_unmatched_keys: bool = False,
    export_safetensors: bool = False,
    hf_shard_size: int | str | None = DEFAULT_HF_SHARD_SIZE,
    fold_lora: bool = False,
    fold_mup: bool = True,
    h5_compression: str = "none",
) -> ModelOutput:
    """The plan, target, sink options and extra files of converting ``source`` (see convert_model)."""
    doc, cfg_uri = _config_for(source, config, src_fmt)
    req = _request(
        model,
        src_fmt,
        tgt_fmt,
        {"drop_unmatched_keys": drop_unmatched_keys, "fold_lora": fold_lora, "fold_mup": fold_mup},
    )
    plan, conf = build_plan(source, doc, req)
    _warn_unmapped_config_keys(plan, conf)
    tgt_node = plan.extras["target_format"]
    target, cfg_rel = output_names(source, cfg_uri, _target_label(plan), output_dir=dst)
    components = plan.extras.get("components")
    to = _output_format(plan, export_safetensors)
    if tgt_node == "hf":
        # The Model Zoo always writes shard names and an index, even for one shard.
        sink_options: dict[str, Any] = {"shard_size": hf_shard_size, "always_sharded": True}
        config_bytes = dump_hf_json(conf.target)
    else:
        sink_options = {"cstorch_version": f"{upgrades.release_of(tgt_node)}.0"}
        config_bytes = dump_cs_yaml(conf.target)
        if export_safetensors:
            plan.warnings.append("--export-safetensors applies to Hugging Face outputs only; ignored")
    sink_options.update(h5_compression_options(to, h5_compression))
    extras = {k: v for k, v in plan.extras.items() if k not in ("config_ignored_keys", "components")}
    out = ModelOutput(plan, to, target, sink_options, {cfg_rel: config_bytes}, {"model_conversion": extras})
    if components:  # several model directories in one output (DPR's encoders, LLaVA's parts)
        found = planner_of(model)
        assert found is not None  # only a composite model's plan has components
        out.extra_files = found[1].hf_config_files(plan, posixpath.dirname(cfg_rel), target)
        out.sink_factory = functools.partial(ComponentSink, fmt=to, routes=components)
        out.reopen = functools.partial(ComponentSource, names=[name for name, _ in components])
    return out


def convert_model(
    src: str,
    dst: str | None = None,
    *,
    model: str,
    src_fmt: str,
    tgt_fmt: str,
    config: str | Mapping[str, Any] | None = None,
    drop_unmatched_keys: bool = False,
    export_safetensors: bool = False,
    hf_shard_size: int | str | None = DEFAULT_HF_SHARD_SIZE,
    fold_lora: bool = False,
    fold_mup: bool = True,
    verify: bool = True,
    progress: Callable[[Progress], None] | None = None,
    cancelled: Callable[[], bool] | None = None,
    job_id: str | None = None,
    staging: str | None = None,
    parallelism: int | str = 1,
    parts: Any = None,
    auto_parallelism: AutoParallelism | None = None,
    h5_compression: str = "none",
) -> ConvertResult:
    """Convert a checkpoint between model layouts; ``dst`` is the output directory (default:
    beside the input). Returns the engine's ConvertResult (outputs, manifest, warnings).

    ``parallelism`` > 1 fans the conversion out (see :mod:`ckptconv.engine.fanout`; ``parts``
    hands the parts to workers; ``"auto"``: by the output's size, see
    :func:`~ckptconv.engine.fanout.resolve_parallelism`); not for composite models, whose output
    spans several formats' directories (``"auto"`` picks 1 for them), nor for a cs-h5 output with
    ``h5_compression="lz4"`` (LZ4-chunked datasets; see :func:`~ckptconv.engine.convert.convert`)."""

    source, _ = _open(src, model, src_fmt)
    try:
        out = model_output(
            source,
            dst,
            model=model,
            src_fmt=src_fmt,
            tgt_fmt=tgt_fmt,
            config=config,
            drop_unmatched_keys=drop_unmatched_keys,
            export_safetensors=export_safetensors,
            hf_shard_size=hf_shard_size,
            fold_lora=fold_lora,
            fold_mup=fold_mup,
            h5_compression=h5_compression,
        )
        common: dict[str, Any] = {
            "to": out.to,
            "target": out.target,
            "sink_options": out.sink_options,
            "extra_files": out.extra_files,
            "staging": staging,
            "progress": progress,
            "cancelled": cancelled,
            "job_id": job_id,
            "verify": verify,
            "extras": out.extras,
        }
        count = 1 if parallelism == "auto" and out.sink_factory is not None else parallelism
        count = resolve_parallelism(count, out.plan.bytes_total, out.to, auto_parallelism, out.sink_options)
        if count > 1:
            if out.sink_factory is not None:
                raise InvalidRequest(f"{model} writes several model directories: parallelism must be 1")
            result = run_fanout(out.plan, source, parallelism=count, runner=parts, **common)
        else:
            result = run_plan(out.plan, source, sink_factory=out.sink_factory, reopen=out.reopen, **common)
        for w in out.plan.warnings:
            if w not in result.warnings:
                result.warnings.append(w)
        return result
    finally:
        source.close()


def convert_model_part(
    src: str,
    dst: str | None,
    index: int,
    *,
    job_id: str | None = None,
    staging: str | None = None,
    cancelled: Callable[[], bool] | None = None,
    parts: Any = None,
    **options: Any,
) -> bool:
    """Part ``index`` of a fanned-out :func:`convert_model` (``options`` as it takes them); False
    when the part was recorded before."""

    source, _ = _open(src, options["model"], options["src_fmt"])
    try:
        out = model_output(source, dst, **options)
        return run_part(
            out.plan,
            source,
            target=out.target,
            index=index,
            job_id=job_id,
            staging=staging,
            cancelled=cancelled,
            runner=parts,
        )
    finally:
        source.close()


# --- configs --------------------------------------------------------------------------------


def convert_config(
    config: str | Mapping[str, Any],
    *,
    model: str,
    src_fmt: str,
    tgt_fmt: str,
    output_dir: str | None = None,
    write: bool = True,
) -> dict[str, Any]:
    """Convert a config file; writes ``<name>_to_<tgt>.json|yaml`` (one extension stripped, as the
    Model Zoo's convert-config does) unless ``write`` is false. Returns ``{config, path, warnings}``."""
    doc, uri = load_config(config)
    assert doc is not None
    result = convert_config_dict(doc, model=model, src_fmt=src_fmt, tgt_fmt=tgt_fmt)
    tgt = parse_model_format(tgt_fmt, side="target")
    out: dict[str, Any] = {"config": result.target, "warnings": result.warnings, "path": None}
    if result.ignored:
        out["ignored_keys"] = result.ignored
    if not write or uri is None:
        return out

    storage = open_storage(uri)
    name = basename(uri)
    stem = name.rsplit(".", 1)[0] if "." in name else name
    ext = "json" if tgt == "hf" else "yaml"
    directory = output_dir or parent(uri)
    path = storage.join(directory.rstrip("/"), f"{stem}_to_{tgt}.{ext}")
    data = dump_hf_json(result.target) if tgt == "hf" else dump_cs_yaml(result.target)
    storage.write_bytes(path, data)  # refuses to overwrite
    out["path"] = path
    return out
