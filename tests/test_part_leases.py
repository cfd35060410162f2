"""The leases by which a fanned-out job's parts are held (worker/parts.py), in a real Redis."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import redis
from conftest import PrivateRedis

from ckptconv.core.jobstore import JobStore, RedisKeys
from ckptconv.core.settings import Settings, get_settings


def _calls(client: redis.Redis, command: str) -> int:
    return int(client.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))


def test_one_question_tells_which_of_many_parts_are_held(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A job's worker waiting for hundreds of parts asks every poll which of them a live process
    # holds: one command for them all, not one per part. Counted on a Redis of the test's own,
    # which no other client talks to.
    server = PrivateRedis(tmp_path, aof=False)
    try:
        _held_in_one_command(server.url, monkeypatch)
    finally:
        server.stop()


def _held_in_one_command(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTCONV_ENVIRONMENT", "development")  # importing the worker builds the Celery app
    get_settings.cache_clear()
    from worker.parts import RedisPartRunner

    get_settings.cache_clear()  # the development settings stay with the app they built
    settings = Settings(environment="development", redis_url=redis_url)
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    store = JobStore(client, RedisKeys(f"leases-{uuid.uuid4().hex[:8]}:"))
    mine = RedisPartRunner(store, settings, "job", 1)
    other = RedisPartRunner(store, settings, "job", 1)
    with mine.claim(1) as first, other.claim(200) as second:
        assert first and second
        with other.claim(1) as taken:
            assert not taken  # held by the first claim
        before = (_calls(client, "mget"), _calls(client, "exists"), _calls(client, "get"))
        assert mine.held(range(256)) == {1, 200}
        after = (_calls(client, "mget"), _calls(client, "exists"), _calls(client, "get"))
        assert [b - a for a, b in zip(before, after, strict=True)] == [1, 0, 0]
    assert mine.held(range(256)) == set()  # released with their claims
    assert mine.held([]) == set()
