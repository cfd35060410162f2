"""Checkpoint formats: one TensorSource and one TensorSink per container format.

``open_source`` and ``open_sink`` are the only way the engine reaches a format; modules are
imported lazily so that listing formats costs nothing.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from ckptconv.core.errors import UnknownFormat, UnsupportedFormat
from ckptconv.formats.base import TensorSink, TensorSource
from ckptconv.storage.base import Storage


@dataclass(frozen=True)
class FormatSpec:
    name: str
    module: str
    source: str | None
    sink: str | None
    description: str
    suffixes: tuple[str, ...] = ()


FORMATS: dict[str, FormatSpec] = {
    f.name: f
    for f in [
        FormatSpec(
            "cs-h5",
            "ckptconv.formats.cs_h5",
            "CsH5Source",
            "CsH5Sink",
            "Cerebras H5 checkpoint (.mdl), format 0.5 read/write, legacy 0.1-0.4 read",
            (".mdl", ".h5"),
        ),
        FormatSpec(
            "safetensors",
            "ckptconv.formats.safetensors_fmt",
            "SafetensorsSource",
            "SafetensorsSink",
            "safetensors, single file or sharded with model.safetensors.index.json",
            (".safetensors", ".safetensors.index.json"),
        ),
        FormatSpec(
            "torch",
            "ckptconv.formats.torch_pickle",
            "TorchSource",
            "TorchSink",
            "PyTorch pickle (.bin/.pt/.pth), single or sharded with pytorch_model.bin.index.json",
            (".bin", ".pt", ".pth", ".bin.index.json"),
        ),
        FormatSpec(
            "tf",
            "ckptconv.formats.tf_bundle",
            "TfSource",
            "TfSink",
            "TensorFlow saver bundle (.index + .data-NNNNN-of-NNNNN)",
            (".index",),
        ),
        FormatSpec(
            "dcp",
            "ckptconv.formats.dcp",
            "DcpSource",
            None,
            "PyTorch Distributed Checkpoint (a directory with .metadata and *.distcp), read only",
            (".metadata",),
        ),
        FormatSpec(
            "cs-s3",
            "ckptconv.formats.cs_s3",
            "CsS3Source",
            "CsS3Sink",
            "Cerebras object-per-key checkpoint under an S3 prefix (__METADATA__ + one object per key)",
            (),
        ),
    ]
}


def _load(name: str, attr: str | None) -> Any:
    spec = FORMATS.get(name)
    if spec is None:
        raise UnknownFormat(f"unknown format {name!r}; known: {', '.join(FORMATS)}")
    if attr is None:
        raise UnsupportedFormat(f"format {name!r} cannot be used in this direction")
    try:
        module = importlib.import_module(spec.module)
    except ModuleNotFoundError as e:
        if e.name == spec.module:
            raise UnsupportedFormat(f"format {name!r} is not available in this build") from e
        raise
    return getattr(module, attr)


def source_class(name: str) -> type[TensorSource]:
    return _load(name, FORMATS[name].source if name in FORMATS else None)


def sink_class(name: str) -> type[TensorSink]:
    return _load(name, FORMATS[name].sink if name in FORMATS else None)


def target_exists(storage: Storage, target: str, fmt: str | None) -> bool:
    """Whether writing ``target`` would meet something already there: an object at the URI, objects
    under it (a directory or prefix target), or for a TF bundle (named by its prefix) its ``.index``.
    Conversions never overwrite; the API refuses such a target at submit and the engine again
    before writing (two submissions can race past the first check)."""
    if storage.exists(target) or any(True for _ in storage.list(target + "/")):
        return True
    return fmt == "tf" and storage.exists(target + ".index")
