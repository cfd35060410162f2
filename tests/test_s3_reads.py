"""Reading over S3 in few, parallel requests, within a memory budget (moto behind the recording
proxy of bench/faultproxy.py; never a throughput measurement: see bench/s3_bench.py)."""

from __future__ import annotations

import itertools
import json
import os
import socket
from urllib.parse import urlsplit

import pytest
import torch
from safetensors.torch import load, save

from bench.faultproxy import FaultProxy
from ckptconv.core.errors import CorruptCheckpoint, InvalidRequest
from ckptconv.engine.convert import convert, plan_conversion
from ckptconv.formats.detect import open_source
from ckptconv.storage.s3 import S3Storage

MiB = 1 << 20


@pytest.fixture
def recorded(s3_server, monkeypatch):
    """A proxy without faults that records every request's method, path and Range."""
    proxy = FaultProxy(s3_server)
    proxy.start()
    seen: list[tuple[str, str]] = []
    proxy.on_request = lambda method, path, headers: seen.append((method, headers.get("range", "")))
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    yield proxy, seen
    proxy.stop()


def test_a_long_range_is_read_as_parallel_parts(s3_bucket, recorded, monkeypatch):
    proxy, seen = recorded
    monkeypatch.setenv("CKPTCONV_S3_READ_PART_SIZE", "5MiB")
    monkeypatch.setenv("CKPTCONV_S3_READ_CONCURRENCY", "4")
    data = os.urandom(30 * MiB)
    S3Storage(proxy.url).write_bytes(f"s3://{s3_bucket}/blob", data)
    storage = S3Storage(proxy.url)
    assert (storage.read_concurrency, storage.read_part_size) == (4, 5 * MiB)
    seen.clear()
    buf = bytearray(23 * MiB + 7)
    storage.read_into(f"s3://{s3_bucket}/blob", 12345, buf)
    assert buf == data[12345 : 12345 + len(buf)]
    ranges = sorted(int(r.removeprefix("bytes=").split("-")[0]) for m, r in seen if m == "GET")
    assert ranges == [12345 + i * 5 * MiB for i in range(5)]


def test_ranged_reads_into_the_buffer_keep_their_connections(s3_bucket, s3_server, monkeypatch):
    """Parts read straight from the socket into the buffer hand their connection back to the pool."""
    monkeypatch.setenv("CKPTCONV_S3_READ_PART_SIZE", "5MiB")
    monkeypatch.setenv("CKPTCONV_S3_READ_CONCURRENCY", "1")
    data = os.urandom(30 * MiB)
    S3Storage(s3_server).write_bytes(f"s3://{s3_bucket}/blob", data)
    with FaultProxy(s3_server, keep_alive=True) as proxy:
        storage = S3Storage(proxy.url)
        for offset in range(0, len(data), 3 * MiB):
            buf = bytearray(min(3 * MiB, len(data) - offset))
            storage.read_into(f"s3://{s3_bucket}/blob", offset, buf)
            assert buf == data[offset : offset + len(buf)]
        assert storage.read_range(f"s3://{s3_bucket}/blob", 7, 20 * MiB) == data[7 : 7 + 20 * MiB]
        assert proxy.requests == 11
        assert proxy.connections == 1


def _recv_calls_from(port: int, monkeypatch) -> list[int]:
    """The sizes of the reads from sockets connected to ``port`` (the client's side), from now on."""
    sizes: list[int] = []
    real = socket.socket.recv_into

    def counted(sock, buffer, *args, **kwargs):
        n = real(sock, buffer, *args, **kwargs)
        if sock.getpeername()[1] == port:
            sizes.append(n)
        return n

    monkeypatch.setattr(socket.socket, "recv_into", counted)
    return sizes


