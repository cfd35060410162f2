"""Reading ahead on several threads: values in order, within the byte budget, errors where they happened."""

from __future__ import annotations

import threading

import pytest
import torch
from safetensors.torch import save_file

from ckptconv.engine.prefetch import Prefetcher
from ckptconv.formats.safetensors_fmt import SafetensorsSource
from ckptconv.storage import open_storage

KiB = 1 << 10


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
