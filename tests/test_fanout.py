"""One conversion cut into parts by output bytes: the parts' output is the single-worker output.

Real conversions, local and on a moto S3 server, every part run in this process (the worker's
dispatch is covered by ``test_fanout_workers.py``): byte-for-byte equality with the single-worker
files for each writable pair, the byte split itself, a part recorded once, a commit run twice
publishing once, and a cancelled fan-out leaving neither files nor multipart uploads.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import boto3
import h5py
import pytest
import torch
from safetensors.torch import save, save_file

from ckptconv.core.errors import (
    Cancelled,
    CorruptCheckpoint,
    InvalidRequest,
    StorageError,
    TargetExists,
    VerificationFailed,
)
from ckptconv.engine.convert import convert, convert_part
from ckptconv.engine.fanout import AutoParallelism, InlineRunner, resolve_parallelism, split_parts
from ckptconv.engine.fanout.commit import _check_tiling
from ckptconv.engine.fanout.records import _recorded_parts
from ckptconv.engine.fanout.split import local_block_size
from ckptconv.engine.plan import identity_plan
from ckptconv.engine.run import run_plan
from ckptconv.engine.staging import _layout, staging_root
from ckptconv.formats.base import OutputFile
from ckptconv.formats.detect import open_source
from ckptconv.formats.layout import FileLayout, Span
from ckptconv.storage import open_storage
from ckptconv.storage.base import OWNER_METADATA
from ckptconv.storage.digests import hex_digest, holds_output
from ckptconv.storage.local import LocalStorage

MiB = 1 << 20


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(13)
    return {
        "embed.weight": torch.randn(1024, 1536, generator=g).to(torch.bfloat16),  # 3 MiB
        "layers.0.attn.q": torch.randn(1024, 1280, generator=g),  # 5 MiB: cut by a part boundary
        "layers.0.norm": torch.randn(1536, generator=g),
        "layers.0.step": torch.tensor(7, dtype=torch.int64),
        "layers.0.mask": torch.rand(333, generator=g) > 0.5,
        "layers.0.empty": torch.zeros(0, 4),
        "layers.1.attn.q": torch.randn(1024, 1280, generator=g).to(torch.float16),
        "head.bias": torch.randn(7, generator=g).to(torch.float64),
    }


def _source(tmp: Path, fmt: str) -> str:
    """The tensors as a checkpoint of ``fmt`` (a cs-h5 one converted from safetensors)."""
    st = str(tmp / "src.safetensors")
    save_file(_tensors(), st)
    if fmt == "safetensors":
        return st
    if fmt == "torch":
        path = str(tmp / "src.bin")
        torch.save(_tensors(), path)
        return path
    path = str(tmp / "src.mdl")
    convert(st, path, to="cs-h5")
    return path


def _single(source: str, target: str, to: str, **sink_options: object) -> list[str]:
    """What one worker writes, with the default options (for cs-h5: the contiguous layout, the one
    fan-out writes)."""
    src = open_source(source)
    try:
        result = run_plan(identity_plan(src.entries(), src.spec), src, to=to, target=target, sink_options=sink_options)
    finally:
        src.close()
    return [_sha(o.uri) for o in result.outputs]


def _sha(uri: str) -> str:
    return hex_digest(open_storage(uri).read_all(uri))


def _checksummed(o: OutputFile) -> bool:
    """The output's recorded checksum (its digest, or the block digest of a file uploaded in parts) is its bytes'."""
    return holds_output(open_storage(o.uri).read_all(o.uri), o.facts())


def _block_digested(outputs: list[OutputFile], expected: list[str]) -> None:
    """A local fan-out's outputs are the single worker's bytes (``expected``, their digests): each
    data file recorded with the block digest its parts hashed, each other file with its digest."""
    assert [_sha(o.uri) for o in outputs] == expected
    for o, sha in zip(outputs, expected, strict=True):
        if o.role == "data":
            assert o.digest is None and o.blocks is not None and _checksummed(o), o
        else:
            assert o.digest == sha, o


def _output_reads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, float]]:
    """Every read of a local file from here on: its name and how many bytes (inf: all of them)."""
    reads: list[tuple[str, float]] = []
    read_into, open_reader, digest = LocalStorage.read_into, LocalStorage.open_reader, LocalStorage.digest

    def spy_read_into(self, uri, offset, buf):
        reads.append((Path(uri).name, len(buf)))
        return read_into(self, uri, offset, buf)

    def spy_open_reader(self, uri):
        reads.append((Path(uri).name, float("inf")))
        return open_reader(self, uri)

    def spy_digest(self, uri, *args):
        reads.append((Path(uri).name, float("inf")))
        return digest(self, uri, *args)

    monkeypatch.setattr(LocalStorage, "read_into", spy_read_into)
    monkeypatch.setattr(LocalStorage, "open_reader", spy_open_reader)
    monkeypatch.setattr(LocalStorage, "digest", spy_digest)
    return reads


def _uploads(bucket: str) -> list[dict]:
    return boto3.client("s3").list_multipart_uploads(Bucket=bucket).get("Uploads", [])


@pytest.mark.parametrize(
    ("source_fmt", "to", "name"),
    [
        ("safetensors", "cs-h5", "out.mdl"),
        ("safetensors", "safetensors", "out.safetensors"),
        ("cs-h5", "safetensors", "out.safetensors"),
        ("cs-h5", "cs-h5", "out.mdl"),
        ("torch", "safetensors", "out.safetensors"),
        ("torch", "cs-h5", "out.mdl"),
        ("safetensors", "torch", "out.bin"),
        ("cs-h5", "torch", "out.bin"),
        ("torch", "torch", "out.bin"),
        ("safetensors", "tf", "ckpt"),  # data file, then the index written from the parts' CRC-32Cs
        ("cs-h5", "tf", "ckpt"),
    ],
)
def test_fanned_out_local_output_is_the_single_worker_output(
    source_fmt, to, name, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = _source(tmp_path, source_fmt)
    expected = _single(source, str(tmp_path / "one" / name), to)
    reads = _output_reads(monkeypatch)
    result = convert(source, str(tmp_path / "three" / name), to=to, parallelism=3, job_id="fan-local")
    _block_digested(result.outputs, expected)
    # Not read back: the parts hashed the blocks they wrote, and the commit composed the block
    # digest; it reads only the start of the block a tail (a zip's central directory) is in.
    for o in result.outputs:
        if o.role == "data":
            assert sum(n for file, n in reads if file == Path(o.uri).name) < o.blocks["block_size"]
    assert result.extras["parallelism"] == 3 and result.verify["ok"] is True
    assert not (tmp_path / "three" / ".ckptconv-staging").exists()


@pytest.mark.parametrize(("to", "name"), [("safetensors", ""), ("torch", ""), ("tf", "ckpt")])
def test_sharded_fan_out_across_files(to: str, name: str, tmp_path: Path) -> None:
    source = _source(tmp_path, "safetensors")
    expected = _single(source, str(tmp_path / "one" / name), to, shard_size=4 * MiB)
    target = str(tmp_path / "four" / name)
    result = convert(source, target, to=to, shard_size=4 * MiB, parallelism=4, job_id="fs")
    assert len(result.outputs) > 3 and [o.role for o in result.outputs][-1] == "index"
    _block_digested(result.outputs, expected)


def test_torch_zip64_members_fan_out_to_the_single_worker_bytes(tmp_path: Path, monkeypatch) -> None:
    # Members of 1 MiB or more carry zip64 fields and 24-byte data descriptors, as 4 GiB ones do.
    from ckptconv.formats.torch_pickle import TorchSink

    monkeypatch.setattr(TorchSink, "zip64_from", MiB)
    source = _source(tmp_path, "safetensors")
    expected = _single(source, str(tmp_path / "one" / "m.bin"), "torch")
    result = convert(source, str(tmp_path / "five" / "m.bin"), to="torch", parallelism=5, job_id="z64")
    _block_digested(result.outputs, expected)
    loaded = torch.load(result.outputs[0].uri, weights_only=True)
    assert all(torch.equal(loaded[k], v) for k, v in _tensors().items())


@pytest.mark.parametrize(
    ("source_fmt", "to", "name"),
    [
        ("safetensors", "cs-h5", "out.mdl"),
        ("cs-h5", "safetensors", "out.safetensors"),
        ("safetensors", "torch", "out.bin"),  # the central directory sent at commit with held bytes
        ("safetensors", "tf", "ckpt"),
    ],
)
def test_fanned_out_s3_output_is_the_single_worker_output(source_fmt, to, name, tmp_path: Path, s3_bucket) -> None:
    source = _source(tmp_path, source_fmt)
    remote = f"s3://{s3_bucket}/src/{Path(source).name}"
    open_storage(remote).write_bytes(remote, Path(source).read_bytes())
    expected = _single(remote, f"s3://{s3_bucket}/one/{name}", to)
    result = convert(remote, f"s3://{s3_bucket}/two/{name}", to=to, parallelism=2, job_id="fan-s3")
    assert [_sha(o.uri) for o in result.outputs] == expected
    # Not read back: the parts hashed the blocks they sent, and the commit composed the block digest.
    assert [(o.digest, o.blocks is not None) for o in result.outputs if o.role == "data"] == [(None, True)]
    assert all(_checksummed(o) for o in result.outputs)
    assert result.extras["parallelism"] == 2
    # Each part's process holds its part upload's buffers: the memory facts count them.
    assert result.memory["writer_buffer_bytes"] > 0
    assert result.memory["estimated_peak_bytes"] > result.memory["writer_buffer_bytes"]
    assert _uploads(s3_bucket) == []
    left = [i.uri for i in open_storage(f"s3://{s3_bucket}/").list(f"s3://{s3_bucket}/two/")]
    assert sorted(left) == sorted([o.uri for o in result.outputs] + [result.manifest])


@pytest.mark.parametrize(("to", "name"), [("cs-h5", "out.mdl"), ("safetensors", "out.safetensors")])
def test_a_fanned_out_jobs_s3_outputs_name_it_from_their_upload_on(
    to: str, name: str, tmp_path: Path, s3_bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptconv.core.fencing import Attempt, attempt_scope

    source = _source(tmp_path, "safetensors" if to == "cs-h5" else "cs-h5")
    target = f"s3://{s3_bucket}/fan/{name}"
    storage = open_storage(target)
    copies: list[dict] = []
    copy_object = storage.client.copy_object
    monkeypatch.setattr(storage.client, "copy_object", lambda **k: copies.append(k) or copy_object(**k))
    with attempt_scope(Attempt("fan-job", 1, lambda: None)):
        result = convert(source, target, to=to, parallelism=2, job_id="fan-job")
    published = [*(o.uri for o in result.outputs), result.manifest]
    # The multipart upload the parts fill was created naming the job: its publication is a plain
    # copy (replacing the metadata makes some servers stream the object again), pinned to its ETag.
    assert len(copies) == len(published)
    assert all("MetadataDirective" not in k and k["CopySourceIfMatch"] for k in copies)
    assert {storage.user_metadata(uri).get(OWNER_METADATA) for uri in published} == {"fan-job"}


def test_a_full_verify_reads_a_local_fan_out_back_and_checks_its_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptconv.engine.fanout import commit

    source = _source(tmp_path, "safetensors")
    result = convert(source, str(tmp_path / "full" / "m.mdl"), to="cs-h5", parallelism=2, job_id="lf", verify="full")
    [data] = result.outputs
    assert data.digest == _sha(data.uri) and data.blocks is not None and _checksummed(data)
    assert result.verify["ok"] is True
    # A byte changed behind the parts' backs (after they hashed it) is found, and nothing is published.
    write_tails = commit.write_tails

    def overwrite(layout, doc, records):
        with open(doc["files"][0]["uri"], "r+b") as f:
            f.seek(doc["files"][0]["size"] - 1)
            last = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([last[0] ^ 1]))
        return write_tails(layout, doc, records)

    monkeypatch.setattr(commit, "write_tails", overwrite)
    out = tmp_path / "bad"
    with pytest.raises(VerificationFailed, match="differ from those written"):
        convert(source, str(out / "m.mdl"), to="cs-h5", parallelism=2, job_id="lf-bad", verify="full")
    assert not (out / "m.mdl").exists()


def test_a_full_verify_reads_the_upload_back_once_and_checks_its_blocks(tmp_path: Path, s3_bucket) -> None:
    source = _source(tmp_path, "safetensors")
    result = convert(source, f"s3://{s3_bucket}/full/m.mdl", to="cs-h5", parallelism=2, job_id="full", verify="full")
    [data] = result.outputs
    assert data.digest == _sha(data.uri) and data.blocks is not None and _checksummed(data)
    assert result.verify["ok"] is True


class _DroppingABlock(InlineRunner):
    """Runs every part here, then takes one block hash out of part 0's record (as a record that
    lost it would read): the commit must refuse it rather than publish an unverified file."""

    def __init__(self, bucket: str) -> None:
        super().__init__()
        self.bucket = bucket

    @contextlib.contextmanager
    def claim(self, index: int) -> Iterator[bool]:
        yield True
        if index != 0:
            return
        storage = open_storage(f"s3://{self.bucket}/")
        [uri] = [i.uri for i in storage.list(f"s3://{self.bucket}/") if i.uri.endswith("part-00000.json")]
        record = json.loads(storage.read_all(uri))
        blocks = record["blocks"]["0"]
        del blocks[sorted(blocks)[0]]
        storage.delete(uri)
        storage.write_bytes(uri, json.dumps(record).encode())


def test_a_part_record_missing_a_block_hash_publishes_nothing(tmp_path: Path, s3_bucket) -> None:
    source = _source(tmp_path, "safetensors")
    target = f"s3://{s3_bucket}/team/out/model.mdl"
    with pytest.raises(VerificationFailed, match="do not hash every block once"):
        convert(source, target, to="cs-h5", parallelism=2, job_id="dropped", parts=_DroppingABlock(s3_bucket))
    assert list(open_storage(target).list(f"s3://{s3_bucket}/")) == []
    assert _uploads(s3_bucket) == []


class _OlderRecords(InlineRunner):
    """Rolling deploy: the layout (``layout``) or part 0's record (``record``) read as an older
    version wrote it, without the field ``field``."""

    def __init__(self, out: Path, which: str, field: str) -> None:
        super().__init__()
        self.out, self.which, self.field = out, which, field

    def _rewrite(self, name: str, **changes: object) -> None:
        [path] = self.out.rglob(name)
        doc = json.loads(path.read_bytes())
        del doc[self.field]
        path.write_text(json.dumps({**doc, **changes}))

    def dispatch(self, count: int) -> None:
        if self.which == "layout":
            self._rewrite("layout.json", version=1)
        super().dispatch(count)

    @contextlib.contextmanager
    def claim(self, index: int) -> Iterator[bool]:
        yield True
        if self.which == "record" and index == 0:
            self._rewrite("part-00000.json")


# A record without "digest": of a version whose block hashes were sha256.
@pytest.mark.parametrize(("which", "field"), [("layout", "block_size"), ("record", "digests"), ("record", "digest")])
def test_records_written_by_another_version_fail_the_job_typed_and_publish_nothing(
    tmp_path: Path, which: str, field: str
) -> None:
    source = _source(tmp_path, "safetensors")
    out = tmp_path / "out"
    runner = _OlderRecords(out, which, field)
    with pytest.raises(VerificationFailed, match="another version") as raised:
        convert(source, str(out / "model.mdl"), to="cs-h5", parallelism=2, job_id=f"rolling-{which}", parts=runner)
    assert "submit the job again" in raised.value.hint
    assert not (out / "model.mdl").exists()
    assert not (out / ".ckptconv-staging").exists()


def _edit_doc(out: Path, name: str, change: Callable[[dict], None]) -> None:
    """Change the fan-out document ``name`` (the layout, a part's record) of the run writing under ``out``."""
    [path] = out.rglob(name)
    doc = json.loads(path.read_bytes())
    change(doc)
    path.write_text(json.dumps(doc))


class _TamperedRecords(InlineRunner):
    """Part 1's record as storage returns it after someone changed it: what the commit must refuse
    rather than publish."""

    def __init__(self, out: Path, how: str) -> None:
        super().__init__()
        self.out, self.how = out, how

    @contextlib.contextmanager
    def claim(self, index: int) -> Iterator[bool]:
        yield True
        if index != 1:
            return

        def change(doc: dict) -> None:
            if self.how == "ranges":
                doc["ranges"][0][2] -= 1
            else:
                key = next(iter(doc[self.how]))
                doc[self.how][key] = "0" * 32

        _edit_doc(self.out, "part-00001.json", change)


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("digests", "wrote different values|written bytes differ"),
        ("read_digests", "read different values|written bytes differ"),
        ("ranges", "other byte ranges"),
    ],
)
def test_a_part_record_that_disagrees_fails_the_commit_and_publishes_nothing(
    tmp_path: Path, how: str, message: str
) -> None:
    source = _source(tmp_path, "safetensors")
    out = tmp_path / "out"
    runner = _TamperedRecords(out, how)
    with pytest.raises(VerificationFailed, match=message):
        convert(source, str(out / "model.mdl"), to="cs-h5", parallelism=2, job_id=f"tampered-{how}", parts=runner)
    assert not (out / "model.mdl").exists()
    assert not (out / ".ckptconv-staging").exists()


