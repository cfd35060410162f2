"""The engine end to end: every container pair, local and S3, staging, verification, idempotency."""

from __future__ import annotations

import ctypes
import errno
import json
import struct
import threading
from pathlib import Path

import pytest
import torch
from killed_copy import killed_after_the_first_file, killed_at_the_second_part, lower_copy_threshold

from ckptconv.core.errors import (
    Cancelled,
    InvalidRequest,
    StorageError,
    StorageUnavailable,
    TargetExists,
    UnsupportedValue,
)
from ckptconv.engine import run as engine
from ckptconv.engine.convert import convert, inspect, plan_conversion
from ckptconv.engine.execute import execute, verify_output
from ckptconv.engine.plan import identity_plan
from ckptconv.engine.staging import STAGING_DIR
from ckptconv.formats import sink_class, source_class
from ckptconv.formats.detect import open_source
from ckptconv.formats.tree import flatten
from ckptconv.storage import open_storage
from ckptconv.storage.digests import file_digests, holds_output

CONTAINERS = ["cs-h5", "safetensors", "torch"]


def _state_dict() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "model.embed.weight": torch.randn(64, 16, generator=g).to(torch.bfloat16),
        "model.layers.0.w": torch.randn(16, 16, generator=g),
        "model.layers.0.b": torch.randn(16, generator=g).to(torch.float16),
        "model.layers.1.w": torch.randn(16, 16, generator=g, dtype=torch.float64),
        "model.mask": torch.rand(4, 4, generator=g) > 0.5,
        "model.count": torch.arange(5, dtype=torch.int64),
        "model.scalar": torch.tensor(3.5),
    }


def write_source(tmp: Path, fmt: str, tree: dict | None = None) -> str:
    """Write ``tree`` with our own sink of ``fmt`` (formats are tested against their owners elsewhere)."""
    tree = tree if tree is not None else _state_dict()
    leaves, spec = flatten(tree)
    from ckptconv.formats.base import Entry

    entries = []
    for key, v in leaves:
        if isinstance(v, torch.Tensor):
            entries.append(Entry(key, "tensor", str(v.dtype).removeprefix("torch."), tuple(v.shape)))
        else:
            entries.append(Entry(key, "value", value=v))
    uri = str(tmp / {"cs-h5": "src.mdl", "safetensors": "src_st", "torch": "src_pt"}[fmt])
    sink = sink_class(fmt)(open_storage(uri), uri)
    sink.begin(entries, spec)
    for key, v in leaves:
        sink.write(key, v)
    sink.commit()
    return uri


def _staged_files(root: Path) -> list[Path]:
    staging = root / STAGING_DIR
    return [p for p in staging.rglob("*") if p.is_file()] if staging.exists() else []


def read_all(uri: str, fmt: str | None = None) -> dict:
    src = open_source(uri, fmt)
    try:
        out = {}
        for e in src.entries():
            out[e.key] = e.value if e.kind == "value" else src.read(e.target if e.kind == "link" else e.key)
        return out
    finally:
        src.close()


