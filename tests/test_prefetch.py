"""Reading ahead on several threads: values in order, within the byte budget, errors where they happened."""

from __future__ import annotations

import threading
import time
import weakref

import pytest
import torch
from safetensors.torch import save, save_file

from ckptconv.core.errors import CorruptCheckpoint
from ckptconv.engine.prefetch import Prefetcher
from ckptconv.formats.detect import open_source
from ckptconv.formats.safetensors_fmt import SafetensorsSource
from ckptconv.storage import open_storage
from ckptconv.storage.s3 import S3Storage

KiB = 1 << 10
MiB = 1 << 20


@pytest.fixture
def source(tmp_path):
    g = torch.Generator().manual_seed(3)
    tensors = {f"w{i:02d}": torch.randn(16 * KiB, generator=g) for i in range(20)}  # 64 KiB each
    tensors["big"] = torch.randn(64 * KiB, generator=g)  # 256 KiB
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    with SafetensorsSource(open_storage(str(path)), str(path)) as src:
        yield src, tensors


def consume(fetcher: Prefetcher, keys: list[str], tensors: dict[str, torch.Tensor]) -> None:
    """Take every value in order (checking it), releasing each before asking for the next; then stop."""
    try:
        for key in keys:
            assert torch.equal(fetcher.get(key), tensors[key])
            fetcher.release(key)
    finally:
        fetcher.stop()


def test_values_come_in_order_and_the_claimed_bytes_stay_within_the_budget(source):
    src, tensors = source
    keys = [f"w{i:02d}" for i in range(20)]
    sizes = {e.key: e.nbytes for e in src.entries()}
    budget = 4 * 64 * KiB
    fetcher = Prefetcher(src, keys, sizes, budget, workers=4)
    consume(fetcher, keys, tensors)
    assert fetcher.peak_outstanding <= budget
    assert fetcher.peak_outstanding > 64 * KiB  # more than one value was read ahead


def test_a_value_larger_than_the_budget_is_read_alone(source):
    src, tensors = source
    keys = ["w00", "big", "w01"]
    sizes = {e.key: e.nbytes for e in src.entries()}
    seen = []
    fetcher = Prefetcher(src, keys, sizes, 64 * KiB, workers=3, on_read=lambda k, v: seen.append(k))
    consume(fetcher, keys, tensors)
    assert fetcher.peak_outstanding == 256 * KiB and seen == keys


def test_a_consumer_holding_several_values_still_gets_the_one_it_waits_for(source):
    src, tensors = source
    keys = [f"w{i:02d}" for i in range(6)]
    sizes = {e.key: e.nbytes for e in src.entries()}
    fetcher = Prefetcher(src, keys, sizes, 2 * 64 * KiB, workers=2)
    try:
        held = [fetcher.get(k) for k in keys]  # a step with six inputs: over the budget, no deadlock
    finally:
        fetcher.stop()
    assert all(torch.equal(v, tensors[k]) for k, v in zip(keys, held, strict=True))


def test_a_failed_read_is_raised_for_its_own_key_and_stop_returns(source):
    src, tensors = source
    keys = ["w00", "missing", "w01", "w02"]
    sizes = {e.key: e.nbytes for e in src.entries()}
    fetcher = Prefetcher(src, keys, sizes, 10 * 64 * KiB, workers=3)
    try:
        assert torch.equal(fetcher.get("w00"), tensors["w00"])
        with pytest.raises(KeyError, match="missing"):
            fetcher.get("missing")
    finally:
        fetcher.stop()


def test_a_thread_that_cannot_start_leaves_no_reader_running(source, monkeypatch):
    # A machine out of threads: the second reader cannot start. The caller never gets the
    # Prefetcher (so could never stop it): the first reader must be stopped before the error.
    src, _ = source
    sizes = {e.key: e.nbytes for e in src.entries()}
    start = threading.Thread.start
    started: list[threading.Thread] = []

    def second_fails(self):
        if self.name.startswith("ckptconv-prefetch") and started:
            raise RuntimeError("can't start new thread")
        start(self)
        started.append(self)

    monkeypatch.setattr(threading.Thread, "start", second_fails)
    with pytest.raises(RuntimeError, match="can't start"):
        Prefetcher(src, [f"w{i:02d}" for i in range(20)], sizes, 64 * KiB, workers=3)
    assert len(started) == 1
    assert not started[0].is_alive()