class _SourceReplacedAfterPrepare(InlineRunner):
    """The source rewritten under its key (same size, other values) once the layout is prepared,
    before any part runs: as a training job writing its latest checkpoint there. A part run then
    in a process of its own (as a worker runs it) opens the source anew."""

    def __init__(self, uri: str, data: bytes, target: str, job_id: str) -> None:
        super().__init__()
        self.uri, self.data, self.target, self.job_id = uri, data, target, job_id
        self.refused: list[str] = []

    def dispatch(self, count: int) -> None:
        open_storage(self.uri).write_bytes(self.uri, self.data, overwrite=True)
        storage = open_storage(self.target)
        [doc] = [i.uri for i in storage.list(staging_root(self.target)) if i.uri.endswith("/.fanout/layout.json")]
        staging = doc.removesuffix("/.fanout/layout.json")
        try:
            convert_part(self.uri, self.target, 1, to="cs-h5", job_id=self.job_id, staging=staging)
        except CorruptCheckpoint as e:
            self.refused.append(str(e))
        super().dispatch(count)


@pytest.mark.parametrize("target", ["local", "s3"])
def test_parts_read_the_source_versions_the_plan_read(tmp_path: Path, s3_bucket: str, target: str) -> None:
    # Each part reads the versions recorded in the layout or fails, never a mix of the plan's
    # version and the next: in its own process (which opens the source anew) and in the job's.
    source = f"s3://{s3_bucket}/src/model.safetensors"
    tensors = _tensors()
    open_storage(source).write_bytes(source, save({k: t.contiguous() for k, t in tensors.items()}))
    other = save({k: (t.logical_not() if t.dtype == torch.bool else -t).contiguous() for k, t in tensors.items()})
    out = str(tmp_path / "out" / "model.mdl") if target == "local" else f"s3://{s3_bucket}/out/model.mdl"
    runner = _SourceReplacedAfterPrepare(source, other, out, f"replaced-{target}")
    with pytest.raises(CorruptCheckpoint, match="was replaced while it was being read"):
        convert(source, out, to="cs-h5", parallelism=2, job_id=f"replaced-{target}", parts=runner)
    [refused] = runner.refused
    assert "was replaced since the job first read it" in refused
    storage = open_storage(out)
    assert not list(storage.list(staging_root(out).rsplit("/", 2)[0] + "/"))
    assert _uploads(s3_bucket) == []


