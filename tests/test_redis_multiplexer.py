"""The API's short Redis commands share one connection (service.multiplexer): every reply reaches
its own command whatever happens around it (cancelled callers, error replies, scripts Redis forgot,
Redis killed, restarted or stalled), and what is not multiplexed keeps its pooled connections."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio
import redis.exceptions
from conftest import PrivateRedis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from service.limits import BoundedPool, redis_retry
from service.multiplexer import MultiplexedRedis

# A command that needs every connection a test's server has (the default is to refuse DEBUG).
DEBUG = ("--enable-debug-command", "local")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateRedis]:
    private = PrivateRedis(tmp_path_factory.mktemp("redis"), aof=False, extra=DEBUG)
    try:
        yield private
    finally:
        private.stop()


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[PrivateRedis]:
    """A server of the test's own, for a test that kills or restarts it."""
    private = PrivateRedis(tmp_path, aof=False, extra=DEBUG)
    try:
        yield private
    finally:
        private.stop()


def client(url: str, *, max_connections: int = 8, pool_timeout: float = 5, retries: int = 3, **kwargs: Any) -> Any:
    """The API's short-command client (service.app), on ``url``."""
    pool = BoundedPool.from_url(
        url,
        decode_responses=True,
        socket_connect_timeout=5,
        max_connections=max_connections,
        timeout=pool_timeout,
        retry=Retry(redis_retry()._backoff, retries),
        retry_on_error=[redis.exceptions.ConnectionError],
        **kwargs,
    )
    return MultiplexedRedis.from_pool(pool)


def plain(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, decode_responses=True)


async def stalled(server: PrivateRedis, seconds: int) -> asyncio.Future:
    """Stall ``server`` for ``seconds`` (DEBUG SLEEP, sent from a thread); returns the sleep's
    future once Redis is inside it (its main thread sleeping in the kernel), not after a fixed
    pause: on a busy machine the thread may send the command late, and the commands a test then
    sends would be answered before the stall."""
    stall = asyncio.ensure_future(asyncio.to_thread(plain(server.url).execute_command, "DEBUG", "SLEEP", str(seconds)))
    wchan = Path(f"/proc/{server.proc.pid}/wchan")
    while "nanosleep" not in wchan.read_text():
        assert not stall.done(), "the stall ended before it was seen"
        await asyncio.sleep(0.001)
    return stall


def test_commands_of_one_iteration_go_out_together_on_one_connection(server: PrivateRedis) -> None:
    async def scenario() -> None:
        r = client(server.url, max_connections=64)
        try:
            await r.ping()
            before = plain(server.url).info("stats")["total_net_input_bytes"]
            writes = []
            transport = r._mux._connection.transport
            write = transport.write
            transport.write = lambda data: (writes.append(data), write(data))  # type: ignore[func-returns-value]
            answers = await asyncio.gather(*(r.incr("mux:together") for _ in range(50)))
            assert sorted(answers) == list(range(1, 51))
            assert len(writes) == 1 and writes[0].count(b"INCRBY") == 50
            assert plain(server.url).info("stats")["total_net_input_bytes"] > before
            # The pool keeps one connection fewer: the shared one is one of the process's connections.
            assert r.connection_pool.max_connections == 63
        finally:
            await r.aclose()

    asyncio.run(scenario())


def test_callers_cancelled_at_random_never_shift_the_replies_of_the_others(server: PrivateRedis) -> None:
    n = 3000
    plain(server.url).mset({f"mux:v{i}": str(i) for i in range(n)})

    async def scenario() -> None:
        r = client(server.url)
        echo = r.register_script("return ARGV[1]")
        rng = random.Random(7)
        try:

            async def one(i: int) -> tuple[int, Any]:
                if i % 3 == 0:
                    return i, await echo(args=[f"e{i}"])
                if i % 3 == 1:
                    return i, await r.get(f"mux:v{i}")
                return i, await r.hgetall(f"mux:none{i}")

            expected = {0: lambda i: f"e{i}", 1: lambda i: str(i), 2: lambda i: {}}
            tasks = [asyncio.ensure_future(one(i)) for i in range(n)]
            cancelled_while_waiting = 0
            for _ in range(40):  # cancel some at every stage: queued, written, half answered
                await asyncio.sleep(0)
                for task in rng.sample(tasks, 25):
                    if not task.done():
                        cancelled_while_waiting += task.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            answered = [x for x in results if not isinstance(x, BaseException)]
            assert cancelled_while_waiting > 0 and len(answered) > n // 2
            assert all(isinstance(x, asyncio.CancelledError) for x in results if isinstance(x, BaseException))
            for i, value in answered:
                assert value == expected[i % 3](i), (i, value)
            # Nothing is owed any more, and the next command gets its own reply.
            assert not r._mux._connection.pending
            assert await r.get("mux:v5") == "5"
        finally:
            await r.aclose()

    asyncio.run(scenario())