def test_a_body_that_arrives_a_little_at_a_time_is_taken_from_the_socket_in_large_reads(
    s3_bucket, s3_server, monkeypatch
):
    """A reading thread wakes once a slice of the body waits in the socket, not at every packet:
    each wake-up costs a system call, a thread switch and the GIL."""
    data = os.urandom(16 * MiB)
    S3Storage(s3_server).write_bytes(f"s3://{s3_bucket}/blob", data)
    piece = 64 << 10
    with FaultProxy(s3_server, keep_alive=True, piece_bytes=piece, piece_pause_s=0.001) as proxy:
        storage = S3Storage(proxy.url)
        reads = _recv_calls_from(urlsplit(proxy.url).port, monkeypatch)
        buf = bytearray(len(data))
        storage.read_into(f"s3://{s3_bucket}/blob", 0, buf)
    assert buf == data
    # One read per MiB of the body, the headers' and the last MiB's (whose pieces are taken as
    # they come: a read that waited for more than the body still holds would never end) aside.
    assert len(reads) <= len(data) // MiB + MiB // piece + 4, reads


def test_a_connection_is_handed_back_ready_for_a_small_answer(s3_bucket, s3_server, monkeypatch):
    """A connection that read a body in large reads goes back to the pool waking at its first byte
    again: the next answer on it (headers, a small body) arrives without waiting for more."""
    monkeypatch.setenv("CKPTCONV_S3_READ_TIMEOUT_S", "5")
    monkeypatch.setenv("CKPTCONV_S3_READ_CONCURRENCY", "1")
    data = os.urandom(8 * MiB)
    S3Storage(s3_server).write_bytes(f"s3://{s3_bucket}/blob", data)
    with FaultProxy(s3_server, keep_alive=True) as proxy:
        storage = S3Storage(proxy.url, max_attempts=1)
        buf = bytearray(len(data))
        storage.read_into(f"s3://{s3_bucket}/blob", 0, buf)
        assert buf == data
        assert storage.read_range(f"s3://{s3_bucket}/blob", 5, 10) == data[5:15]
        assert storage.stat(f"s3://{s3_bucket}/blob").size == len(data)
        assert proxy.connections == 1


def test_a_range_past_the_end_of_an_object_is_a_short_read_at_once(s3_bucket, s3_server, monkeypatch):
    """A body shorter than the range asked for (a truncated object) ends where its length says:
    no read waits for bytes beyond it."""
    monkeypatch.setenv("CKPTCONV_S3_READ_TIMEOUT_S", "5")
    data = os.urandom(3 * MiB + 5)
    S3Storage(s3_server).write_bytes(f"s3://{s3_bucket}/blob", data)
    with FaultProxy(s3_server, keep_alive=True) as proxy:
        buf = bytearray(8 * MiB)
        with pytest.raises(CorruptCheckpoint, match="ends early") as raised:
            S3Storage(proxy.url, max_attempts=1).read_into(f"s3://{s3_bucket}/blob", 0, buf)
    assert raised.value.details["got"] == len(data)
    assert buf[: len(data)] == data


def test_values_are_read_in_parallel_with_at_most_the_read_concurrency_in_flight(
    s3_bucket, s3_server, monkeypatch, tmp_path
):
    g = torch.Generator().manual_seed(2)
    # 6 MiB each: no two are read together (neighbours are, below two 5 MiB parts).
    tensors = {f"w{i:02d}": torch.randn(1536, 1024, generator=g) for i in range(8)}
    uri = f"s3://{s3_bucket}/par/model.safetensors"
    S3Storage(s3_server).write_bytes(uri, save(tensors))
    monkeypatch.setenv("CKPTCONV_S3_READ_CONCURRENCY", "3")
    monkeypatch.setenv("CKPTCONV_S3_READ_PART_SIZE", "5MiB")
    # Every request held 50 ms: GETs sent together are seen in flight together.
    with FaultProxy(s3_server, delay_s=0.05) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        # A budget that lets many values be read ahead: the concurrency is what bounds them.
        result = convert(uri, str(tmp_path / "out.safetensors"), to="safetensors", memory_budget="420MiB")
        assert result.verify["ok"]
        assert 2 <= proxy.peak_in_flight <= 3
    with open_source(str(tmp_path / "out.safetensors"), "safetensors") as out:
        assert all(torch.equal(out.read(k), t) for k, t in tensors.items())