class _PlannedFromOtherMetadata(InlineRunner):
    """The layout's plan digest as a job that read other metadata (a config.json replaced between
    the plan and a part) would have recorded it."""

    def __init__(self, out: Path) -> None:
        super().__init__()
        self.out = out

    def dispatch(self, count: int) -> None:
        _edit_doc(self.out, "layout.json", lambda doc: doc.update(plan_digest="0" * 64))
        super().dispatch(count)


def test_a_part_whose_plan_differs_from_the_jobs_is_refused(tmp_path: Path) -> None:
    source = _source(tmp_path, "safetensors")
    out = tmp_path / "out"
    with pytest.raises(CorruptCheckpoint, match="this part's plan differs from the job's"):
        convert(
            source,
            str(out / "model.mdl"),
            to="cs-h5",
            parallelism=2,
            job_id="other",
            parts=_PlannedFromOtherMetadata(out),
        )
    assert not (out / "model.mdl").exists() and not (out / ".ckptconv-staging").exists()


@pytest.mark.parametrize(
    ("parts", "message"),
    [
        ([[[0, 0, 40]], [[0, 41, 100]]], "bytes 40..41 unwritten or overlap"),
        ([[[0, 0, 60]], [[0, 40, 100]]], "bytes 60..40 unwritten or overlap"),
        ([[[0, 0, 40]], [[0, 40, 90]]], "stop at byte 90 of 100"),
    ],
    ids=["gap", "overlap", "short"],
)
def test_a_layout_whose_parts_do_not_tile_its_files_is_refused(parts: list, message: str) -> None:
    # The commit checks the layout (on a takeover, as read back from storage) before it publishes.
    doc = {"files": [{"uri": "f", "size": 100, "tail": None}], "parts": parts}
    with pytest.raises(VerificationFailed, match=message):
        _check_tiling(doc)
    _check_tiling({**doc, "parts": [[[0, 0, 40]], [[0, 40, 100]]]})


