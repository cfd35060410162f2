"""Every container format ckptconv knows: one :class:`FormatSpec` each, and nothing else.

A format is one module (its ``TensorSource`` and ``TensorSink``) plus one entry here. Whatever asks
which formats exist, what one can do or which one a file is reads this table: detection
(:mod:`ckptconv.formats.detect`), ``ckptconv formats``, the API's ``GET /v1/formats`` and its
format names, and the conformance suite (:mod:`ckptconv.testing.format_tests`), which also checks
that each entry's capabilities are what its sink does.

File names (one answer each):

- ``.mdl``, ``.h5`` and ``.hdf5`` are ``cs-h5`` (HDF5 files; a name that lies is overruled by the
  bytes, see :mod:`ckptconv.formats.detect`);
- ``.bin``, ``.pt``, ``.pth`` and ``.ckpt`` are ``torch`` (PyTorch Lightning saves torch pickles as
  ``.ckpt``). A TensorFlow bundle called ``model.ckpt`` is no file: it is found by its
  ``model.ckpt.index``, so the two never meet; as a conversion target, ``model.ckpt`` means torch
  unless the format is named.

Importing this module loads no format module: listing formats costs nothing, and the HTTP service
(which never imports torch or h5py) reads it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ckptconv.formats.signatures import hdf5, object_per_key, safetensors_header, torch_pickle


@dataclass(frozen=True)
class Capabilities:
    """What a format's sink holds; the conformance suite checks each flag against the sink."""

    links: bool = False  # tied weights stay one value (False: each link is written as a copy)
    objects: bool = False  # opaque objects (bytes a source would not decode) are kept
    cannot_hold: frozenset[str] = frozenset()  # tensor dtypes the sink refuses before any data
    shard_size: bool = False  # the ``shard_size`` option splits the output into several files
    keeps_order: bool = True  # a flat checkpoint's keys come back in written order (False: sorted)


@dataclass(frozen=True)
class FormatSpec:
    name: str
    module: str  # the module holding the source and sink classes, imported on first use
    source: str | None  # class name; None: the format cannot be read
    sink: str | None  # class name; None: the format cannot be written
    description: str
    suffixes: tuple[str, ...] = ()  # endings of a file holding a whole checkpoint (or one shard)
    index_suffixes: tuple[str, ...] = ()  # endings of a file that names a checkpoint of several files
    markers: tuple[str, ...] = ()  # a name under a directory or prefix that makes it this format
    prefix_suffixes: tuple[str, ...] = ()  # a checkpoint named by a prefix of its files (``<prefix>.index``)
    prefix_files: str = ""  # regex: every name such a checkpoint writes after its prefix (beside it)
    sniff: Callable[[bytes], bool] | None = None  # the first bytes of one of its files
    sniff_names: Callable[[list[str]], bool] | None = None  # the names under a prefix, when no marker is there
    sharded: bool = False  # one checkpoint may be several files
    capabilities: Capabilities = field(default_factory=Capabilities)

    @property
    def read(self) -> bool:
        return self.source is not None

    @property
    def write(self) -> bool:
        return self.sink is not None

    @property
    def names(self) -> tuple[str, ...]:
        """Every file-name ending that identifies this format."""
        return self.suffixes + self.index_suffixes

    def describe(self) -> dict[str, Any]:
        """The catalog row (``ckptconv formats --json``, ``GET /v1/formats``)."""
        caps = self.capabilities
        return {
            "name": self.name,
            "description": self.description,
            "read": self.read,
            "write": self.write,
            "suffixes": list(self.names),
            "sharded": self.sharded,
            "links": caps.links,
            "objects": caps.objects,
            "cannot_hold": sorted(caps.cannot_hold),
        }


# cstorch has no RtFx dtype for these (cs_serializers.TENSOR_DTYPES says what it has).
_CEREBRAS_CANNOT_HOLD = frozenset({"int8", "float8_e4m3fn", "float8_e5m2", "complex64", "complex128"})

FORMATS: dict[str, FormatSpec] = {
    f.name: f
    for f in [
        FormatSpec(
            "cs-h5",
            "ckptconv.formats.cs_h5",
            "CsH5Source",
            "CsH5Sink",
            "Cerebras H5 checkpoint (.mdl), format 0.5 read/write, legacy 0.1-0.4 read",
            suffixes=(".mdl", ".h5", ".hdf5"),
            sniff=hdf5,
            capabilities=Capabilities(links=True, objects=True, cannot_hold=_CEREBRAS_CANNOT_HOLD),
        ),
        FormatSpec(
            "safetensors",
            "ckptconv.formats.safetensors_fmt",
            "SafetensorsSource",
            "SafetensorsSink",
            "safetensors, single file or sharded with model.safetensors.index.json",
            suffixes=(".safetensors",),
            index_suffixes=(".safetensors.index.json",),
            markers=("model.safetensors.index.json",),
            sniff=safetensors_header,
            sharded=True,
            capabilities=Capabilities(
                objects=True, cannot_hold=frozenset({"complex64", "complex128"}), shard_size=True
            ),
        ),
        FormatSpec(
            "torch",
            "ckptconv.formats.torch_pickle",
            "TorchSource",
            "TorchSink",
            "PyTorch pickle (.bin/.pt/.pth/.ckpt), single or sharded with pytorch_model.bin.index.json",
            suffixes=(".bin", ".pt", ".pth", ".ckpt"),
            index_suffixes=(".bin.index.json",),
            markers=("pytorch_model.bin.index.json",),
            sniff=torch_pickle,
            sharded=True,
            capabilities=Capabilities(links=True, shard_size=True),  # objects only as decoded plain data
        ),
        FormatSpec(
            "tf",
            "ckptconv.formats.tf_bundle",
            "TfSource",
            "TfSink",
            "TensorFlow saver bundle (.index + .data-NNNNN-of-NNNNN)",
            index_suffixes=(".index",),
            prefix_suffixes=(".index",),
            prefix_files=r"\.index|\.data-\d{5}-of-\d{5}",
            sharded=True,
            # A bundle's index is sorted by key; the order is kept only with a nesting to record.
            capabilities=Capabilities(links=True, objects=True, shard_size=True, keeps_order=False),
        ),
        FormatSpec(
            "dcp",
            "ckptconv.formats.dcp",
            "DcpSource",
            None,
            "PyTorch Distributed Checkpoint (a directory with .metadata and *.distcp), read only",
            index_suffixes=(".metadata",),
            markers=(".metadata",),
            sharded=True,
        ),
        FormatSpec(
            "cs-s3",
            "ckptconv.formats.cs_s3",
            "CsS3Source",
            "CsS3Sink",
            "Cerebras object-per-key checkpoint under an S3 prefix (__METADATA__ + one object per key)",
            markers=("__METADATA__",),
            sniff_names=object_per_key,
            sharded=True,
            capabilities=Capabilities(links=True, objects=True, cannot_hold=_CEREBRAS_CANNOT_HOLD),
        ),
    ]
}