def _data_gets(seen: list[tuple[str, str]], start: int) -> list[tuple[int, int]]:
    """(offset, length) of the ranged GETs at or past ``start`` (a safetensors file's data)."""
    spans = []
    for method, r in seen:
        if method == "GET" and r:
            first, last = (int(x) for x in r.removeprefix("bytes=").split("-"))
            if first >= start:
                spans.append((first - start, last - first + 1))
    return sorted(spans)


def test_neighbouring_values_are_read_with_one_get_below_two_parts(s3_bucket, recorded, monkeypatch, tmp_path):
    proxy, seen = recorded
    monkeypatch.setenv("CKPTCONV_S3_READ_PART_SIZE", "5MiB")
    g = torch.Generator().manual_seed(5)
    tensors = {f"w{i:02d}": torch.randn(512, 512, generator=g) for i in range(12)}  # 1 MiB each
    tensors["norm"] = torch.randn(7, generator=g)  # 28 bytes, first in the file (by name)
    blob = save(tensors)
    uri = f"s3://{s3_bucket}/join/model.safetensors"
    S3Storage(proxy.url).write_bytes(uri, blob)
    data_start = 8 + int.from_bytes(blob[:8], "little")
    seen.clear()
    result = convert(uri, str(tmp_path / "out.safetensors"), to="safetensors", memory_budget="400MiB")
    assert result.verify["ok"]
    with open_source(str(tmp_path / "out.safetensors"), "safetensors") as out:
        assert all(torch.equal(out.read(k), t) for k, t in tensors.items())
    # In file order, as long as they stay below 10 MiB together: the norm and nine values, then three.
    assert _data_gets(seen, data_start) == [(0, 9 * MiB + 28), (9 * MiB + 28, 3 * MiB)]


