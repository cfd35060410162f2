"""A local target on a filesystem that fills up: a typed ``storage_error``, nothing left behind, and
the process alive (HDF5 crashed it once a write of its own had failed).

Each conversion runs in a child process, so that a crash fails the test instead of ending pytest.
The filesystems are small tmpfs mounts: the tests skip where mounting is not permitted.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

ROOT = Path(__file__).resolve().parent.parent

# A child that converts, reports how it ended, then collects garbage (where h5py crashed) and lists
# what the conversion left on the small filesystem.
CHILD = textwrap.dedent(
    """
    import gc, json, os, sys
    from ckptconv.core.errors import CkptconvError
    from ckptconv.engine.convert import convert

    source, target, fmt, mount, hook = sys.argv[1:6]
    options = json.loads(sys.argv[6]) if len(sys.argv) > 6 else {}  # more of convert()'s options
    fmt, _, compression = fmt.partition("+")  # cs-h5+lz4: the LZ4-chunked layout

    def fill():
        fd = os.open(os.path.join(mount, "filler"), os.O_WRONLY | os.O_CREAT)
        try:
            while True:
                os.write(fd, b"\\0" * (4 << 10))
        except OSError:
            pass
        finally:
            os.close(fd)

    if hook == "fill-after-reserve":
        # Another writer takes the rest of the disk once the sink has begun.
        from ckptconv.formats import cs_h5_write

        reserve = cs_h5_write.CsH5Sink._reserve_space

        def reserve_then_fill(self):
            reserve(self)
            fill()

        cs_h5_write.CsH5Sink._reserve_space = reserve_then_fill
    if hook == "no-fallocate":
        # A filesystem without fallocate (some FUSE mounts): every reservation answers EOPNOTSUPP.
        # The disk fills up once HDF5 has laid out the file, before the values are placed.
        import ctypes, errno
        from ckptconv.formats import cs_h5_write
        from ckptconv.storage import local

        def unsupported(fd, mode, offset, nbytes):
            ctypes.set_errno(errno.EOPNOTSUPP)
            return -1

        local._fallocate = unsupported
        allocate = cs_h5_write.CsH5Sink._allocate

        def allocate_then_fill(self):
            regions = allocate(self)
            fill()
            return regions

        cs_h5_write.CsH5Sink._allocate = allocate_then_fill
    if hook == "fill-after-check":
        # The free-space check passes, then another writer takes the rest of the disk: the
        # writes fail part-way through the output.
        from ckptconv.formats import base

        check = base.check_free_space

        def check_then_fill(*args, **kwargs):
            check(*args, **kwargs)
            fill()

        base.check_free_space = check_then_fill
    try:
        convert(source, target, to=fmt, h5_compression=compression or "none", **options)
        outcome = {"code": "ok"}
    except CkptconvError as e:
        outcome = {"code": e.code, "message": e.message, "hint": e.hint, "errno": e.details.get("errno")}
    except BaseException as e:
        outcome = {"code": "untyped " + type(e).__name__, "message": str(e)[:300]}
    gc.collect()
    left = sorted(os.path.relpath(os.path.join(d, n), mount) for d, _, names in os.walk(mount) for n in names)
    print(json.dumps({**outcome, "left": left}))
    """
)


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    """``mount(size)``: a fresh tmpfs of that size ("8m"), unmounted at teardown."""
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        if os.name != "posix" or os.geteuid() != 0:
            pytest.skip("mounting a small tmpfs needs root")
        where = tmp_path / f"small-{uuid.uuid4().hex[:6]}"
        where.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode(errors='replace').strip()}")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 MiB of incompressible 1 MiB tensors (h5py's own LZ4 datasets in the LZ4 layout)."""
    path = tmp_path_factory.mktemp("disk-full") / "in.safetensors"
    rng = np.random.default_rng(0)
    save_file({f"w{i:02d}": np.frombuffer(rng.bytes(1 << 20), dtype=np.float32) for i in range(40)}, str(path))
    return path


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "CKPTCONV_TRACEBACK": "1"}


def _convert_in_child(source: Path, target: Path, fmt: str, mount: Path, hook: str = "none", **options: object) -> dict:
    r = subprocess.run(
        [sys.executable, "-c", CHILD, str(source), str(target), fmt, str(mount), hook, json.dumps(options)],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
    )
    assert r.returncode == 0, f"child ended with {r.returncode}: {r.stderr[-2000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("fmt", ["cs-h5", "cs-h5+lz4", "safetensors", "torch", "tf"])