def test_a_reader_waiting_for_the_budget_holds_no_value_it_handed_over(source):
    """The pool lends a value's memory again once the value is gone: a reader thread that kept
    its last value while it waited would keep the memory of a value the consumer let go."""
    src, _ = source
    keys = [f"w{i:02d}" for i in range(4)]
    sizes = {e.key: e.nbytes for e in src.entries()}
    fetcher = Prefetcher(src, keys, sizes, 64 * KiB, workers=2, on_read=lambda k, v: None)
    try:
        value = fetcher.get("w00")  # not released: the readers wait for the budget
        gone = weakref.ref(value)
        del value
        deadline = time.monotonic() + 5
        while gone() is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert gone() is None
    finally:
        fetcher.stop()


def test_neighbours_read_together_stay_within_the_budget(s3_bucket, s3_server, monkeypatch):
    """Over S3 a reader claims the values that follow its next one in the file with it, as long as
    the budget allows each: never more bytes than the budget outstanding."""
    monkeypatch.setenv("CKPTCONV_S3_READ_PART_SIZE", "5MiB")
    g = torch.Generator().manual_seed(6)
    tensors = {f"w{i:02d}": torch.randn(512, 512, generator=g) for i in range(10)}  # 1 MiB each
    uri = f"s3://{s3_bucket}/ahead/model.safetensors"
    S3Storage(s3_server).write_bytes(uri, save(tensors))
    with open_source(uri, "safetensors") as src:
        sizes = {e.key: e.nbytes for e in src.entries()}
        assert src.extent("w01").offset == src.extent("w00").offset + MiB
        groups: list[list[str]] = []
        read_neighbours = src.read_neighbours
        monkeypatch.setattr(src, "read_neighbours", lambda keys: groups.append(keys) or read_neighbours(keys))
        fetcher = Prefetcher(src, sorted(tensors), sizes, 3 * MiB, workers=1)
        consume(fetcher, sorted(tensors), tensors)
    assert fetcher.peak_outstanding == 3 * MiB
    assert groups[0] == ["w00", "w01", "w02"] and all(len(group) <= 3 for group in groups)


def test_a_failed_read_of_neighbours_fails_for_the_value_it_is_about(s3_bucket, s3_server, monkeypatch):
    """The object turns out shorter than its header says, inside its fourth value: the three before
    it are handed over, and the error is the fourth's own, as without joined reads."""
    monkeypatch.setenv("CKPTCONV_S3_READ_PART_SIZE", "5MiB")
    g = torch.Generator().manual_seed(7)
    tensors = {f"w{i:02d}": torch.randn(512, 512, generator=g) for i in range(6)}  # 1 MiB each
    blob = save(tensors)
    data_start = 8 + int.from_bytes(blob[:8], "little")
    uri = f"s3://{s3_bucket}/short/model.safetensors"
    storage = S3Storage(s3_server)
    storage.write_bytes(uri, blob)
    keys = sorted(tensors)
    # Opened on the storage itself, not through open_source's view of the versions it read first,
    # which would refuse the shortened object as another version before any short read.
    with SafetensorsSource(storage, uri) as src:
        sizes = {e.key: e.nbytes for e in src.entries()}
        storage.delete(uri)
        storage.write_bytes(uri, blob[: data_start + 3 * MiB + MiB // 2])
        fetcher = Prefetcher(src, keys, sizes, 8 * MiB, workers=1)
        try:
            for key in keys[:3]:
                assert torch.equal(fetcher.get(key), tensors[key])
                fetcher.release(key)
            with pytest.raises(CorruptCheckpoint, match=f"wanted {MiB} bytes at offset {data_start + 3 * MiB}"):
                fetcher.get("w03")
        finally:
            fetcher.stop()