def assert_same(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype, k
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


@pytest.mark.parametrize("src_fmt", CONTAINERS)
@pytest.mark.parametrize("dst_fmt", CONTAINERS)
def test_every_container_pair_round_trips(tmp_path: Path, src_fmt: str, dst_fmt: str) -> None:
    src = write_source(tmp_path, src_fmt)
    target = str(tmp_path / ("out.mdl" if dst_fmt == "cs-h5" else "out"))
    result = convert(src, target, to=dst_fmt)
    assert result.verify["ok"] is True
    assert result.verify["entries_checked"] == len(_state_dict())
    assert_same(read_all(src), read_all(target, dst_fmt))
    manifest = json.loads(Path(result.manifest).read_text())
    assert manifest["target"]["format"] == dst_fmt
    for f in manifest["files"]:
        # its digest, or the block digest of a file written out of order (a local H5 output)
        assert holds_output(Path(f["uri"]).read_bytes(), f), f
    assert not _staged_files(tmp_path)


def test_cast_dtype_keeps_integers(tmp_path: Path) -> None:
    src = write_source(tmp_path, "safetensors")
    out = str(tmp_path / "out.mdl")
    result = convert(src, out, to="cs-h5", dtype="bfloat16")
    got = read_all(out)
    assert got["model.layers.0.w"].dtype == torch.bfloat16
    assert got["model.count"].dtype == torch.int64
    assert got["model.mask"].dtype == torch.bool
    assert any("keep their dtype" in w for w in result.warnings)


def test_existing_target_is_refused_and_untouched(tmp_path: Path) -> None:
    src = write_source(tmp_path, "safetensors")
    out = tmp_path / "out.mdl"
    out.write_bytes(b"precious")
    with pytest.raises(TargetExists):
        convert(src, str(out), to="cs-h5")
    assert out.read_bytes() == b"precious"


@pytest.mark.parametrize("parallelism", [1, 2])
def test_a_manifest_left_beside_a_file_target_refuses_the_job_before_any_work(tmp_path: Path, parallelism: int) -> None:
    # A file target publishes T.manifest.json beside itself: with that name taken the publication
    # could only fail, so the job must fail before it reads a tensor, not after copying them all.
    src = write_source(tmp_path, "safetensors")
    out = tmp_path / "out.mdl"
    beside = tmp_path / "out.mdl.manifest.json"
    beside.write_text("{}")
    stages: list[str] = []
    with pytest.raises(TargetExists, match="manifest"):
        convert(src, str(out), to="cs-h5", parallelism=parallelism, progress=lambda p: stages.append(p.stage))
    assert stages == [] and not out.exists() and beside.read_text() == "{}"
    assert not _staged_files(tmp_path)


def test_cancel_leaves_nothing(tmp_path: Path) -> None:
    src = write_source(tmp_path, "safetensors")
    out = tmp_path / "out"
    calls = {"n": 0}

    def cancelled() -> bool:
        calls["n"] += 1
        return calls["n"] > 3

    with pytest.raises(Cancelled):
        convert(src, str(out), to="safetensors", cancelled=cancelled)
    assert not out.exists()
    assert not _staged_files(tmp_path)


def test_same_job_id_is_idempotent(tmp_path: Path) -> None:
    src = write_source(tmp_path, "safetensors")
    out = str(tmp_path / "out.mdl")
    first = convert(src, out, to="cs-h5", job_id="job-1")
    again = convert(src, out, to="cs-h5", job_id="job-1")
    assert again.to_dict()["outputs"] == first.to_dict()["outputs"]
    with pytest.raises(TargetExists):
        convert(src, out, to="cs-h5", job_id="job-2")


def test_interrupted_publication_is_completed_by_a_retry(tmp_path: Path) -> None:
    """A worker that died after staging and verifying: the retry publishes without converting again."""
    src = write_source(tmp_path, "safetensors")
    out = str(tmp_path / "out")
    storage = open_storage(out)
    real_publish = engine._publish
    with pytest.raises(RuntimeError):
        engine._publish = _raise  # type: ignore[assignment]
        try:
            convert(src, out, to="safetensors", job_id="job-x")
        finally:
            engine._publish = real_publish  # type: ignore[assignment]
    assert not Path(out).exists()
    result = convert(src, out, to="safetensors", job_id="job-x")
    assert result.verify["ok"]
    assert_same(read_all(src), read_all(out))
    assert storage.exists(result.manifest)


def _raise(*a, **k):
    raise RuntimeError("worker died")


def _as_earlier_version(manifest: Path) -> dict:
    """Rewrite a manifest as versions before BLAKE3 wrote it: each file's sha256, and for a file
    written out of order (no whole-file digest) ``sha256_blocks`` instead."""
    doc = json.loads(manifest.read_text())
    # Its files' paths are relative to the directory the manifest's own path is (the staging area's
    # or the target's parent).
    base = next(d for d in manifest.parents if (d / doc["files"][0]["path"]).exists())
    for f in doc["files"]:
        with open(base / f["path"], "rb") as data:
            whole, blocks = file_digests(data, 1 << 16, "sha256")
        had_blocks = f.pop("blake3_blocks", None) is not None
        had_whole = f.pop("blake3") is not None
        f["sha256"] = whole if had_whole else None
        if had_blocks:
            f["sha256_blocks"] = {"block_size": 1 << 16, "sha256": blocks}
    manifest.write_text(json.dumps(doc, indent=2))
    return doc


def test_a_manifest_of_an_earlier_version_still_answers_a_redelivered_job(tmp_path: Path) -> None:
    """A job published before digests were BLAKE3: its manifest names sha256 (a local H5 output's
    block digest too) and a redelivery returns it as recorded, sha256 named as sha256."""
    src = write_source(tmp_path, "safetensors")
    out = tmp_path / "out.mdl"
    first = convert(src, str(out), to="cs-h5", job_id="old-job")
    assert [set(o) & {"blake3", "blake3_blocks"} for o in first.to_dict()["outputs"]] == [{"blake3", "blake3_blocks"}]
    old = _as_earlier_version(Path(first.manifest))
    again = convert(src, str(out), to="cs-h5", job_id="old-job")
    entries = again.to_dict()["outputs"]
    assert [(e["sha256"], e["sha256_blocks"]) for e in entries] == [
        (f["sha256"], f["sha256_blocks"]) for f in old["files"]
    ]
    assert all("blake3" not in e and holds_output(Path(e["uri"]).read_bytes(), e) for e in entries)
    assert engine.end_unpublished(str(out), "old-job")["outputs"] == entries


def test_an_interrupted_publication_of_an_earlier_version_checks_its_sha256(tmp_path: Path) -> None:
    """A staged manifest written before BLAKE3 (sha256), its publication interrupted after a file
    was placed: the retry checks the placed file against its sha256 and completes; a file that
    differs is never taken for the staged one."""
    src = write_source(tmp_path, "safetensors")
    for name, tamper in (("out", False), ("bad", True)):
        out = tmp_path / name
        real_publish = engine._publish
        with pytest.raises(RuntimeError):
            engine._publish = _raise  # type: ignore[assignment]
            try:
                convert(src, str(out), to="safetensors", job_id=f"old-{name}")
            finally:
                engine._publish = real_publish  # type: ignore[assignment]
        [staged_manifest] = [p for p in _staged_files(tmp_path) if p.name.endswith("manifest.json") and name in str(p)]
        doc = _as_earlier_version(staged_manifest)
        data = next(f for f in doc["files"] if f["role"] == "data")
        placed = Path(data["uri"])
        placed.parent.mkdir(parents=True)
        staged = next(d / data["path"] for d in staged_manifest.parents if (d / data["path"]).exists())
        raw = bytearray(staged.read_bytes())
        if tamper:
            raw[-1] ^= 1
        placed.write_bytes(bytes(raw))  # the file the interrupted publication had placed
        if tamper:
            with pytest.raises(TargetExists):
                convert(src, str(out), to="safetensors", job_id=f"old-{name}")
            continue
        result = convert(src, str(out), to="safetensors", job_id=f"old-{name}")
        assert [o.algorithm for o in result.outputs] == ["sha256"] * len(doc["files"])
        assert_same(read_all(src), read_all(str(out)))


def test_verification_catches_corrupted_output(tmp_path: Path) -> None:
    src_uri = write_source(tmp_path, "safetensors")
    src = open_source(src_uri)
    plan = identity_plan(src.entries(), src.spec)
    out = str(tmp_path / "staged")
    sink = sink_class("safetensors")(open_storage(out), out)
    digests = execute(plan, src, sink)
    files = sink.commit()
    data = next(Path(f.uri) for f in files if f.uri.endswith(".safetensors"))
    raw = bytearray(data.read_bytes())
    raw[-3] ^= 0xFF  # flip bits inside the last tensor's bytes
    data.write_bytes(bytes(raw))
    report = verify_output(plan, digests, source_class("safetensors")(open_storage(out), out))
    assert not report.ok
    assert any("content differs" in m for m in report.mismatches)
    src.close()


class _ReadLog:
    """Records the source's reads (a spy on the instance's ``read``; the reads still happen)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, source) -> None:
        self.keys: list[str] = []
        self.started = threading.Event()
        read = source.read

        def logged(key: str):
            self.keys.append(key)
            self.started.set()
            return read(key)

        monkeypatch.setattr(source, "read", logged)


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("ckptconv-prefetch")]


def test_the_reads_start_while_a_cs_h5_sink_lays_out_its_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The cs-h5 skeleton (a dataset and its attributes per entry) takes hundreds of ms for a large
    # model: the source must not sit idle meanwhile. The skeleton waits here for the first read;
    # run in order, it would wait the full timeout and see none.
    src = open_source(write_source(tmp_path, "safetensors"))
    reads = _ReadLog(monkeypatch, src)
    out = str(tmp_path / "out.mdl")
    sink = sink_class("cs-h5")(open_storage(out), out)
    allocate = sink._allocate
    seen: list[bool] = []

    def allocate_after_a_read(*args):
        seen.append(reads.started.wait(timeout=10))
        return allocate(*args)

    monkeypatch.setattr(sink, "_allocate", allocate_after_a_read)
    plan = identity_plan(src.entries(), src.spec)
    execute(plan, src, sink)
    sink.commit()
    src.close()
    assert seen == [True]
    assert_same(read_all(out), _state_dict())


def _output_path(tmp_path: Path, fmt: str) -> Path:
    """Where a test's output of ``fmt`` goes: a file, a bundle prefix or a directory."""
    return tmp_path / {"cs-h5": "out.mdl", "tf": "out_tf/model.ckpt"}.get(fmt, "out")


def _refuse(case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str) -> str:
    """A target that ``fmt``'s sink refuses in ``begin``, by ``case``; returns its URI."""
    out = _output_path(tmp_path, fmt)
    if case == "exists":
        if fmt == "tf":
            out.parent.mkdir()
            (out.parent / "model.ckpt.index").write_bytes(b"precious")
        else:
            out.write_bytes(b"precious")
    elif case == "full":  # no room for the output on its filesystem

        class Full:
            f_bavail, f_frsize = 0, 4096

        monkeypatch.setattr("ckptconv.storage.local.os.statvfs", lambda path: Full())
    else:  # over a quota, which statvfs does not show: the blocks' reservation is refused

        def over_quota(fd: int, mode: int, offset: int, nbytes: int) -> int:
            ctypes.set_errno(errno.EDQUOT)
            return -1

        monkeypatch.setattr("ckptconv.storage.local._fallocate", over_quota)
    return str(out)


@pytest.mark.parametrize(
    "case,fmt",
    [
        ("exists", "cs-h5"),
        ("exists", "tf"),
        ("full", "cs-h5"),
        ("full", "safetensors"),
        ("full", "torch"),
        ("quota", "cs-h5"),
    ],
)
def test_a_sink_that_refuses_the_job_in_begin_reads_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str, fmt: str
) -> None:
    src = open_source(write_source(tmp_path, "safetensors"))
    reads = _ReadLog(monkeypatch, src)
    out = _refuse(case, tmp_path, monkeypatch, fmt)
    sink = sink_class(fmt)(open_storage(out), out)
    with pytest.raises(TargetExists if case == "exists" else StorageError):
        execute(identity_plan(src.entries(), src.spec), src, sink)
    sink.abort()
    src.close()
    assert reads.keys == []
    assert not _prefetch_threads()


