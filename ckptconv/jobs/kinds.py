"""The kinds of job the service runs: name -> options model + description.

This module is imported by the API process, so it stays torch-free: it holds only pydantic models.
The work itself lives in a handler module of the worker, found by name:
``ckptconv/jobs/<kind with '-' as '_'>.py`` (``convert-model`` -> ``ckptconv.jobs.convert_model``).

Adding a kind is two steps and nothing else:

1. here, an options model decorated with :func:`job_kind` (its docstring is the kind's description;
   fields that name storage locations are typed :data:`StorageUri`, so API keys' prefix scopes
   apply to them too);
2. the handler module, offering ``run(ctx: ckptconv.jobs.JobContext) -> dict`` (a JSON-able result,
   ideally with ``outputs`` ``[{uri, size, role, blake3}]``, ``manifest`` and ``warnings``), and
   optionally ``plan(ctx) -> dict`` for ``POST /v1/plans``.

The API builds its request schema (a union discriminated by ``kind``), ``GET /v1/kinds`` and the
OpenAPI document from :data:`KINDS`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ckptconv.core.dtypes import DTYPE_SIZES
from ckptconv.core.errors import CkptconvError, UnknownJobKind
from ckptconv.core.sizes import parse_size

# The model tables (ckptconv.engine.layouts) are imported by the checks of the options that name a
# model or a layout, when one is checked: a process that only lists the kinds or checks a container
# conversion (the command line's `convert`, the API's schema) never reads them.


class StorageUriMarker:
    """Marks an options field whose value is a storage URI (checked against the caller's prefixes)."""


StorageUri = Annotated[str, StorageUriMarker(), Field(min_length=1, max_length=2048)]

TargetRule = Literal["required", "optional", "none"]


class KindOptions(BaseModel):
    """Base of every kind's options: unknown fields are refused, so a typo never passes silently."""

    model_config = ConfigDict(extra="forbid", strict=True)


@dataclass(frozen=True)
class JobKind:
    name: str
    options: type[KindOptions]
    description: str
    target: TargetRule  # whether a job of this kind writes to a target
    # Whether the target must not exist yet (the API refuses an existing one at submit); false for a
    # kind whose target is a directory its outputs go into.
    new_target: bool = True

    @property
    def handler_module(self) -> str:
        return "ckptconv.jobs." + self.name.replace("-", "_")


KINDS: dict[str, JobKind] = {}


def job_kind(
    name: str, *, target: TargetRule = "required", new_target: bool = True
) -> Callable[[type[KindOptions]], type[KindOptions]]:
    """Class decorator registering ``cls`` as the options model of job kind ``name``."""

    def register(cls: type[KindOptions]) -> type[KindOptions]:
        if name in KINDS:
            raise ValueError(f"job kind {name!r} registered twice")
        description = inspect.cleandoc(cls.__doc__ or name).split("\n\n")[0].replace("\n", " ")
        KINDS[name] = JobKind(name, cls, description, target, new_target)
        return cls

    return register


def get_kind(name: str) -> JobKind:
    kind = KINDS.get(name)
    if kind is None:
        raise UnknownJobKind(f"unknown job kind {name!r}; known: {', '.join(sorted(KINDS))}")
    return kind


def option_uris(options: BaseModel) -> Iterator[str]:
    """Every storage URI named by ``options`` (fields typed :data:`StorageUri`, or lists of them)."""
    for name in _uri_fields(type(options)):
        value = getattr(options, name)
        if isinstance(value, str):
            yield value
        elif isinstance(value, list | tuple):
            yield from (v for v in value if isinstance(v, str))


@functools.cache
def _uri_fields(model: type[BaseModel]) -> tuple[str, ...]:
    # Per options model, once: every submission asks.
    return tuple(name for name, f in model.model_fields.items() if _is_uri_field(f.annotation, f.metadata))


def _is_uri_field(annotation: Any, metadata: list[Any]) -> bool:
    if any(isinstance(m, StorageUriMarker) for m in metadata):
        return True
    # Optional[StorageUri] and list[StorageUri] keep the marker inside their arguments.
    for arg in getattr(annotation, "__args__", ()) or ():
        if any(isinstance(m, StorageUriMarker) for m in getattr(arg, "__metadata__", ())):
            return True
    return False


# --- the kinds -------------------------------------------------------------------------------

MAX_PARALLELISM = 256  # parts of one job; each is a message, a lease and a record in staging
Parallelism = Annotated[
    Annotated[int, Field(ge=1, le=MAX_PARALLELISM)] | Literal["auto"],
    Field(
        description="split the conversion into this many parts, balanced by output bytes, run by as many workers"
        " and committed together (any target format; not a cs-h5 output with h5_compression lz4)."
        " The output is byte for byte the single-worker output. auto: one part per"
        " CKPTCONV_AUTO_PARALLELISM_PART_BYTES of output (2 GiB), at most CKPTCONV_AUTO_PARALLELISM_MAX (16);"
        " 1 for an output that cannot be split (a composite model's HF directories, a cs-h5 output with"
        " h5_compression lz4)",
        examples=[4, "auto"],
    ),
]

H5Compression = Annotated[
    Literal["none", "lz4"],
    Field(
        description="cs-h5 targets: none writes every dataset contiguous and uncompressed (its offsets known up"
        " front: positioned writes, fan-out, a streamed S3 upload); lz4 writes LZ4-compressed 1 MiB chunks,"
        " smaller only where the data compresses (zero-filled or constant tensors, e.g. fresh optimizer states;"
        " trained weights barely shrink), for more CPU; such an output is written by one worker (parallelism 1)"
        " and, on S3, built whole in the worker's scratch directory before its upload",
        examples=["lz4"],
    ),
]

# Casting applies to floating-point tensors only, so only floating-point dtypes are offered.
FloatDtype = Literal[tuple(d for d in DTYPE_SIZES if d.startswith(("float", "bfloat")))]  # type: ignore[valid-type]
Size = (
    Annotated[int, Field(gt=0)]
    | Annotated[str, Field(min_length=1, max_length=32, pattern=r"^\s*\d+(\.\d*)?\s*(([kKmMgGtT][iI]?)?[bB])?\s*$")]
)


@job_kind("convert")
class ConvertOptions(KindOptions):
    """Convert a checkpoint between container formats (cs-h5, cs-s3, safetensors, torch, tf), verifying the result.

    Every entry is copied unchanged (optionally cast to ``dtype``); the output is verified against
    the source and published atomically with a ``manifest.json`` written last.
    """

    shard_size: Size | None = Field(
        default=None,
        description="largest output shard, in bytes or with a unit (5GB, 500MiB); safetensors, torch and tf",
        examples=["5GB"],
    )
    dtype: FloatDtype | None = Field(
        default=None, description="cast floating-point tensors to this dtype (integer tensors keep theirs)"
    )
    verify: Literal["hashes", "full"] = Field(
        default="hashes",
        description="hashes: compare the hashes of every value as read and as written (no second read);"
        " full: also re-read the whole output and compare every entry",
    )
    memory_budget: Size | None = Field(
        default=None,
        description="bytes the conversion may hold (at least twice the largest tensor plus 300 MiB for a copy,"
        " more for a cast or a layout's transforms, plus the writers' buffers: 48 MiB for a local file,"
        " the upload parts on S3; the plan reports the minimum); what exceeds that minimum reads ahead."
        " Default: the minimum",
        examples=["4GB"],
    )

    parallelism: Parallelism = 1
    h5_compression: H5Compression = "none"

    @model_validator(mode="after")
    def _one_writer_for_lz4(self) -> ConvertOptions:
        return _one_writer_for_lz4(self)

    @field_validator("shard_size", "memory_budget")
    @classmethod
    def _size(cls, value: int | str | None) -> int | str | None:
        if value is None:
            return value
        try:
            parse_size(value)
        except CkptconvError as e:
            raise ValueError(e.message) from e  # the typed error stays the cause (the CLI reports it)
        return value


# hf or a Cerebras release; DPO checkpoints of a release add -dpo (and cs-2.1-no-dpo names a plain one).
ModelLayout = Annotated[
    str, Field(min_length=2, max_length=32, pattern=r"^(hf|(cs-\d+\.\d+|cs-auto|cs-current)(-dpo|-no-dpo)?)$")
]


@job_kind("convert-model", target="optional", new_target=False)
class ConvertModelOptions(KindOptions):
    """Convert a checkpoint and its config between Hugging Face and Cerebras Model Zoo layouts (families, releases).

    The optional target's ``uri`` is the output directory (default: beside the source); outputs are
    named as the Model Zoo names them (``<name>_to_cs-2.9.mdl`` + ``<config>_to_cs-2.9.yaml``, or a
    ``<name>_to_hf/`` directory with ``config.json``). The target ``format`` must match ``tgt_fmt``:
    ``cs-h5`` for a Cerebras release, ``safetensors`` or ``torch`` for ``hf``.
    """

    model: str = Field(
        min_length=1, max_length=64, description="Model Zoo model name (GET /v1/models)", examples=["llama"]
    )
    src_fmt: ModelLayout = Field(
        description="source layout: hf, cs-X.Y (cs-1.6 ... cs-2.9) or cs-auto (the release the checkpoint records)",
        examples=["hf"],
    )
    tgt_fmt: ModelLayout = Field(
        description="target layout: hf, cs-X.Y or cs-current (the newest release)", examples=["cs-2.9"]
    )
    config: StorageUri | None = Field(
        default=None,
        description="HF config.json or Cerebras YAML; default: config.json beside an HF source, or the params "
        "recorded in a Cerebras checkpoint",
    )
    drop_unmatched_keys: bool = Field(default=False, description="drop checkpoint keys no rule matches")
    export_safetensors: bool = Field(default=False, description="HF outputs as safetensors instead of .bin")
    hf_shard_size: Size | None = Field(default="10GB", description="largest HF output shard")
    fold_lora: bool = Field(default=False, description="fold LoRA adapters into their base weights")
    fold_mup: bool = Field(
        default=True, description="fold muP into standard parametrization on export (off: refuse muP checkpoints)"
    )
    parallelism: Parallelism = 1
    h5_compression: H5Compression = "none"
    verify: bool = Field(
        default=False,
        description="also compare logits of the Hugging Face side and the simulator's model of the Cerebras side; "
        "recorded as `simulator` in the result (a failing verdict adds a warning, the conversion stands)",
    )

    @field_validator("model")
    @classmethod
    def _model(cls, value: str) -> str:
        from ckptconv.engine.layouts.registry import is_known_model

        try:
            is_known_model(value)
        except CkptconvError as e:
            raise ValueError(e.message) from e  # the typed error stays the cause (the CLI reports it)
        return value

    @field_validator("src_fmt", "tgt_fmt")
    @classmethod
    def _layout(cls, value: str, info: Any) -> str:
        from ckptconv.engine.layouts.upgrades import parse_model_format

        try:
            parse_model_format(value, side="source" if info.field_name == "src_fmt" else "target")
        except CkptconvError as e:
            raise ValueError(e.message) from e  # the typed error stays the cause (the CLI reports it)
        return value

    @field_validator("hf_shard_size")
    @classmethod
    def _hf_size(cls, value: int | str | None) -> int | str | None:
        return ConvertOptions._size(value)

    @model_validator(mode="after")
    def _one_writer_for_lz4(self) -> ConvertModelOptions:
        return _one_writer_for_lz4(self)

    @model_validator(mode="after")
    def _one_writer_for_several_directories(self) -> ConvertModelOptions:
        """Refused at submission rather than when the job runs: the Hugging Face side of a composite
        model (DPR's two encoders) is several directories, which one worker writes ("auto" picks 1)."""
        if self.tgt_fmt == "hf" and isinstance(self.parallelism, int) and self.parallelism > 1:
            from ckptconv.engine.layouts.family import COMPOSITE
            from ckptconv.engine.layouts.registry import model_table

            table = model_table(self.model)
            if table is not None and table.kind == COMPOSITE:
                raise ValueError(
                    f"{self.model} writes several model directories: one worker writes them (parallelism 1 or auto)"
                )
        return self


def _one_writer_for_lz4(options: Any) -> Any:
    """Refused at submission rather than when the job runs: an LZ4-chunked H5 output is not laid out
    before it is written, so it cannot be fanned out ("auto" picks 1 for it)."""
    if options.h5_compression != "none" and isinstance(options.parallelism, int) and options.parallelism > 1:
        raise ValueError(
            f"h5_compression {options.h5_compression} writes chunks whose sizes are known only once compressed:"
            " such an output is written by one worker (parallelism 1 or auto)"
        )
    return options


ModelName = Annotated[str, Field(min_length=1, max_length=64, description="Model Zoo model name (GET /v1/models)")]


def _check_model(value: str | None) -> str | None:
    from ckptconv.engine.layouts.registry import resolve

    if value is None:
        return value
    try:
        resolve(value)
    except CkptconvError as e:
        raise ValueError(e.message) from e  # the typed error stays the cause (the CLI reports it)
    return value


@job_kind("verify", target="none")
class VerifyOptions(KindOptions):
    """Compare a Cerebras checkpoint (the source) with its Hugging Face model, logit for logit, in the simulator.

    Both models run in float32 on the same deterministic inputs; the result records the maximum
    absolute and relative differences, the cosine similarity, the tolerance and the verdict. A
    failing verdict ends the job ``failed`` with a ``logit_mismatch`` problem whose details carry the
    numbers (set ``fail_on_mismatch: false`` to have it succeed with ``passed: false`` instead).
    """

    hf: StorageUri = Field(description="Hugging Face model directory (config.json + weights); local or s3:// prefix")
    config: StorageUri = Field(description="Cerebras YAML config of the checkpoint")
    model: ModelName = Field(examples=["llama"])
    tolerance: float = Field(default=1e-5, ge=0, description="largest accepted absolute logit difference")
    rtol: float = Field(default=0.0, ge=0, description="adds rtol * max|hf logit| to the tolerance")
    batch_size: int = Field(default=2, gt=0, le=64, description="inputs per forward pass")
    seq_len: int = Field(default=16, gt=0, le=4096, description="tokens per input")
    seed: int = Field(default=0, ge=0, description="seed of the input token ids")
    strict: bool = Field(default=True, description="every model key must be in the checkpoint and vice versa")
    fail_on_mismatch: bool = Field(default=True, description="a failing verdict fails the job")

    @field_validator("model")
    @classmethod
    def _model(cls, value: str | None) -> str | None:
        return _check_model(value)


@job_kind("simulate", target="none")
class SimulateOptions(KindOptions):
    """Train a few steps on CPU from a Cerebras YAML config (the source) and write checkpoints as the trainer does.

    Checkpoints are saved into ``model_dir`` by the config's policy (cadence, naming,
    ``checkpoints_index.yaml``, retention); the result lists the checkpoint files written.
    """

    model_dir: StorageUri = Field(description="model directory the checkpoints are written to")
    steps: int | None = Field(
        default=None, gt=0, le=100_000, description="train until this global step (default: the config's max_steps)"
    )
    model: ModelName | None = Field(default=None, description="Model Zoo model name (default: the config's name)")
    checkpoint: StorageUri | None = Field(default=None, description="checkpoint to start from (overrides autoload)")
    checkpoint_steps: int | None = Field(default=None, gt=0, description="save every N steps (overrides the config)")
    batch_size: int | None = Field(
        default=None, gt=0, le=64, description="samples per step (default: the config's, else 2)"
    )
    seq_len: int | None = Field(
        default=None, gt=0, le=4096, description="tokens per sample (default: the config's, else 16)"
    )
    seed: int | None = Field(
        default=None, ge=0, description="data and initialisation seed (default: the config's, else 0)"
    )

    @field_validator("model")
    @classmethod
    def _model(cls, value: str | None) -> str | None:
        return _check_model(value)


@job_kind("fix-spec", target="optional")
class FixSpecOptions(KindOptions):
    """Repair a release <= 1.7 Cerebras H5 checkpoint (spec, tied weights, scheduler steps) so 2.0+ loads it.

    Local files only (the repair edits HDF5 in place on a copy). The optional target (format
    ``cs-h5``) is where the repaired copy goes, default ``<stem>_fixed<suffix>`` beside the source;
    an existing file there is never overwritten and the source is never modified.
    """


@job_kind("dataloader-state")
class DataloaderStateOptions(KindOptions):
    """Write a checkpoint plus its release 1.9 dataloader state as the 2.0 ``dataloader`` entry (target: cs-h5).

    ``iter_dir`` is the directory ``cerebras.save_iter_state_path`` named (the
    ``data_iter_state_file_worker_*`` files); the output is verified and published atomically.
    """

    iter_dir: StorageUri = Field(
        description="the directory cerebras.save_iter_state_path named (data_iter_state_file_worker_*.txt)"
    )
    dataloader_type: Literal["map", "iterable"] = Field(
        default="map", description="map-style (e.g. GptHDF5MapDataProcessor) or iterable (e.g. GptHDF5DataProcessor)"
    )
    shuffle_seed: int = Field(default=0, ge=0, description="shuffle seed of a map-style loader")