def test_error_replies_reach_only_their_own_commands(server: PrivateRedis) -> None:
    plain(server.url).set("mux:string", "x")

    async def scenario() -> None:
        r = client(server.url)
        fails = r.register_script(
            "if ARGV[1] == 'bad' then return redis.error_reply('ERR refused ' .. ARGV[2]) end return ARGV[2]"
        )
        try:
            calls = []
            for i in range(300):
                if i % 4 == 0:
                    calls.append(r.hgetall("mux:string"))  # WRONGTYPE
                elif i % 4 == 1:
                    calls.append(fails(args=["bad", str(i)]))
                elif i % 4 == 2:
                    calls.append(fails(args=["good", str(i)]))
                else:
                    calls.append(r.get("mux:string"))
            results = await asyncio.gather(*calls, return_exceptions=True)
            for i, result in enumerate(results):
                if i % 4 == 0:
                    assert isinstance(result, redis.exceptions.ResponseError) and "WRONGTYPE" in str(result)
                elif i % 4 == 1:
                    assert isinstance(result, redis.exceptions.ResponseError) and str(result).endswith(f"refused {i}")
                elif i % 4 == 2:
                    assert result == str(i)
                else:
                    assert result == "x"
        finally:
            await r.aclose()

    asyncio.run(scenario())


def test_a_script_redis_forgot_is_loaded_again(server: PrivateRedis) -> None:
    async def scenario() -> None:
        r = client(server.url)
        script = r.register_script("return KEYS[1] .. ':' .. ARGV[1]")
        try:
            assert await script(keys=["k"], args=["first"]) == "k:first"
            plain(server.url).script_flush()
            # Every command of the burst meets NOSCRIPT, loads the script and runs it.
            answers = await asyncio.gather(*(script(keys=["k"], args=[str(i)]) for i in range(40)))
            assert answers == [f"k:{i}" for i in range(40)]
            assert plain(server.url).script_exists(script.sha) == [True]
        finally:
            await r.aclose()

    asyncio.run(scenario())


def test_redis_killed_mid_burst_fails_commands_typed_and_the_next_ones_reconnect(own_server: PrivateRedis) -> None:
    server = own_server

    async def scenario() -> None:
        r = client(server.url, retries=1)
        try:
            assert await r.set("mux:before", "1")
            # Commands queued behind a busy Redis are waiting for their replies when it dies.
            stall = await stalled(server, 1)
            waiting = [asyncio.ensure_future(r.incr("mux:burst")) for _ in range(200)]
            while not r._mux._connection or not r._mux._connection.pending:
                await asyncio.sleep(0.01)
            await asyncio.to_thread(server.kill)
            results = await asyncio.gather(*waiting, return_exceptions=True)
            await asyncio.gather(stall, return_exceptions=True)
            errors = [x for x in results if isinstance(x, BaseException)]
            assert errors and all(type(e) is redis.exceptions.ConnectionError for e in errors), errors[:3]
            with pytest.raises(redis.exceptions.ConnectionError):
                await r.get("mux:before")  # nobody listens: refused, typed, not hung
            await asyncio.to_thread(server.start)
            assert await r.incr("mux:after") == 1  # a new connection (the old server's data is gone)
            assert await asyncio.gather(*(r.incr("mux:after") for _ in range(10))) == list(range(2, 12))
        finally:
            await r.aclose()

    asyncio.run(scenario())


def test_a_restart_between_bursts_costs_no_error(own_server: PrivateRedis) -> None:
    # The client's retry policy resends a command that met the dead connection (as for pooled ones).
    server = own_server

    async def scenario() -> None:
        r = client(server.url)
        try:
            assert await r.incr("mux:n") == 1
            await asyncio.to_thread(server.restart)
            assert await asyncio.gather(*(r.incr("mux:n") for _ in range(20))) == list(range(1, 21))
        finally:
            await r.aclose()

    asyncio.run(scenario())


def test_a_stalled_redis_times_out_as_a_pooled_command_does(server: PrivateRedis) -> None:
    # With a socket timeout in the URL, a command Redis does not answer fails with TimeoutError,
    # multiplexed or pooled alike.
    url = server.url + "?socket_timeout=0.2"

    async def scenario() -> Any:
        r = client(url, retries=1)
        pooled = redis.asyncio.Redis.from_pool(
            BoundedPool.from_url(
                url,
                decode_responses=True,
                max_connections=2,
                timeout=5,
                retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), 1),
                retry_on_error=[redis.exceptions.ConnectionError],
            )
        )
        try:
            await r.ping()
            await pooled.ping()
            stall = await stalled(server, 3)
            outcomes = await asyncio.gather(r.get("mux:x"), pooled.get("mux:x"), return_exceptions=True)
            await stall
            assert await r.set("mux:x", "after")  # and the next command is answered
            return outcomes
        finally:
            await r.aclose()
            await pooled.aclose()

    multiplexed, pooled = asyncio.run(scenario())
    assert type(multiplexed) is type(pooled) is redis.exceptions.TimeoutError


