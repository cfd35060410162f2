"""Limits of the API: per API key (shared by every API process through Redis) requests per second and
open event streams; per process, Redis connections.

Requests per second: a fixed one-second window per key in Redis (``{p}rate:<key id>``, created with
a one-second expiry by the first request of the window). A process does not ask Redis for every
request: it takes a share of the window's budget at once (a twentieth of the limit) and spends it
locally, and a key found over its limit is answered from memory until its window ends. Redis never
grants more than the limit in a window, so the limit holds across any number of API processes; a
share left unspent in one process when the window ends is lost (a key may get slightly less than
its limit, never more). The hot path pays one Redis round trip per share, not per request. A share
whose reply was lost with its connection, and which was taken again when the command was resent
(``service.multiplexer``), is lost the same way: one share of one window, never more than the limit.

Redis connections: :class:`BoundedPool` (see there).

Event streams: each open stream holds a member of ``{p}streams:<key id>`` (a sorted set scored by
expiry, refreshed while the stream lives and removed when it ends), so a stream of a process that
died stops counting when its entry expires.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import time
import uuid
from typing import Any

import redis.asyncio
import redis.exceptions
from redis.asyncio.retry import Retry
from redis.utils import HIREDIS_AVAILABLE

if HIREDIS_AVAILABLE:
    from redis.connection import HiredisRespSerializer
else:  # pragma: no cover - hiredis is a dependency
    HiredisRespSerializer = None

from ckptconv.core.errors import RateLimited, TooManyStreams
from ckptconv.core.jobstore import REDIS_RETRIES, RedisKeys, redis_backoff

WINDOW_MS = 1000
SHARE_FRACTION = 20
LOCAL_ENTRIES_MAX = 10_000
# A stream's entry outlives two of its refreshes (every keepalive): a live stream never expires.
STREAM_TTL_MS = 45_000

# KEYS[1] the window's counter. ARGV: wanted, limit, window ms. Returns {granted, ms left in the window}.
_TAKE = """
local used = tonumber(redis.call('GET', KEYS[1]) or '0')
local grant = math.min(tonumber(ARGV[1]), tonumber(ARGV[2]) - used)
if grant > 0 then
  redis.call('INCRBY', KEYS[1], grant)
else
  grant = 0
end
local left = redis.call('PTTL', KEYS[1])
if left < 0 then
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  left = tonumber(ARGV[3])
end
return {grant, left}
"""

# KEYS[1] the key's open streams. ARGV: member, cap, ttl ms. Returns 1 if the stream may open.
_OPEN_STREAM = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZSCORE', KEYS[1], ARGV[1]) == false and redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then
  return 0
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""


class RateLimiter:
    """``take(key_id)`` returns, or raises :class:`RateLimited` with the seconds until the window ends."""

    def __init__(self, redis: Any, keys: RedisKeys, per_second: int) -> None:
        self.keys = keys
        self.per_second = per_second
        self.share = max(1, per_second // SHARE_FRACTION)
        self._take = redis.register_script(_TAKE)
        # key id -> [tokens left, window end (monotonic), refused until the window ends]
        self._local: dict[str, list[Any]] = {}
        self._pending: dict[str, asyncio.Future[None]] = {}

    async def take(self, key_id: str) -> None:
        if self.per_second <= 0:
            return
        while True:
            now = time.monotonic()
            slot = self._local.get(key_id)
            if slot is not None and slot[1] > now:
                if slot[0] > 0:
                    slot[0] -= 1
                    return
                if slot[2]:
                    raise self._refusal(slot[1] - now)
            pending = self._pending.get(key_id)
            if pending is None:
                break
            # One request of this process asks Redis for the next share; the others wait for its answer
            # (all asking at once would take many shares and leave the last ones none).
            await asyncio.shield(pending)
        self._pending[key_id] = asyncio.get_running_loop().create_future()
        try:
            granted, left_ms = await self._take(
                keys=[self.keys.rate(key_id)], args=[self.share, self.per_second, WINDOW_MS]
            )
        finally:
            self._pending.pop(key_id).set_result(None)
        granted, ends = int(granted), now + int(left_ms) / 1000
        if len(self._local) >= LOCAL_ENTRIES_MAX:
            self._local.clear()
        if granted == 0:
            self._local[key_id] = [0, ends, True]
            raise self._refusal(ends - now)
        self._local[key_id] = [granted - 1, ends, False]

    def _refusal(self, seconds: float) -> RateLimited:
        return RateLimited(
            f"this API key exceeded its limit of {self.per_second} requests per second",
            retry_after=math.ceil(seconds),
        )


class StreamSlots:
    """At most ``per_key`` open event streams per API key, across every API process."""

    def __init__(self, redis: Any, keys: RedisKeys, per_key: int) -> None:
        self.redis = redis
        self.keys = keys
        self.per_key = per_key
        self._open = redis.register_script(_OPEN_STREAM)

    async def open(self, key_id: str) -> str:
        """A new stream's slot id; raises :class:`TooManyStreams` when the key has ``per_key`` open."""
        member = uuid.uuid4().hex
        if not await self._open(keys=[self.keys.streams(key_id)], args=[member, self.per_key, STREAM_TTL_MS]):
            raise TooManyStreams(
                f"this API key already has {self.per_key} event streams open", retry_after=STREAM_TTL_MS // 3000
            )
        return member

    async def refresh(self, key_id: str, member: str) -> None:
        await self._open(keys=[self.keys.streams(key_id)], args=[member, self.per_key, STREAM_TTL_MS])

    async def close(self, key_id: str, member: str) -> None:
        await self.redis.zrem(self.keys.streams(key_id), member)