def test_a_begin_failing_after_the_reads_started_waits_for_them_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A failure past the checks (HDF5 failing to lay out the file) stops the readers while one is
    # reading: the error waits for that read (its buffer must be back before the pool's cap is
    # lifted), and then nothing is left running or on disk.
    src = open_source(write_source(tmp_path, "safetensors"))
    in_read, go_on = threading.Event(), threading.Event()
    read = src.read

    def held_read(key: str):
        in_read.set()
        assert go_on.wait(timeout=10)
        return read(key)

    monkeypatch.setattr(src, "read", held_read)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = str(out_dir / "out.mdl")
    sink = sink_class("cs-h5")(open_storage(out), out)

    def failing_allocate(*args):
        assert in_read.wait(timeout=10)
        go_on.set()
        raise OSError("injected: HDF5 could not lay out the file")

    monkeypatch.setattr(sink, "_allocate", failing_allocate)
    with pytest.raises(OSError, match="injected"):
        execute(identity_plan(src.entries(), src.spec), src, sink)
    assert not _prefetch_threads()
    sink.abort()
    src.close()
    assert list(out_dir.iterdir()) == []


@pytest.mark.parametrize("to", ["cs-h5", "safetensors", "tf", "torch"])
def test_a_key_that_is_not_unicode_text_is_refused_before_the_target_is_touched(tmp_path: Path, to: str) -> None:
    # JSON can escape a lone surrogate, which no container's UTF-8 names (JSON headers, HDF5, S3
    # keys, TensorFlow's table) can hold.
    header = '{"a.w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
    header += '"bad\\udcff":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}}'
    raw = header.encode() + b" " * (-len(header) % 8)
    src = tmp_path / "model.safetensors"
    src.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(16))
    out = _output_path(tmp_path, to)
    with pytest.raises(UnsupportedValue, match="not valid Unicode") as err:
        convert(str(src), str(out), to=to)
    assert err.value.details["key"] == "bad\udcff"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