def test_a_stalled_redis_holds_as_many_commands_as_the_pool_had_connections(server: PrivateRedis) -> None:
    # Without a socket timeout commands wait for Redis; past the pool's size they give up after the
    # pool's timeout, as commands that found every pooled connection taken did (503).
    async def scenario() -> None:
        r = client(server.url, max_connections=4, pool_timeout=0.5)
        try:
            await r.ping()
            stall = await stalled(server, 2)
            held = [asyncio.ensure_future(r.incr("mux:held")) for _ in range(4)]
            await asyncio.sleep(0)
            with pytest.raises(redis.exceptions.ConnectionError, match="No connection available"):
                await r.incr("mux:held")
            assert sorted(await asyncio.gather(*held)) == [1, 2, 3, 4]
            await stall
        finally:
            await r.aclose()

    asyncio.run(scenario())


def test_a_redis_stalled_while_the_connection_opens_holds_no_more_commands(server: PrivateRedis) -> None:
    # The commands that wait for the shared connection to open (its handshake waits for a stalled
    # Redis) count among those waiting for Redis: the others give up after the pool's timeout.
    async def scenario() -> list[Any]:
        r = client(server.url, max_connections=4, pool_timeout=0.5)
        try:
            stall = await stalled(server, 2)
            r._mux._handshake.append(("PING",))  # a handshake to wait on, whatever the protocol
            outcomes = await asyncio.gather(*(r.incr("mux:opening") for _ in range(12)), return_exceptions=True)
            await stall
            return outcomes
        finally:
            await r.aclose()

    plain(server.url).delete("mux:opening")
    outcomes = asyncio.run(scenario())
    refused = [x for x in outcomes if isinstance(x, redis.exceptions.ConnectionError)]
    assert len(refused) == 8 and all("No connection available" in str(x) for x in refused), outcomes
    assert sorted(x for x in outcomes if not isinstance(x, BaseException)) == [1, 2, 3, 4]


def test_blocking_commands_and_pipelines_keep_their_pooled_connections(server: PrivateRedis) -> None:
    async def scenario() -> None:
        r = client(server.url, max_connections=3)
        pool = r.connection_pool
        try:
            waiting = asyncio.ensure_future(r.blpop(["mux:list"], timeout=5))
            while not pool._in_use_connections:
                await asyncio.sleep(0.01)
            # The blocked pop holds a pooled connection; multiplexed commands go on beside it.
            assert await r.lpush("mux:list", "a") == 1
            assert list(await waiting) == ["mux:list", "a"]
            pipe = r.pipeline(transaction=True)
            pipe.set("mux:p", "1")
            pipe.get("mux:p")
            assert await pipe.execute() == [True, "1"]
            assert len(pool._available_connections) + len(pool._in_use_connections) <= pool.max_connections == 2
        finally:
            await r.aclose()

    asyncio.run(scenario())


def test_a_reply_that_does_not_decode_fails_only_its_own_command(server: PrivateRedis) -> None:
    # A pooled command raises UnicodeDecodeError and nothing else notices; the shared connection must
    # not be dropped for it, which failed every command beside it and sent them all again.
    raw = redis.Redis.from_url(server.url)
    raw.set("mux:binary", b"\xff\xfe")
    raw.delete("mux:counted")

    async def scenario() -> list[Any]:
        r = client(server.url)
        try:
            await r.ping()
            calls = [r.incr("mux:counted") for _ in range(20)] + [r.get("mux:binary")]
            calls += [r.incr("mux:counted") for _ in range(20)]
            return await asyncio.gather(*calls, return_exceptions=True)
        finally:
            await r.aclose()

    results = asyncio.run(scenario())
    assert isinstance(results[20], UnicodeDecodeError)
    assert sorted(results[:20] + results[21:]) == list(range(1, 41))
    assert raw.get("mux:counted") == b"40"  # each INCR ran once