def test_sharded_torch_on_s3_holds_files_smaller_than_an_upload_part(tmp_path: Path, s3_bucket) -> None:
    # Each shard is under one upload part: the commit sends each whole, with its central directory.
    source = _source(tmp_path, "safetensors")
    expected = _single(source, f"s3://{s3_bucket}/one", "torch", shard_size=4 * MiB)
    result = convert(source, f"s3://{s3_bucket}/two", to="torch", shard_size=4 * MiB, parallelism=3, job_id="ts3")
    assert [_sha(o.uri) for o in result.outputs] == expected
    assert all(_checksummed(o) for o in result.outputs)
    assert _uploads(s3_bucket) == []
    assert not [i for i in open_storage(f"s3://{s3_bucket}/").list(f"s3://{s3_bucket}/") if "staging" in i.uri]


def test_parts_are_balanced_by_bytes_and_tile_every_file() -> None:
    # One file of one 100 MiB tensor and a small one: parts cut the tensor, never follow names.
    files = [
        FileLayout("a", 100 * MiB + 64, [Span("big", "big", 64, 100 * MiB)]),
        FileLayout("b", 3 * MiB, [Span("s", "s", 0, 3 * MiB)]),
    ]
    block = local_block_size(sum(f.size for f in files), 4)
    assert block == 7 * MiB  # several blocks a part (16 MiB, the single worker's, for larger outputs)
    assert local_block_size(1 << 30, 2) == 16 * MiB and local_block_size(10, 8) == MiB
    parts = split_parts(files, 4, block_size=block)
    assert len(parts) == 4
    sizes = [sum(e - s for _, s, e in p) for p in parts]
    assert max(sizes) - min(sizes) <= 2 * block
    for fi, f in enumerate(files):
        ranges = sorted((s, e) for p in parts for i, s, e in p if i == fi)
        assert ranges[0][0] == 0 and ranges[-1][1] == f.size
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    # Locally the cuts fall on the block digest's blocks: each block is hashed by the part writing it.
    assert all(s % block == 0 for p in parts for _, s, _ in p)
    # On S3 the cuts fall on the upload's part grid.
    grid = split_parts(files, 4, part_size=5 * MiB)
    assert all(s % (5 * MiB) == 0 for p in grid for _, s, _ in p)
    # Never more parts than pieces to cut.
    assert len(split_parts([FileLayout("c", 10, [])], 8)) == 1


def test_a_recorded_part_is_not_run_again_and_a_second_commit_publishes_nothing(tmp_path: Path) -> None:
    source = _source(tmp_path, "safetensors")
    target = str(tmp_path / "out" / "model.mdl")
    first = convert(source, target, to="cs-h5", parallelism=2, job_id="twice")
    manifest = Path(first.manifest)
    stamp = (manifest.stat().st_mtime_ns, manifest.read_bytes())
    again = convert(source, target, to="cs-h5", parallelism=2, job_id="twice")
    assert again.manifest == first.manifest and again.outputs == first.outputs
    assert (manifest.stat().st_mtime_ns, manifest.read_bytes()) == stamp
    # A part asked for after the commit finds nothing to do and writes nothing.
    staging = str(tmp_path / "out" / ".ckptconv-staging" / "late" / "0")
    with pytest.raises(Exception, match="fan-out layout is missing"):
        convert_part(source, target, 0, to="cs-h5", job_id="late", staging=staging)
    assert not (tmp_path / "out" / ".ckptconv-staging").exists()