def test_a_read_of_neighbours_survives_resets_inside_any_of_them(s3_bucket, s3_server, monkeypatch):
    monkeypatch.setenv("CKPTCONV_STORAGE_BACKOFF_S", "0.01")
    uri = f"s3://{s3_bucket}/blob"
    data = os.urandom(3 * MiB)
    S3Storage(s3_server).write_bytes(uri, data)
    lengths = [3, MiB // 2 + 5, 1, MiB, 0, MiB // 2 - 100, 17]
    with FaultProxy(s3_server, rate=0.3, faults=("reset", "error", "nolength"), seed=7) as proxy:
        storage = S3Storage(proxy.url, max_attempts=30)
        assert storage.coalesce_bytes == 32 * MiB
        for offset in (0, 11, MiB):
            bufs = [memoryview(bytearray(n)) for n in lengths]
            storage.read_scattered(uri, offset, bufs)
            assert b"".join(bytes(b) for b in bufs) == data[offset : offset + sum(lengths)]
        assert sum(proxy.counts.values()) >= 1
        with pytest.raises(CorruptCheckpoint, match="ends"):
            storage.read_scattered(uri, 2 * MiB, [memoryview(bytearray(MiB)), memoryview(bytearray(10))])


def test_parallel_parts_survive_resets(s3_bucket, s3_server, monkeypatch):
    monkeypatch.setenv("CKPTCONV_S3_READ_PART_SIZE", "5MiB")
    data = os.urandom(40 * MiB)
    S3Storage(s3_server).write_bytes(f"s3://{s3_bucket}/blob", data)
    with FaultProxy(s3_server, rate=0.3, faults=("reset", "error", "nolength"), seed=4) as proxy:
        got = S3Storage(proxy.url, max_attempts=20).read_range(f"s3://{s3_bucket}/blob", 3, 40 * MiB - 3)
        assert got == data[3:]
        assert sum(proxy.counts.values()) >= 1


def test_a_read_resumed_after_a_reset_refuses_an_object_replaced_meanwhile(s3_bucket, s3_server):
    # The first GET breaks mid-body; before the retry the object is replaced. The retry asks for
    # the rest of the object the first answer came from (If-Match): never bytes of two objects.
    uri = f"s3://{s3_bucket}/blob"
    old, new = os.urandom(6 * MiB), os.urandom(6 * MiB)
    direct = S3Storage(s3_server)
    direct.write_bytes(uri, old)
    gets = []
    with FaultProxy(s3_server, rate=1.0, faults=("reset",)) as proxy:

        def arrived(method: str, path: str, headers: dict[str, str]) -> None:
            if method == "GET" and "range" in headers:
                gets.append(headers)
                if len(gets) == 2:  # the retry: from now on no faults, and the object is another one
                    proxy.rate = 0.0
                    direct.delete(uri)
                    direct.write_bytes(uri, new)

        proxy.on_request = arrived
        with pytest.raises(CorruptCheckpoint, match="replaced while it was being read"):
            S3Storage(proxy.url, max_attempts=5).read_range(uri, 0, 6 * MiB)
    assert len(gets) == 2 and "if-match" in gets[1] and "if-match" not in gets[0]
    # Unchanged, the same reset is survived and the bytes are the object's.
    with FaultProxy(s3_server, rate=1.0, faults=("reset",)) as proxy:
        proxy.on_request = lambda method, path, headers: setattr(proxy, "rate", 0.0) if method == "GET" else None
        assert S3Storage(proxy.url, max_attempts=5).read_range(uri, 0, 6 * MiB) == new


def test_a_shard_replaced_during_a_conversion_fails_it_and_publishes_nothing(s3_bucket, s3_server, tmp_path):
    # A shard rewritten under the same key (same size, other values) once the conversion has
    # started (its read-ahead holds one tensor): the tensors read after that are refused, never
    # mixed with the version whose header planned the run and whose ETag the manifest would name.
    storage = S3Storage(s3_server)
    g = torch.Generator().manual_seed(0)
    shards = {
        f"model-{i}.safetensors": {f"w{i}.{j}": torch.randn(128, 128, generator=g) for j in range(12)} for i in range(2)
    }
    for name, tensors in shards.items():
        storage.write_bytes(f"s3://{s3_bucket}/r/{name}", save(tensors))
    weight_map = {k: name for name, tensors in shards.items() for k in tensors}
    index = f"s3://{s3_bucket}/r/model.safetensors.index.json"
    storage.write_bytes(index, json.dumps({"metadata": {}, "weight_map": weight_map}).encode())
    replaced = []

    def progress(p) -> None:
        if p.stage == "converting" and not replaced:
            other = {k: -t for k, t in shards["model-1.safetensors"].items()}
            storage.write_bytes(f"s3://{s3_bucket}/r/model-1.safetensors", save(other), overwrite=True)
            replaced.append(p.tensors_done)

    out = tmp_path / "out" / "model.mdl"
    with pytest.raises(CorruptCheckpoint, match="was replaced while it was being read"):
        convert(index, str(out), to="cs-h5", progress=progress)
    assert replaced
    assert not out.exists() and not (out.parent / ".ckptconv-staging").exists()
    assert not list(out.parent.glob("*manifest*"))


def test_a_model_of_several_directories_reads_one_version_of_each_object(s3_bucket, s3_server):
    # DPR's two encoders are read as one checkpoint: one view of versions for both, which the
    # manifest's provenance and a fan-out part's check go by.
    from ckptconv.engine.layouts.api import open_model_source
    from ckptconv.storage.pinned import hold_versions

    storage = S3Storage(s3_server)
    root = f"s3://{s3_bucket}/dpr"
    for name in ("q_encoder", "ctx_encoder"):
        storage.write_bytes(f"{root}/{name}/model.safetensors", save({f"{name}.w": torch.ones(4)}))
    q = f"{root}/q_encoder/model.safetensors"
    with open_model_source(root, "dpr", "hf") as src:
        first = src.file_info(q).etag
        storage.write_bytes(q, save({"q_encoder.w": torch.full((4,), 9.0)}), overwrite=True)
        assert src.file_info(q).etag == first  # the version read, not the one there now
        with pytest.raises(CorruptCheckpoint, match="was replaced while it was being read"):
            src.read("q_encoder.w")
        with pytest.raises(CorruptCheckpoint, match="replaced since the job first read it"):
            hold_versions(src.storage, [(q, "0" * 32)])
    # Opened after the replacement, as a fan-out part is, and held to the job's version: refused.
    with (
        open_model_source(root, "dpr", "hf") as src,
        pytest.raises(CorruptCheckpoint, match="replaced since the job first read it"),
    ):
        hold_versions(src.storage, [(q, first)])


def test_a_version_pinned_before_the_first_read_costs_no_request_and_is_checked_by_it(s3_bucket, recorded):
    proxy, seen = recorded
    from ckptconv.storage.pinned import PinnedReads

    uri = f"s3://{s3_bucket}/p/blob"
    storage = S3Storage(proxy.url)
    old = storage.write_bytes(uri, b"a" * 100)
    storage.write_bytes(uri, b"b" * 100, overwrite=True)
    seen.clear()
    pinned = PinnedReads(S3Storage(proxy.url))
    pinned.pin(uri, old.etag)
    assert seen == []
    with pytest.raises(CorruptCheckpoint, match="was replaced"):
        pinned.read_range(uri, 0, 10)
    assert [m for m, _ in seen] == ["GET"]  # one conditional GET, refused; no HEAD before it


def test_user_metadata_is_of_the_version_read(s3_bucket, s3_server):
    # A cs-s3 object's dtype and shape are in its user metadata: from the version whose bytes are read.
    from ckptconv.storage.pinned import PinnedReads

    uri = f"s3://{s3_bucket}/m/obj"
    storage = S3Storage(s3_server)

    def put(data: bytes, meta: str) -> None:
        with storage.open_writer(uri, overwrite=True, metadata={"metadata": meta}) as w:
            w.write(data)

    put(b"\0" * 16, '{"dtype": "float32"}')
    pinned = PinnedReads(S3Storage(s3_server))
    assert pinned.user_metadata(uri) == {"metadata": '{"dtype": "float32"}'}  # tells the version too
    assert pinned.read_range(uri, 0, 4) == b"\0" * 4
    put(b"\1" * 16, '{"dtype": "int32"}')
    with pytest.raises(CorruptCheckpoint, match="was replaced"):
        pinned.user_metadata(uri)


def test_a_weak_etag_pins_nothing(s3_bucket, s3_server, monkeypatch):
    # A proxy that compresses answers weakens ETags (W/"..."): they say nothing of the bytes and
    # an If-Match with one is refused, so reads through such a proxy are not made conditional.
    from ckptconv.storage.pinned import PinnedReads
    from ckptconv.storage.s3.storage import ObjectInfo

    uri = f"s3://{s3_bucket}/w/blob"
    inner = S3Storage(s3_server)
    inner.write_bytes(uri, b"x" * 64)
    asked = []
    head = inner.read_head

    def weakened(uri, length, *, offset=0, **version):
        asked.append(version)
        data, info = head(uri, length, offset=offset)
        return data, ObjectInfo(uri=uri, size=info.size, etag=f'W/"{info.etag}', mtime=info.mtime)

    monkeypatch.setattr(inner, "read_head", weakened)
    pinned = PinnedReads(inner)
    assert pinned.read_head(uri, 8)[0] == b"x" * 8
    assert pinned.read_range(uri, 8, 8) == b"x" * 8
    assert pinned.read_head(uri, 4)[0] == b"x" * 4
    assert asked == [{}, {}]


def test_an_index_of_shards_opens_with_one_read_per_shard(s3_bucket, recorded):
    proxy, seen = recorded
    storage = S3Storage(proxy.url)
    g = torch.Generator().manual_seed(0)
    weight_map = {}
    for i in range(4):
        name = f"model-{i}.safetensors"
        tensors = {f"w{i}.{j}": torch.randn(64, 64, generator=g) for j in range(50)}
        storage.write_bytes(f"s3://{s3_bucket}/m/{name}", save(tensors))
        weight_map.update(dict.fromkeys(tensors, name))
    index = {"metadata": {}, "weight_map": weight_map}
    storage.write_bytes(f"s3://{s3_bucket}/m/model.safetensors.index.json", json.dumps(index).encode())
    seen.clear()
    with open_source(f"s3://{s3_bucket}/m/model.safetensors.index.json", "safetensors") as src:
        assert len(src.entries()) == 200
    shard_gets = [r for m, r in seen if m == "GET" and r]
    assert len(shard_gets) <= 4 + 2, seen  # one ranged GET per shard header (+ the index)


def test_the_plan_reports_and_the_run_keeps_a_memory_budget(s3_bucket, s3_server, tmp_path):
    g = torch.Generator().manual_seed(1)
    tensors = {f"w{i}": torch.randn(512, 512, generator=g) for i in range(6)}  # 1 MiB each
    uri = f"s3://{s3_bucket}/src/model.safetensors"
    S3Storage(s3_server).write_bytes(uri, save(tensors))
    largest = 512 * 512 * 4
    plan = plan_conversion(uri, to="cs-h5", memory_budget="400MiB")
    assert plan["ok"], plan
    memory = plan["memory"]
    staging = 48 << 20  # a local output's direct writes (storage.direct_io)
    assert memory["minimum_bytes"] == 2 * largest + staging + (300 << 20)
    assert memory["read_ahead_bytes"] == (400 << 20) - largest - staging - (300 << 20)
    assert memory["estimated_peak_bytes"] <= 400 << 20
    refused = plan_conversion(uri, to="cs-h5", memory_budget="301MiB")
    assert not refused["ok"] and refused["errors"][0]["code"] == "invalid_request"
    with pytest.raises(InvalidRequest, match="memory budget"):
        convert(uri, str(tmp_path / "small.mdl"), to="cs-h5", memory_budget="301MiB")
    assert not (tmp_path / "small.mdl").exists()
    result = convert(uri, str(tmp_path / "out.mdl"), to="cs-h5", memory_budget="400MiB")
    assert result.memory == memory and result.verify["ok"]


def test_an_s3_target_s_upload_buffers_come_out_of_the_read_ahead(s3_bucket, s3_server):
    g = torch.Generator().manual_seed(2)
    tensors = {f"w{i}": torch.randn(512, 512, generator=g) for i in range(6)}  # 1 MiB each
    uri = f"s3://{s3_bucket}/src/model.safetensors"
    S3Storage(s3_server).write_bytes(uri, save(tensors))
    largest = 512 * 512 * 4
    local = plan_conversion(uri, to="cs-h5", memory_budget="500MiB", target="/tmp/out.mdl")["memory"]
    remote = plan_conversion(uri, to="cs-h5", memory_budget="500MiB", target=f"s3://{s3_bucket}/out/model.mdl")
    assert remote["ok"], remote
    memory = remote["memory"]
    # The streamed H5 upload: 4 parts of 16 MiB in flight and 2 being filled.
    buffers = (4 + 2) * (16 << 20)
    staging = 48 << 20  # a local output's direct writes (storage.direct_io)
    assert local["writer_buffer_bytes"] == staging
    assert memory["writer_buffer_bytes"] == buffers
    assert memory["read_ahead_bytes"] == local["read_ahead_bytes"] + staging - buffers
    assert memory["minimum_bytes"] == 2 * largest + buffers + (300 << 20)
    assert memory["estimated_peak_bytes"] == 500 << 20
    # Too small for 4 parts in flight: the upload sends fewer at once, down to one, before refusing.
    squeezed = plan_conversion(uri, to="cs-h5", memory_budget="390MiB", target=f"s3://{s3_bucket}/out/model.mdl")
    assert squeezed["ok"], squeezed
    assert squeezed["memory"]["writer_buffer_bytes"] == (3 + 2) * (16 << 20)
    assert squeezed["memory"]["estimated_peak_bytes"] == 390 << 20
    too_small = plan_conversion(uri, to="cs-h5", memory_budget="340MiB", target=f"s3://{s3_bucket}/out/model.mdl")
    assert not too_small["ok"] and "writers' buffers (upload parts" in too_small["errors"][0]["detail"]
    assert str(2 * largest + (1 + 2) * (16 << 20) + (300 << 20)) in too_small["errors"][0]["detail"]
    assert memory["upload_concurrency"] == 4 and squeezed["memory"]["upload_concurrency"] == 3
    assert "upload_concurrency" not in local
    # A sharded safetensors target uploads one file at a time through the same part upload, and a
    # budget squeezes it the same way.
    st = plan_conversion(uri, to="safetensors", memory_budget="500MiB", target=f"s3://{s3_bucket}/out/st")
    assert st["memory"]["writer_buffer_bytes"] == buffers and st["memory"]["upload_concurrency"] == 4
    st_squeezed = plan_conversion(uri, to="safetensors", memory_budget="350MiB", target=f"s3://{s3_bucket}/out/st")
    assert st_squeezed["ok"], st_squeezed
    assert st_squeezed["memory"]["writer_buffer_bytes"] == (1 + 2) * (16 << 20)
    assert st_squeezed["memory"]["upload_concurrency"] == 1
    result = convert(uri, f"s3://{s3_bucket}/out/st/model.safetensors", to="safetensors", memory_budget="350MiB")
    assert result.memory == st_squeezed["memory"] and result.verify["ok"]
    written = load(S3Storage(s3_server).read_all(result.outputs[0].uri))
    assert written.keys() == tensors.keys() and all(torch.equal(written[k], t) for k, t in tensors.items())
    result = convert(uri, f"s3://{s3_bucket}/out/model.mdl", to="cs-h5", memory_budget="500MiB")
    assert result.memory == memory and result.verify["ok"]
    result = convert(uri, f"s3://{s3_bucket}/out/squeezed.mdl", to="cs-h5", memory_budget="350MiB")
    assert result.memory["writer_buffer_bytes"] == (1 + 2) * (16 << 20) and result.verify["ok"]


def test_planning_an_h5_file_over_s3_reads_its_scattered_metadata_in_small_blocks(s3_bucket, recorded, tmp_path):
    proxy, seen = recorded
    g = torch.Generator().manual_seed(4)
    tensors = {f"layers.{i}.w": torch.randn(512, 1024, generator=g) for i in range(12)}  # 2 MiB each
    local = tmp_path / "model.mdl"
    st = tmp_path / "model.safetensors"
    st.write_bytes(save(tensors))
    convert(str(st), str(local), to="cs-h5")  # the local (chunked) layout: headers between the datasets
    uri = f"s3://{s3_bucket}/h5/model.mdl"
    S3Storage(proxy.url).write_bytes(uri, local.read_bytes())
    seen.clear()
    plan = plan_conversion(uri, to="safetensors")
    assert plan["ok"], plan
    fetched = 0
    for method, r in seen:
        if method == "GET" and r:
            first, last = r.removeprefix("bytes=").split("-")
            fetched += int(last) - int(first) + 1
    # The front of the file and small blocks around the scattered headers: less than half the file
    # (8 MiB per object header fetched over three times its size).
    assert 0 < fetched < local.stat().st_size // 2, (fetched, local.stat().st_size)


def test_a_contiguous_h5_dataset_is_one_ranged_read_of_its_bytes(s3_bucket, recorded, tmp_path):
    proxy, seen = recorded
    g = torch.Generator().manual_seed(5)
    tensors = {f"layers.{i}.w": torch.randn(256, 1024, generator=g) for i in range(4)}  # 1 MiB each
    st = tmp_path / "model.safetensors"
    st.write_bytes(save(tensors))
    uri = f"s3://{s3_bucket}/contiguous/model.mdl"
    convert(str(st), uri, to="cs-h5")  # S3 targets: contiguous datasets
    with open_source(uri, "cs-h5") as src:
        assert src.read_parallelism == S3Storage(proxy.url).read_parallelism  # values read at once
        seen.clear()
        got = src.read("layers.2.w")
    assert torch.equal(got, tensors["layers.2.w"])
    # Its bytes in one GET of exactly their range, past HDF5 (no small reads of a file object).
    ranges = [r for m, r in seen if m == "GET"]
    assert len(ranges) == 1, seen
    first, last = (int(x) for x in ranges[0].removeprefix("bytes=").split("-"))
    assert last - first + 1 == tensors["layers.2.w"].nbytes


def test_neighbouring_h5_datasets_are_read_with_one_get_below_two_parts(s3_bucket, recorded, monkeypatch, tmp_path):
    _, seen = recorded
    monkeypatch.setenv("CKPTCONV_S3_READ_PART_SIZE", "5MiB")
    g = torch.Generator().manual_seed(6)
    tensors = {f"layers.{i:02d}.w": torch.randn(512, 512, generator=g) for i in range(12)}  # 1 MiB each
    tensors["layers.05.mask"] = torch.rand(33, generator=g) > 0.5  # small bools among them
    tensors["layers.06.b"] = torch.randn(300, generator=g).to(torch.bfloat16)
    st = tmp_path / "model.safetensors"
    st.write_bytes(save(tensors))
    uri = f"s3://{s3_bucket}/joined/model.mdl"
    convert(str(st), uri, to="cs-h5")  # S3 targets: contiguous datasets, back to back
    with open_source(uri, "cs-h5") as src:
        extents = sorted(src.extent(k) for k in tensors)
        assert all(b.offset == a.offset + a.nbytes for a, b in itertools.pairwise(extents))
    start, total = extents[0].offset, sum(e.nbytes for e in extents)
    seen.clear()
    result = convert(uri, str(tmp_path / "back.safetensors"), to="safetensors", memory_budget="400MiB")
    assert result.verify["ok"]
    with open_source(str(tmp_path / "back.safetensors"), "safetensors") as out:
        assert all(torch.equal(out.read(k), t) for k, t in tensors.items())
    # The data area in two GETs (together below 10 MiB, then the rest), each value in its own memory.
    gets = [g for g in _data_gets(seen, start) if g[0] + g[1] <= total]  # not metadata blocks past it
    assert len(gets) == 2 and gets[0][0] == 0 and sum(n for _, n in gets) == total, gets


def test_a_bool_h5_dataset_read_with_its_neighbours_is_checked(s3_bucket, s3_server, tmp_path):
    st = tmp_path / "model.safetensors"
    st.write_bytes(save({"a": torch.ones(4), "mask": torch.tensor([True, False, True])}))
    uri = f"s3://{s3_bucket}/joined/bools.mdl"
    convert(str(st), uri, to="cs-h5")
    storage = S3Storage(s3_server)
    with open_source(uri, "cs-h5") as src:
        mask = src.extent("mask")
        assert mask is not None and src.extent("a").offset + 16 == mask.offset
    blob = bytearray(storage.read_range(uri, 0, storage.stat(uri).size))
    blob[mask.offset + 1] = 7  # neither 0 nor 1
    damaged = f"s3://{s3_bucket}/joined/damaged.mdl"
    storage.write_bytes(damaged, bytes(blob))
    with open_source(damaged, "cs-h5") as src, pytest.raises(CorruptCheckpoint, match="'mask': bool tensor"):
        src.read_neighbours(["a", "mask"])


def test_a_body_slower_than_a_slice_per_read_timeout_is_still_read(s3_bucket, s3_server, monkeypatch):
    """A server that keeps sending, but less than a slice within the read timeout, is slow, not
    stalled: a read that timed out waiting for a whole slice is retried taking the body as it
    comes, and the object is read."""
    monkeypatch.setenv("CKPTCONV_S3_READ_TIMEOUT_S", "1")
    data = os.urandom(2 * MiB + MiB // 2)
    S3Storage(s3_server).write_bytes(f"s3://{s3_bucket}/blob", data)
    # 64 KiB every 0.1 s: a slice (1 MiB) takes 1.6 s, a packet never more than 0.1 s.
    with FaultProxy(s3_server, keep_alive=True, piece_bytes=64 << 10, piece_pause_s=0.1) as proxy:
        buf = bytearray(len(data))
        S3Storage(proxy.url, max_attempts=3).read_into(f"s3://{s3_bucket}/blob", 0, buf)
    assert buf == data