def test_plan_and_inspect_read_metadata_only(tmp_path: Path) -> None:
    src = write_source(tmp_path, "cs-h5")
    view = plan_conversion(src, to="safetensors", shard_size="1KB")
    assert view["ok"], view["errors"]
    assert view["tensors"] == len(_state_dict())
    assert len(view["shards"]) > 1
    assert view["estimated_peak_memory_bytes"] >= view["largest_tensor_bytes"]
    info = inspect(src)
    assert info["format"] == "cs-h5"
    assert info["tensors"] == len(_state_dict())


def test_plan_reports_unsupported_dtype(tmp_path: Path) -> None:
    src = write_source(tmp_path, "safetensors", {"w": torch.ones(2, 2, dtype=torch.int8)})
    view = plan_conversion(src, to="cs-h5")
    assert not view["ok"]
    assert view["errors"][0]["code"] == "unsupported_dtype"


def test_a_shard_size_for_a_one_file_target_names_the_target_not_the_staging_copy(tmp_path: Path) -> None:
    src = write_source(tmp_path, "safetensors")
    with pytest.raises(InvalidRequest) as e:
        convert(src, str(tmp_path / "out.safetensors"), to="safetensors", shard_size="1KB")
    assert "out.safetensors" in str(e.value)
    assert STAGING_DIR not in str(e.value)
    assert not (tmp_path / "out.safetensors").exists()