def test_a_cancelled_fan_out_leaves_no_file_and_no_upload(tmp_path: Path, s3_bucket) -> None:
    source = _source(tmp_path, "safetensors")
    asked = []

    def cancelled() -> bool:
        asked.append(1)
        return len(asked) > 3  # after the first values of the first part

    target = f"s3://{s3_bucket}/team/out/model.mdl"
    with pytest.raises(Cancelled):
        convert(source, target, to="cs-h5", parallelism=2, job_id="cancel", cancelled=cancelled)
    assert list(open_storage(target).list(f"s3://{s3_bucket}/")) == []
    assert _uploads(s3_bucket) == []


def test_a_cancelled_part_sends_no_upload_part_after_it_stopped(tmp_path: Path, s3_bucket) -> None:
    # A part that stops lets go of its lease next: an upload part of it still in flight would reach
    # the store after another attempt took the part over (and after the cleanup aborted the upload).
    g = torch.Generator().manual_seed(5)
    source = str(tmp_path / "many.safetensors")  # 48 MiB: each part sends upload parts mid-way
    save_file({f"w.{i}": torch.randn(1024, 1024, generator=g) for i in range(12)}, source)
    client = open_storage(f"s3://{s3_bucket}/").client  # the shared client every part uses
    started: list[float] = []
    sent: list[float] = []
    in_flight = threading.Event()
    asked = []

    def slow_send(**_: object) -> None:
        started.append(time.monotonic())
        in_flight.set()
        time.sleep(1.5)
        sent.append(time.monotonic())  # the request leaves right after this hook

    def cancelled() -> bool:
        # Before a part's third value (8 MiB written: one 6 MiB upload part went out), once that
        # upload part is on its way.
        asked.append(1)
        return len(asked) > 3 and in_flight.wait(10)

    client.meta.events.register("before-send.s3.UploadPart", slow_send)
    try:
        with pytest.raises(Cancelled):
            target = f"s3://{s3_bucket}/team/out/model.mdl"
            convert(source, target, to="cs-h5", parallelism=2, job_id="cancel-stop", cancelled=cancelled)
        stopped = time.monotonic()
        time.sleep(2.0)  # what was still in flight would have been sent by now
    finally:
        client.meta.events.unregister("before-send.s3.UploadPart", slow_send)
    assert started and len(sent) == len(started)
    assert max(sent) <= stopped, f"an upload part left {max(sent) - stopped:.2f} s after the part stopped"
    assert _uploads(s3_bucket) == []


@pytest.mark.parametrize(("to", "name"), [("safetensors", "m.safetensors"), ("cs-h5", "m.mdl"), ("tf", "ck")])
@pytest.mark.parametrize("where", ["local", "s3"])
def test_more_parts_asked_than_values_and_a_value_above_the_part_size(tmp_path: Path, s3_bucket, to, name, where):
    source = str(tmp_path / "src.safetensors")  # one 24 MiB tensor, a small one, an empty one
    save_file({"big": torch.randn(6 * MiB), "small": torch.randn(3), "empty": torch.zeros(0)}, source)
    base = str(tmp_path) if where == "local" else f"s3://{s3_bucket}"
    expected = _single(source, f"{base}/one/{name}", to)
    result = convert(source, f"{base}/many/{name}", to=to, parallelism=64, job_id=f"many-{to}-{where}")
    assert [_sha(o.uri) for o in result.outputs] == expected
    assert 1 < result.extras["parallelism"] < 64  # the big tensor cut into parts; no empty part
    if where == "s3":
        assert _uploads(s3_bucket) == []


@pytest.mark.parametrize(("to", "name", "first"), [("tf", "ck", "ck.index"), ("cs-s3", "cs", "cs/__METADATA__")])
def test_a_target_created_by_someone_else_before_the_commit_is_kept(
    tmp_path: Path, s3_bucket, monkeypatch, to, name, first
) -> None:
    # The target check passed when the job started; another writer creates one of its objects
    # while the parts run. Publication refuses it and takes back what it had placed.
    from ckptconv.engine.fanout import run as fanout_run

    source = _source(tmp_path, "safetensors")
    foreign = f"s3://{s3_bucket}/team/{first}"
    commit = fanout_run._commit

    def commit_after_another_writer(*args, **kwargs):
        open_storage(foreign).write_bytes(foreign, b"someone else's")
        return commit(*args, **kwargs)

    monkeypatch.setattr(fanout_run, "_commit", commit_after_another_writer)
    with pytest.raises(TargetExists):
        convert(source, f"s3://{s3_bucket}/team/{name}", to=to, parallelism=2, job_id=f"raced-{to}")
    storage = open_storage(foreign)
    assert [i.uri for i in storage.list(f"s3://{s3_bucket}/")] == [foreign]
    assert storage.read_all(foreign) == b"someone else's"
    assert _uploads(s3_bucket) == []


def test_a_memory_budget_holds_for_each_part_of_a_fan_out(tmp_path: Path, s3_bucket) -> None:
    # Each part's process gets the budget: it sizes the read-ahead and, on S3, how many upload parts
    # of the grid go at once; too small a budget is refused before a byte is published.
    source = _source(tmp_path, "safetensors")
    largest = 5 * MiB  # layers.0.attn.q
    with pytest.raises(InvalidRequest, match="memory budget"):
        convert(source, f"s3://{s3_bucket}/small/model.mdl", to="cs-h5", parallelism=2, memory_budget="301MiB")
    assert list(open_storage(f"s3://{s3_bucket}/").list(f"s3://{s3_bucket}/small/")) == []
    assert _uploads(s3_bucket) == []
    roomy = convert(source, f"s3://{s3_bucket}/roomy/model.mdl", to="cs-h5", parallelism=2, job_id="budget-roomy")
    grid = roomy.memory["writer_buffer_bytes"] // (4 + 2)  # 4 parts in flight and 2 being filled
    budget = 2 * largest + (2 + 2) * grid + (300 << 20)  # room for 2 in flight, not 3
    tight = convert(
        source, f"s3://{s3_bucket}/tight/model.mdl", to="cs-h5", parallelism=2, memory_budget=budget, job_id="budget"
    )
    assert roomy.memory["upload_concurrency"] == 4 and tight.memory["upload_concurrency"] == 2
    assert tight.memory["budget_bytes"] == budget == tight.memory["estimated_peak_bytes"]
    assert [_sha(o.uri) for o in tight.outputs] == [_sha(o.uri) for o in roomy.outputs]
    manifest = json.loads(open_storage(tight.manifest).read_all(tight.manifest))
    assert manifest["memory"] == tight.memory