def redis_retry() -> Retry:
    """The retry policy of the API's Redis clients (pooled and multiplexed commands alike): the one
    policy of every Redis client (``ckptconv.core.jobstore.redis_backoff``), as redis.asyncio's Retry."""
    return Retry(redis_backoff(), REDIS_RETRIES)


class BoundedPool(redis.asyncio.ConnectionPool):
    """A Redis connection pool of at most ``max_connections``: a command that finds them all in use
    waits up to ``timeout`` seconds for one (then ``ConnectionError``: the API answers 503).

    redis-py's BlockingConnectionPool does the same but pays a condition and a timeout on every
    command (about 15% more CPU per command, measured); here a free connection costs less than the
    plain pool's (see ``get_connection``), and only a command that has to wait pays for waiting.
    """

    def __init__(self, *args: Any, timeout: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.timeout = timeout
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    async def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        if self._available_connections:
            # An idle connection, taken as redis-py's pool takes it but without its lock (nothing
            # awaits before the connection is marked in use), its argument checks, connection
            # metrics and events (neither is used here): a fifth of a short command's CPU.
            connection = self._available_connections.pop()
            self._in_use_connections.add(connection)
            try:
                await self.ensure_connection(connection)  # reconnects one that Redis closed
            except BaseException:
                await self.release(connection)
                raise
            return connection
        deadline = None
        while True:
            if self.can_get_connection():
                try:
                    return await super().get_connection(*args, **kwargs)
                except redis.exceptions.MaxConnectionsError:
                    pass  # another command took the free connection first: wait for the next one
            deadline = deadline if deadline is not None else asyncio.get_running_loop().time() + self.timeout
            await wait_in_line(self._waiters, deadline)

    def make_connection(self) -> Any:
        connection = super().make_connection()
        if HiredisRespSerializer is not None:
            # Commands packed by hiredis, as redis-py's synchronous client packs them: the asyncio
            # client packs in Python, a sixth of the CPU for a job's submission script and its args.
            connection.pack_command = HiredisRespSerializer().pack
        return connection

    async def release(self, connection: Any) -> None:
        try:
            if connection.should_reconnect():
                await connection.disconnect()
        finally:
            # In use until here, so the pool never holds more than max_connections; and given back
            # even when the command's task is cancelled while it disconnects, or the slot is lost.
            self._in_use_connections.remove(connection)
            self._available_connections.append(connection)
            wake(self._waiters, 1)


async def wait_in_line(waiters: collections.deque[asyncio.Future[None]], deadline: float) -> None:
    """Wait among ``waiters`` until :func:`wake` wakes this one; at ``deadline`` (loop time), the
    ``ConnectionError`` of a pool found exhausted (the API answers 503)."""
    loop = asyncio.get_running_loop()
    waiter = loop.create_future()
    waiters.append(waiter)
    try:
        await asyncio.wait_for(waiter, max(0.0, deadline - loop.time()))
    except TimeoutError:
        raise redis.exceptions.ConnectionError("No connection available.") from None
    finally:
        with contextlib.suppress(ValueError):
            waiters.remove(waiter)


def wake(waiters: collections.deque[asyncio.Future[None]], n: int) -> None:
    """Wake the ``n`` oldest of ``waiters`` still waiting."""
    while n > 0 and waiters:
        waiter = waiters.popleft()
        if not waiter.done():
            waiter.set_result(None)
            n -= 1
