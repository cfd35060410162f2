"""Verification modes: by default hashes taken as values are read and as they are written (no
second read of the output); ``verify: full`` re-reads the output and compares every entry."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save

from bench.faultproxy import FaultProxy
from ckptconv.core.errors import VerificationFailed
from ckptconv.engine.convert import convert
from ckptconv.engine.plan import identity_plan
from ckptconv.engine.run import run_plan
from ckptconv.formats import sink_class
from ckptconv.formats.base import as_torch
from ckptconv.formats.detect import open_source
from ckptconv.storage.s3 import S3Storage


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return {f"w{i}": torch.randn(256, 256, generator=g) for i in range(5)}


def test_only_full_verification_reads_the_entries_again(s3_server, s3_bucket, monkeypatch):
    S3Storage(s3_server).write_bytes(f"s3://{s3_bucket}/src/model.safetensors", save(_tensors()))
    reads = {}
    for mode in ("hashes", "full"):
        with FaultProxy(s3_server) as proxy:
            gets: list[str] = []
            proxy.on_request = lambda method, path, headers, gets=gets: method == "GET" and gets.append(path)
            monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
            result = convert(
                f"s3://{s3_bucket}/src/model.safetensors", f"s3://{s3_bucket}/out/{mode}.mdl", to="cs-h5", verify=mode
            )
        assert result.verify["ok"] and result.verify["mode"] == mode
        assert result.verify["entries_checked"] == 5
        # The streamed H5 upload is written out of order: a block digest as written, its whole-file digest only
        # when full verification reads it back.
        assert all(o.digest or (mode == "hashes" and o.blocks) for o in result.outputs)
        reads[mode] = [p for p in gets if p.split("?")[0].endswith(".mdl") and "/.ckptconv-staging/" in p]
    # Nothing read back by default; the reopening and reading of every entry with verify: full.
    assert len(reads["hashes"]) == 0 < len(reads["full"]), reads


class _ZeroingSink:
    """A faulty sink: it damages what it is given (in place) while writing it."""

    def __init__(self, storage, uri, **options):
        self._sink = sink_class("safetensors")(storage, uri, **options)

    def __getattr__(self, name):
        return getattr(self._sink, name)

    def write(self, key, value):
        self._sink.write(key, value)
        if key == "w3":
            as_torch(value).zero_()  # a RawTensor's torch tensor is its memory


def test_hash_verification_catches_a_sink_that_alters_values(tmp_path):
    src_path = tmp_path / "src.safetensors"
    src_path.write_bytes(save(_tensors()))
    with open_source(str(src_path)) as src:
        plan = identity_plan(src.entries(), src.spec)
        with pytest.raises(VerificationFailed, match="w3"):
            run_plan(plan, src, to="safetensors", target=str(tmp_path / "out"), sink_factory=_ZeroingSink)
    assert not (tmp_path / "out").exists()


def test_model_conversion_checks_its_renamed_copies_by_hash(tmp_path):
    # A layout conversion mostly renames: each plain copy is hashed as read and as written; only the
    # transformed tensors (rotary-permuted q/k here) are checked for presence alone.
    pytest.importorskip("transformers")
    from tiny_models import tiny_llama

    from ckptconv import convert_model, plan_model

    tiny_llama().save_pretrained(tmp_path / "hf")
    plan = plan_model(str(tmp_path / "hf"), model="llama", src_fmt="hf", tgt_fmt="cs-2.9")
    copies = [s for s in plan.steps if s.recipe.startswith("copy(")]
    result = convert_model(str(tmp_path / "hf"), str(tmp_path / "out"), model="llama", src_fmt="hf", tgt_fmt="cs-2.9")
    assert result.verify["ok"] and result.verify["mode"] == "hashes"
    assert 0 < len(copies) < len(plan.steps) and result.verify["entries_checked"] == len(copies)