def _read_aheads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The read-ahead every part's Prefetcher is given, as the parts start."""
    from ckptconv.engine.fanout import part

    read_aheads: list[int] = []
    prefetcher = part.Prefetcher

    def spy(src, keys, sizes, read_ahead, **kw):
        read_aheads.append(read_ahead)
        return prefetcher(src, keys, sizes, read_ahead, **kw)

    monkeypatch.setattr(part, "Prefetcher", spy)
    return read_aheads


def test_a_part_reads_ahead_what_its_own_memory_model_leaves(tmp_path: Path, monkeypatch) -> None:
    """A layout prepared by a version that left the read-ahead more of the budget (it counted less
    beside it): its parts read ahead what this version's model leaves, and the budget holds."""
    from ckptconv.engine.fanout import run

    source = _source(tmp_path, "safetensors")
    largest, budget = 5 * MiB, 400 * MiB
    prepared = run._part_memory
    monkeypatch.setattr(run, "_part_memory", lambda *a: {**prepared(*a), "read_ahead_bytes": budget})
    read_aheads = _read_aheads(monkeypatch)
    target = str(tmp_path / "out" / "model.mdl")
    convert(source, target, to="cs-h5", parallelism=2, memory_budget=budget, job_id="old-split")
    # A copy: the budget less the pool's largest value, the direct writes' staging and the fixed share.
    assert read_aheads == [budget - largest - (48 << 20) - (300 << 20)] * 2
    assert [_sha(target)] == _single(source, str(tmp_path / "one" / "model.mdl"), "cs-h5")


def test_a_layout_whose_budget_this_version_finds_too_small_still_runs(tmp_path: Path, monkeypatch) -> None:
    """A budget accepted by the version that prepared the layout and below this version's minimum:
    the parts read ahead their largest value and the job publishes (the manifest's estimate says
    by how much the run passes the budget), instead of failing a job that was accepted."""
    from ckptconv.engine.fanout import run

    source = _source(tmp_path, "safetensors")
    largest, budget = 5 * MiB, 301 * MiB
    prepared = run._part_memory
    # Recorded as the earlier version would have: the budget, taken.
    monkeypatch.setattr(
        run, "_part_memory", lambda plan, src, _, size: {**prepared(plan, src, None, size), "budget_bytes": budget}
    )
    read_aheads = _read_aheads(monkeypatch)
    target = str(tmp_path / "out" / "model.mdl")
    result = convert(source, target, to="cs-h5", parallelism=2, memory_budget=budget, job_id="old-budget")
    assert len(read_aheads) == 2 and max(read_aheads) <= largest
    assert result.memory["budget_bytes"] == budget < result.memory["estimated_peak_bytes"]
    assert [_sha(target)] == _single(source, str(tmp_path / "one" / "model.mdl"), "cs-h5")


def test_auto_parallelism_picks_parts_by_output_bytes(tmp_path: Path) -> None:
    assert resolve_parallelism(5, 1, "safetensors") == 5  # a number is taken as given
    assert resolve_parallelism("auto", 1, "safetensors") == 1
    assert resolve_parallelism("auto", (2 << 30) + 1, "cs-h5") == 2  # one part per 2 GiB by default
    assert resolve_parallelism("auto", 1 << 50, "cs-h5") == 16  # capped by the setting's default
    assert resolve_parallelism("auto", 1 << 50, "cs-h5", AutoParallelism(1, 1000)) == 256  # and by 256
    assert resolve_parallelism("auto", 1 << 50, "dcp") == 1  # a format that cannot fan out: 1, no error
    source = _source(tmp_path, "safetensors")  # about 14 MiB of output: 3 parts of 5 MiB
    expected = _single(source, str(tmp_path / "one" / "m.safetensors"), "safetensors")
    auto = AutoParallelism(part_bytes=5 * MiB, max_parts=8)
    result = convert(source, str(tmp_path / "auto" / "m.safetensors"), parallelism="auto", auto_parallelism=auto)
    assert result.extras["parallelism"] == 3
    _block_digested(result.outputs, expected)


def test_an_lz4_h5_output_is_written_by_one_process(tmp_path: Path) -> None:
    """LZ4 chunks take the room they compress to: no layout up front, so no fan-out. A count over
    1 is refused before anything is written; "auto" picks 1."""
    source = _source(tmp_path, "safetensors")
    lz4 = {"compression": "lz4"}
    assert resolve_parallelism("auto", 1 << 50, "cs-h5", sink_options=lz4) == 1
    with pytest.raises(InvalidRequest, match="offsets are not known up front") as refused:
        convert(source, str(tmp_path / "two" / "m.mdl"), parallelism=2, h5_compression="lz4")
    assert "parallelism 1" in (refused.value.hint or "")
    assert not (tmp_path / "two").exists() or list((tmp_path / "two").rglob("*")) == []
    auto = AutoParallelism(part_bytes=5 * MiB, max_parts=8)
    result = convert(
        source, str(tmp_path / "auto" / "m.mdl"), parallelism="auto", auto_parallelism=auto, h5_compression="lz4"
    )
    assert "parallelism" not in result.extras
    with h5py.File(result.target, "r") as f:
        assert all(f[k].chunks is not None for k in f if f[k].size > 1)


def _objects(result, base: str) -> list[tuple[str, str, dict]]:
    """Each output object of a cs-s3 checkpoint under ``base``: its name, digest and S3 user metadata
    (but the id of the job that placed it, which names each job's own)."""
    storage = open_storage(base)

    def meta(uri: str) -> dict:
        if not base.startswith("s3://"):
            return {}
        return {k: v for k, v in storage.user_metadata(uri).items() if k != OWNER_METADATA}

    return sorted((o.uri[len(base) :], _sha(o.uri), meta(o.uri)) for o in result.outputs)