@pytest.mark.parametrize("target", [True, False])
def test_a_submission_sent_again_after_its_reply_was_lost_is_created_once(server: PrivateRedis, target: bool) -> None:
    # A lost connection fails every command written on it, some of which Redis ran (their replies
    # were lost), and the retry policy sends them again: the submit script must give the same answer
    # (not target_taken by its own job) and queue the job once.
    from ckptconv.core.jobstore import AsyncJobStore, RedisKeys

    keys = RedisKeys(f"mux-submit-{target}:")
    rec = {"id": "job_0000000000001234", "owner": "o", "kind": "convert", "state": "queued"}
    if target:
        claim = keys.target_claim("s3://bucket/out/model.mdl")
        rec["target_key"], rec["target_claim"] = claim[0], " ".join(claim)

    async def scenario() -> list[list[str]]:
        r = client(server.url)
        store = AsyncJobStore(r, keys)
        call = {"labels": {}, "idem_key": None, "fingerprint": "", "idem_ttl_seconds": 60, "response_body": "{}"}
        try:
            return [await store.submit(rec, **call, queue="jobs", message="m") for _ in range(2)]
        finally:
            await r.aclose()

    assert asyncio.run(scenario()) == [["created"], ["created"]]
    assert plain(server.url).llen(keys.queue("jobs")) == 1


class ReplyDropper:
    """A loopback TCP proxy to Redis that, once armed, closes the client's connection instead of
    relaying the next reply: Redis ran the command, its reply is lost with the connection."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.armed = False
        self.dropped = 0
        self.server: asyncio.Server | None = None
        self.url = ""

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"redis://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/0"

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        redis_r, redis_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, replies: bool) -> None:
            while data := await src.read(65536):
                if replies and self.armed:
                    self.armed = False
                    self.dropped += 1
                    break
                dst.write(data)
            client_w.close()
            redis_w.close()

        await asyncio.gather(pump(client_r, redis_w, False), pump(redis_r, client_w, True), return_exceptions=True)

    def close(self) -> None:
        assert self.server is not None
        self.server.close()


def sent_again_after_a_lost_reply(server: PrivateRedis, keys: Any, call: Any) -> list[Any]:
    """``call(store, target, token)`` on ``warm`` (its script is then loaded), then on ``lost`` with
    its reply lost (Redis ran it; the retry policy sends it again), on ``lost`` again with the same
    token, and with another token: the last three answers."""
    from ckptconv.core.jobstore import AsyncJobStore

    async def scenario() -> list[Any]:
        proxy = ReplyDropper(server.port)
        await proxy.start()
        r = client(proxy.url)
        store = AsyncJobStore(r, keys)
        try:
            await call(store, "warm", "token-w")
            proxy.armed = True
            answers = [await call(store, "lost", token) for token in ("token-a", "token-a", "token-b")]
            assert proxy.dropped == 1
            return answers
        finally:
            await r.aclose()
            proxy.close()

    return asyncio.run(scenario())


def test_an_idempotency_claim_sent_again_after_its_reply_was_lost_is_still_claimed(server: PrivateRedis) -> None:
    # The claim runs in Redis, its reply is lost with the connection, and the retry policy sends it
    # again: the resend finds the claim it made itself, which must not answer 409 "in flight" to the
    # request that holds it. Another request's claim on the same key is still in flight.
    from ckptconv.core.jobstore import RedisKeys

    keys = RedisKeys("mux-claim:")
    plain(server.url).delete(keys.idempotency("o", "warm"), keys.idempotency("o", "lost"))

    async def claim(store: Any, name: str, token: str) -> list[str]:
        return await store.idem_claim(keys.idempotency("o", name), "fp", 60, token)

    first, again, other = sent_again_after_a_lost_reply(server, keys, claim)
    assert first == ["claimed"]  # the first call's own answer, given by its resend
    assert again == ["claimed"]  # the script driven once more with the same token
    assert other[:3] == ["exists", "fp", "pending"]


def test_a_cancellation_sent_again_after_its_reply_was_lost_answers_cancelled(server: PrivateRedis) -> None:
    # A queued job cancelled by a call whose reply was lost: the resend must answer "cancelled" (the
    # API then sends the job's webhook), not "unchanged" as to a second cancellation.
    from ckptconv.core.jobstore import RedisKeys

    keys = RedisKeys("mux-cancel:")
    r0 = plain(server.url)
    for job in ("warm", "lost"):
        r0.delete(keys.job(job), keys.events(job))
        r0.hset(keys.job(job), mapping={"state": "queued", "owner": "o"})

    async def cancel(store: Any, job: str, token: str) -> tuple[str, str]:
        return await store.cancel(job, "o", {}, token)

    first, again, other = sent_again_after_a_lost_reply(server, keys, cancel)
    assert first == again == ("cancelled", "queued")
    assert other == ("unchanged", "cancelled")
    assert r0.xlen(keys.events("lost")) == 1  # cancelled once