def test_full_disk_is_a_typed_error_and_leaves_nothing(small_fs: Callable[[str], Path], source: Path, fmt: str) -> None:
    mount = small_fs("8m")
    out = _convert_in_child(source, mount / "out", fmt, mount)
    assert out["code"] == "storage_error", out
    assert "free disk space" in out["hint"], out
    assert out["left"] == [], out


@pytest.mark.parametrize(
    ("fmt", "options"),
    [("safetensors", {"shard_size": "4MB"}), ("torch", {}), ("tf", {}), ("tf", {"shard_size": "4MB"})],
)
def test_an_output_that_cannot_fit_is_refused_before_its_first_byte(
    small_fs: Callable[[str], Path], source: Path, fmt: str, options: dict
) -> None:
    """Every local output's planned size is checked against the free space up front: a full disk
    met halfway (a later shard, an archive without a preallocated size) says "No space left on
    device"; the check says how much the output needs."""
    mount = small_fs("8m")
    out = _convert_in_child(source, mount / "out", fmt, mount, **options)
    assert out["code"] == "storage_error", out
    assert "not enough free space" in out["message"] and "free disk space" in out["hint"], out
    assert out["errno"] == errno.ENOSPC and out["left"] == [], out


@pytest.mark.parametrize("fmt", ["safetensors", "torch", "tf"])
def test_a_disk_filled_by_another_writer_after_the_check_is_a_typed_error(
    small_fs: Callable[[str], Path], source: Path, fmt: str
) -> None:
    """Room for the output when the sink checks, none once it writes: the first failed write
    ends the conversion with storage_error, and only the other writer's file is left."""
    mount = small_fs("64m")
    out = _convert_in_child(source, mount / "out", fmt, mount, hook="fill-after-check")
    assert out["code"] == "storage_error", out
    assert "free disk space" in out["hint"], out
    assert out["left"] == ["filler"], out


def test_cs_h5_cli_on_a_full_disk_exits_with_storage_error(small_fs: Callable[[str], Path], source: Path) -> None:
    mount = small_fs("8m")
    r = subprocess.run(
        [sys.executable, "-m", "ckptconv", "convert", str(source), str(mount / "out.mdl"), "--to", "cs-h5"],
        capture_output=True,
        text=True,
        env={**_env(), "CKPTCONV_TRACEBACK": "0"},
        timeout=120,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert "[storage_error]" in r.stderr and "not enough free space" in r.stderr, r.stderr[-2000:]
    assert [p for p in mount.rglob("*") if p.is_file()] == []


@pytest.mark.parametrize("fmt", ["cs-h5", "cs-h5+lz4"])
def test_cs_h5_disk_filled_by_another_writer_meanwhile(small_fs: Callable[[str], Path], source: Path, fmt: str) -> None:
    """The space check passes, then the disk fills up: HDF5 still writes only into blocks the sink
    reserved, so the conversion completes (with the space check alone the child crashed)."""
    mount = small_fs("48m")
    out = _convert_in_child(source, mount / "out.mdl", fmt, mount, hook="fill-after-reserve")
    if out["code"] == "ok":
        assert {"filler", "out.mdl"} <= set(out["left"]), out
    else:
        # Only writers other than HDF5 can still fail (the manifest beside the target), typed.
        assert out["code"] == "storage_error", out
        assert out["left"] == ["filler"], out


def test_a_contiguous_output_needs_no_room_for_lz4_frames(small_fs: Callable[[str], Path], source: Path) -> None:
    """40 MiB of data and HDF5's metadata fit in 42 MiB uncompressed; the LZ4 layout's bound (its
    frames and chunk indexes, another 0.8 MiB) does not, and is refused before HDF5 writes."""
    mount = small_fs("42m")
    out = _convert_in_child(source, mount / "out.mdl", "cs-h5", mount)
    assert out["code"] == "ok" and "out.mdl" in out["left"], out
    (mount / "out.mdl").unlink()
    (mount / "out.mdl.manifest.json").unlink()
    out = _convert_in_child(source, mount / "lz4.mdl", "cs-h5+lz4", mount)
    assert out["code"] == "storage_error" and out["left"] == [], out


def test_cs_h5_disk_filled_meanwhile_without_fallocate(small_fs: Callable[[str], Path], source: Path) -> None:
    """No reservation stands (the filesystem has no fallocate) and the disk fills up after the space
    check: the positioned writes of the values meet the full disk, a typed error, nothing left."""
    mount = small_fs("48m")
    out = _convert_in_child(source, mount / "out.mdl", "cs-h5", mount, hook="no-fallocate")
    assert out["code"] == "storage_error", out
    assert "free disk space" in out["hint"], out
    assert out["left"] == ["filler"], out