def test_s3_to_s3_and_back(tmp_path: Path, s3_bucket: str) -> None:
    src_local = write_source(tmp_path, "safetensors")
    src = f"s3://{s3_bucket}/in/model"
    r1 = convert(src_local, src, to="safetensors", shard_size="2KB")
    assert r1.verify["ok"]
    mdl = f"s3://{s3_bucket}/out/model.mdl"
    r2 = convert(src, mdl, to="cs-h5")
    assert r2.verify["ok"]
    back = str(tmp_path / "back")
    convert(mdl, back, to="torch")
    assert_same(read_all(src_local), read_all(back))
    storage = open_storage(src)
    keys = [i.uri for i in storage.list(f"s3://{s3_bucket}/")]
    assert not [k for k in keys if STAGING_DIR in k], keys


def test_concurrent_conversions_do_not_share_staging(tmp_path: Path) -> None:
    # Jobs share `.ckptconv-staging/` and each removes it once empty; several rounds make the
    # window between one job creating it and another removing it likely to be hit.
    src = write_source(tmp_path, "safetensors")
    for rnd in range(4):
        errors: list[BaseException] = []

        def run(i: int, rnd: int = rnd, errors: list[BaseException] = errors) -> None:
            try:
                convert(src, str(tmp_path / f"out{rnd}-{i}.mdl"), to="cs-h5")
            except BaseException as e:  # collected for the assertion below
                errors.append(e)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
    for rnd in range(4):
        for i in range(4):
            assert_same(read_all(src), read_all(str(tmp_path / f"out{rnd}-{i}.mdl")))
    assert not (tmp_path / STAGING_DIR).exists()