@pytest.mark.parametrize(("source_fmt", "where"), [("safetensors", "local"), ("cs-h5", "s3"), ("torch", "s3")])
def test_cs_s3_fans_out_object_by_object_to_the_single_worker_objects(source_fmt, where, tmp_path: Path, s3_bucket):
    # One object per key: parts are objects (big ones cut by bytes), each with its user metadata.
    source = _source(tmp_path, source_fmt)
    base = f"s3://{s3_bucket}" if where == "s3" else str(tmp_path)
    one = convert(source, f"{base}/one/ckpt", to="cs-s3")
    three = convert(source, f"{base}/three/ckpt", to="cs-s3", parallelism=3, job_id="fan-cs-s3")
    assert three.extras["parallelism"] == 3 and three.verify["ok"] is True
    expected = _objects(one, f"{base}/one")
    assert _objects(three, f"{base}/three") == expected and len(expected) == len(_tensors()) + 1
    assert all(_checksummed(o) for o in three.outputs)
    if where == "s3":
        assert any(meta for _, _, meta in expected)  # the objects' metadata made it through the uploads
        assert _uploads(s3_bucket) == []


def test_a_cs_s3_fan_out_with_no_tensor_bytes_records_the_one_part_it_ran_as(tmp_path: Path, s3_bucket) -> None:
    # Nothing for parts to write (one empty tensor): the prepare and the commit write every object,
    # one process, and the manifest says so rather than 0.
    source = str(tmp_path / "src.safetensors")
    save_file({"empty": torch.zeros(0, 4)}, source)
    result = convert(source, f"s3://{s3_bucket}/none/ckpt", to="cs-s3", parallelism=2, job_id="no-bytes")
    assert result.extras["parallelism"] == 1
    manifest = json.loads(open_storage(result.manifest).read_all(result.manifest))
    assert manifest["extras"]["parallelism"] == 1
    assert _uploads(s3_bucket) == []


def _llama(path: Path, hidden: int) -> None:
    """A small Llama saved as Hugging Face does."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=2048,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)


def test_a_layout_conversion_fans_out_to_the_single_worker_bytes(tmp_path: Path, s3_bucket) -> None:
    from ckptconv.engine.layouts.api import convert_model

    _llama(tmp_path / "hf", hidden=512)  # about 25 MB
    args = {"model": "llama", "src_fmt": "hf", "tgt_fmt": "cs-2.9"}
    one = convert_model(str(tmp_path / "hf"), f"s3://{s3_bucket}/one", **args)
    two = convert_model(str(tmp_path / "hf"), f"s3://{s3_bucket}/two", parallelism=2, job_id="fan-layout", **args)
    assert two.extras["parallelism"] == 2
    assert [o.role for o in two.outputs] == [o.role for o in one.outputs] == ["data", "config"]
    assert [_sha(o.uri) for o in two.outputs] == [_sha(o.uri) for o in one.outputs]
    assert all(_checksummed(o) for o in two.outputs)
    assert two.verify["ok"] is True and two.verify["entries_checked"] == one.verify["entries_checked"]
    assert _uploads(s3_bucket) == []


def test_a_layout_conversion_to_torch_shards_fans_out_to_the_single_worker_bytes(tmp_path: Path) -> None:
    from ckptconv.engine.layouts.api import convert_model

    _llama(tmp_path / "hf", hidden=256)  # about 8 MB
    convert_model(str(tmp_path / "hf"), str(tmp_path / "cs"), model="llama", src_fmt="hf", tgt_fmt="cs-2.9")
    cs = str(next((tmp_path / "cs").glob("*.mdl")))
    yaml = str(next((tmp_path / "cs").glob("*.yaml")))
    args = {"model": "llama", "src_fmt": "cs-2.9", "tgt_fmt": "hf", "hf_shard_size": "3MB", "config": yaml}
    one = convert_model(cs, str(tmp_path / "one"), **args)
    two = convert_model(cs, str(tmp_path / "two"), parallelism=3, job_id="fan-torch-layout", **args)
    assert two.extras["parallelism"] == 3
    assert [o.role for o in two.outputs] == [o.role for o in one.outputs]
    assert len([o for o in two.outputs if o.uri.endswith(".bin")]) > 1
    _block_digested(two.outputs, [_sha(o.uri) for o in one.outputs])
    assert two.verify["ok"] is True


def test_a_fan_out_that_only_moves_bytes_never_imports_torch(tmp_path: Path) -> None:
    # Its parts read tensors as bytes, as the single-worker executor does (formats.base.RawTensor).
    import subprocess
    import sys

    source = _source(tmp_path, "safetensors")
    expected = _single(source, str(tmp_path / "one" / "out.mdl"), "cs-h5")
    code = f"""
import sys
from ckptconv.engine.convert import convert
from ckptconv.storage.digests import hex_digest
result = convert({source!r}, {str(tmp_path / "three" / "out.mdl")!r}, to="cs-h5", parallelism=3, job_id="fan-raw")
print(hex_digest(open(result.outputs[0].uri, "rb").read()))
assert "torch" not in sys.modules, "the fan-out imported torch"
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parents[1])
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == expected


def test_a_cancel_after_the_last_part_is_recorded_publishes_nothing(tmp_path: Path) -> None:
    # A cancel that comes once every part is recorded (while the commit checks the records and
    # writes the tails) still stops the job before anything is published.
    source = _source(tmp_path, "safetensors")
    out = tmp_path / "out"

    def cancelled() -> bool:
        return len(list(out.rglob("part-*.json"))) == 2

    with pytest.raises(Cancelled):
        convert(source, str(out / "model.safetensors"), to="safetensors", parallelism=2, cancelled=cancelled)
    assert not (out / "model.safetensors").exists()
    assert not (out / ".ckptconv-staging").exists()


def test_a_part_record_whose_blocks_are_in_another_hash_fails_the_commit_cleanly(tmp_path: Path, monkeypatch) -> None:
    """A part whose record names another block hash than this version's is never merged with the
    others' into a block digest: the commit fails and publishes nothing."""
    from ckptconv.engine.fanout import commit

    read_doc = commit._read_doc

    def in_sha256(storage, uri):
        doc = read_doc(storage, uri)
        if doc is not None and Path(uri).name == "part-00001.json":
            doc["digest"] = "sha256"
        return doc

    monkeypatch.setattr(commit, "_read_doc", in_sha256)
    source = _source(tmp_path, "safetensors")
    out = tmp_path / "out"
    with pytest.raises(VerificationFailed, match=r"part 1's record .* \(block hashes in sha256, not blake3\)"):
        convert(source, str(out / "model.mdl"), to="cs-h5", parallelism=2, job_id="old-part")
    assert not (out / "model.mdl").exists()