def test_a_publication_killed_mid_part_copy_leaves_no_upload_once_the_job_is_taken_over(
    tmp_path: Path, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    lower_copy_threshold(s3_bucket, monkeypatch)  # the staged file is copied in three parts
    storage = open_storage(f"s3://{s3_bucket}/")
    g = torch.Generator().manual_seed(2)
    src = write_source(tmp_path, "safetensors", {"w": torch.randn(3 << 20, generator=g)})  # 12 MiB
    target = f"s3://{s3_bucket}/out/model.mdl"
    with killed_at_the_second_part(s3_bucket):
        convert(src, target, to="cs-h5", job_id="killed-copy")
    uploads = storage.client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", [])
    assert [u["Key"] for u in uploads] == ["out/model.mdl"]
    w = storage.open_writer(f"s3://{s3_bucket}/out/model.mdl.part", part_size=5 << 20)
    w.write(bytes(5 << 20) + b"x")  # an upload of another key with the same beginning
    result = convert(src, target, to="cs-h5", job_id="killed-copy")  # the job's next attempt
    assert result.verify["ok"] and storage.exists(target)
    uploads = storage.client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", [])
    assert [u["Key"] for u in uploads] == ["out/model.mdl.part"]
    w.abort()


def test_a_raw_tensor_digests_as_its_torch_tensor() -> None:
    from ckptconv.engine.execute import value_digest, value_nbytes
    from ckptconv.formats.base import RawTensor, as_torch

    for t in [*_state_dict().values(), torch.empty(0, 3, dtype=torch.bfloat16)]:
        raw = RawTensor(t.contiguous().reshape(-1).view(torch.uint8).numpy(), str(t.dtype)[6:], tuple(t.shape))
        assert value_digest(raw) == value_digest(t)
        assert value_nbytes(raw) == value_nbytes(t)
        back = as_torch(raw)
        assert back.dtype == t.dtype and torch.equal(back, t)


@pytest.mark.parametrize(("src_fmt", "dst_fmt"), [("safetensors", "cs-h5"), ("cs-h5", "safetensors")])
def test_tensors_read_as_bytes_write_the_same_files_as_torch_tensors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, src_fmt: str, dst_fmt: str
) -> None:
    src = write_source(tmp_path, src_fmt)
    name = "out.mdl" if dst_fmt == "cs-h5" else "out"
    raw = convert(src, str(tmp_path / "raw" / name), to=dst_fmt)
    # The same sink refusing raw tensors: the source reads torch tensors, as other sinks get them.
    monkeypatch.setattr(sink_class(dst_fmt), "accepts_raw", False)
    tensors = convert(src, str(tmp_path / "torch" / name), to=dst_fmt)
    assert raw.verify["ok"] and tensors.verify["ok"]
    assert raw.verify["entries_checked"] == tensors.verify["entries_checked"] == len(_state_dict())
    files = sorted(p.relative_to(tmp_path / "raw") for p in (tmp_path / "raw").rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(tmp_path / "torch") for p in (tmp_path / "torch").rglob("*") if p.is_file())
    for rel in files:
        if rel.name.endswith("manifest.json"):  # timings and paths differ
            continue
        assert (tmp_path / "raw" / rel).read_bytes() == (tmp_path / "torch" / rel).read_bytes(), rel


# Every dtype each byte-moving pair holds, each as a full tensor, a 0-d scalar and two empty tensors.
_ST_DTYPES = ["float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "bool"]
_ST_DTYPES += ["int64", "int32", "int16", "int8", "uint64", "uint32", "uint16", "uint8"]
_H5_DTYPES = ["float64", "float32", "float16", "bfloat16", "bool", "int64", "int32", "int16", "uint8"]


def _every_dtype(dtypes: list[str]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    out = {}
    for name in dtypes:
        dt = getattr(torch, name)
        x = torch.randn(6, 5, generator=g) * 60
        full = x > 0 if dt == torch.bool else x.to(dt)
        out |= {f"{name}.full": full, f"{name}.scalar": full[2, 3].clone()}
        out |= {f"{name}.empty": full[:0].clone(), f"{name}.empty_inner": torch.empty(3, 0, 2, dtype=dt)}
    return out


def _manifest_facts(path: Path, root: Path) -> dict:
    """A manifest with what differs between two runs (times, the run's directory) taken out."""
    doc = json.loads(path.read_text().replace(str(root), "ROOT"))
    return {k: v for k, v in doc.items() if k not in ("timings", "created", "job_id")}


@pytest.mark.parametrize(
    ("src_fmt", "dst_fmt", "dtypes"),
    [
        ("safetensors", "safetensors", _ST_DTYPES),
        ("safetensors", "cs-h5", _H5_DTYPES),
        ("cs-h5", "safetensors", _H5_DTYPES),
        ("cs-h5", "cs-h5", _H5_DTYPES),
        ("safetensors", "cs-s3", _H5_DTYPES),
    ],
)
def test_every_dtype_scalar_and_empty_tensor_moves_as_bytes_to_the_torch_paths_files_and_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, src_fmt: str, dst_fmt: str, dtypes: list[str]
) -> None:
    tree = _every_dtype(dtypes)
    src = write_source(tmp_path, src_fmt, tree)
    name = "out.mdl" if dst_fmt == "cs-h5" else "out"
    raw = convert(src, str(tmp_path / "raw" / name), to=dst_fmt, verify="full")
    monkeypatch.setattr(sink_class(dst_fmt), "accepts_raw", False)  # the same sink, given torch tensors
    tensors = convert(src, str(tmp_path / "torch" / name), to=dst_fmt, verify="full")
    assert raw.verify["ok"] and tensors.verify["ok"]
    assert raw.verify["entries_checked"] == tensors.verify["entries_checked"] == len(tree)
    files = sorted(p.relative_to(tmp_path / "raw") for p in (tmp_path / "raw").rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(tmp_path / "torch") for p in (tmp_path / "torch").rglob("*") if p.is_file())
    for rel in files:
        a, b = tmp_path / "raw" / rel, tmp_path / "torch" / rel
        if rel.name.endswith("manifest.json"):
            assert _manifest_facts(a, tmp_path / "raw") == _manifest_facts(b, tmp_path / "torch")
        else:
            assert a.read_bytes() == b.read_bytes(), rel
    got = read_all(str(tmp_path / "raw" / name), dst_fmt)
    assert list(got) == list(tree)
    for k, t in tree.items():  # by bytes: torch.equal has no float8 kernel
        assert got[k].dtype == t.dtype and got[k].shape == t.shape, k
        assert got[k].reshape(-1).view(torch.uint8).tolist() == t.reshape(-1).view(torch.uint8).tolist(), k


@pytest.mark.parametrize(("via", "name"), [("cs-h5", "a.mdl"), ("tf", "a/model.ckpt")])
def test_a_conversion_that_only_moves_bytes_never_imports_torch(tmp_path: Path, via: str, name: str) -> None:
    import os
    import subprocess
    import sys

    src = write_source(tmp_path, "safetensors")
    root = Path(__file__).resolve().parent.parent
    script = (
        "import sys\n"
        "from ckptconv.engine.convert import convert\n"
        "a = convert(sys.argv[1], sys.argv[2], to=sys.argv[4])\n"
        "b = convert(sys.argv[2], sys.argv[3], to='safetensors')\n"
        "assert a.verify['ok'] and b.verify['ok'], (a.verify, b.verify)\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, src, str(tmp_path / name), str(tmp_path / "b"), via],
        capture_output=True,
        text=True,
        check=True,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert out.stdout.strip() == "False", out.stderr
    # By key: a TensorFlow index lists its tensors sorted, not in the source's order.
    assert_same(dict(sorted(read_all(src).items())), dict(sorted(read_all(str(tmp_path / "b"), "safetensors").items())))


def _target(where: str, tmp_path: Path, s3_bucket: str) -> str:
    return str(tmp_path / "out" / "model") if where == "local" else f"s3://{s3_bucket}/out/model"


def _under(uri: str) -> list[str]:
    return sorted(i.uri for i in open_storage(uri).list(uri + "/"))


def _kill_a_sharded_publication(where: str, tmp_path: Path, s3_bucket: str, job_id: str) -> tuple[str, str, list]:
    """Convert to a sharded safetensors target, killed once the first shard is placed; returns the
    source, the target and the final files the staged manifest names."""
    src = write_source(tmp_path, "safetensors")
    target = _target(where, tmp_path, s3_bucket)
    with killed_after_the_first_file(target):
        convert(src, target, to="safetensors", shard_size="1KB", job_id=job_id)
    placed = _under(target)
    assert len(placed) == 1, placed  # one shard, no manifest
    return src, target, placed


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_job_ending_after_its_publication_was_killed_leaves_nothing_at_the_target(
    where: str, tmp_path: Path, s3_bucket: str
) -> None:
    _, target, _ = _kill_a_sharded_publication(where, tmp_path, s3_bucket, "killed-job")
    engine.discard_staging(target, "killed-job")  # what the job's cleanup does as it ends unpublished
    assert _under(target) == []
    assert _under(target.rsplit("/", 1)[0] + "/" + STAGING_DIR) == []


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_job_ending_unpublished_keeps_what_another_writer_put_at_its_final_names(
    where: str, tmp_path: Path, s3_bucket: str
) -> None:
    _, target, placed = _kill_a_sharded_publication(where, tmp_path, s3_bucket, "killed-job")
    storage = open_storage(target)
    staging = storage.join(target.rsplit("/", 1)[0], STAGING_DIR, "killed-job", "0")
    manifest = json.loads(storage.read_all(storage.join(staging, "model", "manifest.json")))
    second = next(f for f in manifest["files"] if f["uri"] not in placed)
    staged = storage.join(staging, second["path"])
    # Another writer's file at a final name the job had not reached, even with the same bytes.
    storage.write_bytes(second["uri"], storage.read_all(staged))
    # And one that replaced the shard the job placed.
    storage.delete(placed[0])
    storage.write_bytes(placed[0], b"someone else's bytes")
    engine.discard_staging(target, "killed-job")
    assert _under(target) == sorted([placed[0], second["uri"]])
    assert storage.read_all(placed[0]) == b"someone else's bytes"


def test_a_job_ending_unpublished_keeps_an_object_replaced_between_its_check_and_its_delete(
    tmp_path: Path, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The cleanup proves the shard at the final key is the job's (its metadata names the job), then
    # deletes it. Another writer replaces it in between: its bytes must stay (the delete is
    # conditional on the object that was checked).
    _, target, placed = _kill_a_sharded_publication("s3", tmp_path, s3_bucket, "killed-job")
    storage = open_storage(target)
    bucket, key = placed[0].removeprefix("s3://").split("/", 1)
    client_class = type(storage.client)
    delete_object = client_class.delete_object
    replaced: list[str] = []

    def replaced_first(self, **kwargs):
        if kwargs.get("Key") == key and not replaced:
            replaced.append(key)
            self.put_object(Bucket=bucket, Key=key, Body=b"someone else's bytes")
        return delete_object(self, **kwargs)

    monkeypatch.setattr(client_class, "delete_object", replaced_first)
    engine.discard_staging(target, "killed-job")
    assert replaced == [key]
    assert storage.read_all(placed[0]) == b"someone else's bytes"
    assert _under(target) == [placed[0]]


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_failed_publication_removes_only_the_files_it_placed_that_are_still_its_own(
    where: str, tmp_path: Path, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A publication fails at its second shard; meanwhile another writer replaced the first shard it
    # placed. Undoing the publication removes what it placed, but not those other bytes.
    src = write_source(tmp_path, "safetensors")
    target = _target(where, tmp_path, s3_bucket)
    storage = open_storage(target)
    storage_class = type(storage)
    publish = storage_class.publish
    placed: list[str] = []

    def failing(self, pairs, **kwargs) -> None:
        pairs = list(pairs)
        if placed:
            storage.delete(placed[0])
            storage.write_bytes(placed[0], b"someone else's bytes")
            raise StorageUnavailable("the store went away", uri=pairs[0][1])
        publish(self, pairs, **kwargs)
        placed.append(pairs[0][1])

    monkeypatch.setattr(storage_class, "publish", failing)
    with pytest.raises(StorageUnavailable):
        convert(src, target, to="safetensors", shard_size="1KB", job_id="failing-job")
    assert _under(target) == placed
    assert storage.read_all(placed[0]) == b"someone else's bytes"


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_takeover_resumes_a_killed_publication_and_publishes_everything(
    where: str, tmp_path: Path, s3_bucket: str
) -> None:
    src, target, _ = _kill_a_sharded_publication(where, tmp_path, s3_bucket, "killed-job")
    result = convert(src, target, to="safetensors", shard_size="1KB", job_id="killed-job")
    assert result.verify["ok"] and result.job_id == "killed-job"
    assert_same(read_all(src), read_all(target))
    assert sorted([*(o.uri for o in result.outputs), result.manifest]) == _under(target)
    engine.discard_staging(target, "killed-job")  # a late cleanup: the published output stays
    assert_same(read_all(src), read_all(target))


@pytest.mark.parametrize("to", ["safetensors", "cs-h5"])
def test_a_jobs_s3_outputs_name_it_from_staging_on_so_publication_copies_them_as_they_are(
    to: str, tmp_path: Path, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptconv.core.fencing import Attempt, attempt_scope
    from ckptconv.storage.base import OWNER_METADATA

    src = write_source(tmp_path, "safetensors")
    target = f"s3://{s3_bucket}/out/model" + (".mdl" if to == "cs-h5" else "")
    storage = open_storage(target)
    copies: list[dict] = []
    copy_object = storage.client.copy_object
    monkeypatch.setattr(storage.client, "copy_object", lambda **k: copies.append(k) or copy_object(**k))
    with attempt_scope(Attempt("job-7", 1, lambda: None)):
        result = convert(src, target, to=to, shard_size="1KB", job_id="job-7")
    published = [*(o.uri for o in result.outputs), result.manifest]
    assert len(copies) == len(published) > 1
    # Each staged object named the job when it was written: no copy replaces the metadata (which
    # makes some servers stream the object again), each is pinned to the object publication checked.
    assert all("MetadataDirective" not in k and k["CopySourceIfMatch"] for k in copies)
    assert {storage.user_metadata(uri).get(OWNER_METADATA) for uri in published} == {"job-7"}