def test_a_part_refuses_a_layout_of_the_sha256_version(tmp_path: Path, monkeypatch) -> None:
    """A layout of version 2 (block hashes in sha256): a part of this version does not write into
    it (its blocks would be hashed in another hash than the other parts')."""
    from ckptconv.engine.fanout import run

    monkeypatch.setattr(run, "LAYOUT_VERSION", 2)  # what the layout says
    source = _source(tmp_path, "safetensors")
    out = tmp_path / "out"
    with pytest.raises(VerificationFailed, match="layout version 2"):
        convert(source, str(out / "model.mdl"), to="cs-h5", parallelism=2, job_id="old-layout")
    assert not (out / "model.mdl").exists()


@pytest.mark.parametrize("failing_part", [None, 2])
def test_an_output_over_the_copy_threshold_is_published_by_part_copies(
    tmp_path: Path, s3_bucket, monkeypatch, failing_part: int | None
) -> None:
    # The threshold lowered (5 GiB in production): publication copies the staged object in parts.
    # One part copy refused fails the job with the target and the staging area empty, no upload left.
    from botocore.exceptions import ClientError

    storage = open_storage(f"s3://{s3_bucket}/")  # the instance every step of the job uses
    monkeypatch.setattr(storage, "multipart_copy_threshold", 5 * MiB)
    monkeypatch.setattr(storage, "copy_part_size", 5 * MiB)
    monkeypatch.setenv("CKPTCONV_STORAGE_ATTEMPTS", "1")
    source = _source(tmp_path, "safetensors")  # about 14 MiB as cs-h5: 3 part copies
    expected = _single(source, f"s3://{s3_bucket}/one/model.mdl", "cs-h5")
    copy_part, copied = storage.client.upload_part_copy, []

    def copy(**kwargs: object) -> dict:
        copied.append(kwargs["PartNumber"])
        if kwargs["PartNumber"] == failing_part:
            raise ClientError({"Error": {"Code": "AccessDenied", "Message": "no"}}, "UploadPartCopy")
        return copy_part(**kwargs)

    monkeypatch.setattr(storage.client, "upload_part_copy", copy)
    target = f"s3://{s3_bucket}/two/model.mdl"
    if failing_part is None:
        result = convert(source, target, to="cs-h5", parallelism=2, job_id="part-copies")
        assert [_sha(o.uri) for o in result.outputs] == expected
    else:
        with pytest.raises(StorageError):
            convert(source, target, to="cs-h5", parallelism=2, job_id="part-copies")
        assert list(storage.list(f"s3://{s3_bucket}/two/")) == []
    assert sorted(copied) == [1, 2, 3]
    assert _uploads(s3_bucket) == []


def test_a_part_writes_a_local_file_in_pieces_of_the_single_worker_size(tmp_path: Path, monkeypatch) -> None:
    """A part hands a local file its values in pieces, as the single-worker sinks do (one write of
    a whole large value into the page cache costs more per byte), and the bytes stay the same."""
    from ckptconv.engine.fanout import part
    from ckptconv.storage.local import LocalPatch

    source = _source(tmp_path, "safetensors")
    expected = _single(source, str(tmp_path / "one" / "out.mdl"), "cs-h5")
    monkeypatch.setattr(part, "WRITE_PIECE_BYTES", 1 * MiB, raising=False)
    sizes: list[int] = []
    write_at = LocalPatch.write_at

    def recorded(self: LocalPatch, offset: int, data: memoryview) -> None:
        sizes.append(len(memoryview(data).cast("B")))
        write_at(self, offset, data)

    monkeypatch.setattr(LocalPatch, "write_at", recorded)
    result = convert(source, str(tmp_path / "two" / "out.mdl"), to="cs-h5", parallelism=2, job_id="pieces")
    assert [_sha(o.uri) for o in result.outputs] == expected
    assert sum(sizes) > 8 * MiB and max(sizes) == 1 * MiB


def test_a_part_leaves_no_buffers_in_the_pool_when_it_ends(tmp_path: Path) -> None:
    # A part's process is counted as a single worker's (Plan.memory): the buffer pool
    # holds at most the largest value while the part runs, and nothing after it, not up to its
    # default 128 MiB in a worker waiting for its next part.
    from ckptconv.formats.memory import POOL

    source = _source(tmp_path, "safetensors")
    POOL.clear()
    result = convert(source, str(tmp_path / "out" / "model.mdl"), to="cs-h5", parallelism=2, job_id="fan-pool")
    assert result.extras["parallelism"] == 2 and result.verify["ok"] is True
    assert POOL.idle_bytes == 0


def test_a_part_reads_its_values_into_the_buffers_of_those_it_wrote(tmp_path: Path) -> None:
    """A part lets the reads ahead of it claim a value's bytes only once it has written that value
    and let it go, as the single-worker executor does: the next value is then read into the
    buffer the last one left in the pool, not into fresh memory the kernel must zero first."""
    from ckptconv.formats.memory import POOL

    g = torch.Generator().manual_seed(5)
    tensors = {f"layers.{i}.w": torch.randn(1536, 1024, generator=g) for i in range(12)}  # 6 MiB each
    source = str(tmp_path / "src.safetensors")
    save_file(tensors, source)
    POOL.clear()
    before = POOL.fresh_bytes
    result = convert(source, str(tmp_path / "out" / "model.mdl"), to="cs-h5", parallelism=2, job_id="fan-reuse")
    assert result.extras["parallelism"] == 2 and result.verify["ok"] is True
    # Each part: the value it writes and the one read ahead; the rest in their buffers.
    assert POOL.fresh_bytes - before <= 2 * 2 * 6 * MiB


@pytest.mark.parametrize("where", ["local", "s3"])
def test_the_recorded_parts_are_read_from_one_listing_of_their_names(tmp_path: Path, s3_bucket, where: str) -> None:
    target = f"s3://{s3_bucket}/listed/model.mdl" if where == "s3" else str(tmp_path / "listed" / "model.mdl")
    storage = open_storage(target)
    layout = _layout(storage, target, None, "listed")
    fanout = storage.join(layout.staging, ".fanout")
    for name in ["part-00000.json", "part-00002.json", "part-100000.json", "gaps-00003.bin", "held-00004.bin"]:
        storage.write_bytes(storage.join(fanout, name), b"{}")
    for name in ["part-00005.json.partial", "part-6.json", "part-00007.jsonx"]:
        storage.write_bytes(storage.join(fanout, name), b"{}")  # not a record's name
    assert _recorded_parts(layout) == {0, 2, 100000}
