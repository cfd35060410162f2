"""The API's short Redis commands, pipelined on their own: the commands the requests of one
event-loop iteration send go out together, in one write on one shared connection, and the replies
come back in the order the commands went out.

With a connection per command (redis-py's pool), each command cost its own ``send()`` (and woke
Redis to read it), and its own pool, retry and parsing machinery in Python; under load about 25
commands of one API process go out in the same iteration. Here a command is packed (hiredis) and
queued, the first one of an iteration schedules one write of them all at the end of the iteration,
and one ``hiredis.Reader`` parses whatever Redis answers, each reply resolving the next waiting
future (Redis answers the commands of one connection in order).

- A caller that stops waiting (cancelled, timed out) leaves its future behind: its reply is still
  read, and dropped, so the next reply goes to the next command. (A command whose caller stopped
  waiting before the iteration's write still goes out, as a pooled command already sent does.)
- An error reply (``ResponseError`` and its kinds: ``NoScriptError``, ...) goes to its own command
  only; the connection stays in step. So does a reply that does not decode (``UnicodeDecodeError``).
- A lost connection fails every command waiting on it with ``redis.exceptions.ConnectionError``
  (the API answers 503); each one is then sent again on a new connection under the client's retry
  policy (the same ``Retry`` the pooled commands follow: a Redis restart costs no 503), and past it
  the error reaches the caller. A connection that cannot be opened fails the same way.
- With a ``socket_timeout`` (``?socket_timeout=`` in the Redis URL) a connection on which Redis has
  answered nothing for that long is closed and its commands fail with ``TimeoutError``, as a pooled
  command's read times out; without one, as with the pool, commands wait for Redis.
- At most ``max_in_flight`` commands are sent and not yet answered or wait for the connection to
  open (the pool's size: a stalled Redis holds as many commands as it held connections); a command
  that finds them all taken waits up to the pool's timeout for one, then fails as a command that
  finds the pool exhausted does (``ConnectionError``, 503).

Only the commands in :data:`MULTIPLEXED` take this way: they neither block nor change the state of
the connection they run on. Everything else (blocking reads, pipelines and transactions, pub/sub,
``SELECT`` or ``CLIENT``) takes a connection of the client's pool as before. The shared connection
counts as one of that pool's connections (the pool keeps one fewer), so the process still opens at
most ``max_connections`` connections for short commands.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
from typing import Any

import hiredis
import redis.asyncio
import redis.exceptions
from redis._parsers import BaseParser
from redis.asyncio.connection import Connection, UnixDomainSocketConnection
from redis.asyncio.retry import Retry
from redis.client import EMPTY_RESPONSE, NEVER_DECODE
from redis.connection import HiredisRespSerializer

from service.limits import wait_in_line, wake

# Commands that neither block nor leave state on their connection: any interleaving of them on one
# connection gives each the reply it would get on a connection of its own.
MULTIPLEXED = frozenset(
    {
        "DEL", "EVAL", "EVALSHA", "EXISTS", "EXPIRE", "GET", "HDEL", "HGET", "HGETALL", "HINCRBY",
        "HMGET", "HSET", "INCR", "INCRBY", "LLEN", "LPUSH", "LRANGE", "PEXPIRE", "PING", "PTTL",
        "RPUSH", "SCRIPT LOAD", "SET", "TIME", "TTL", "XADD", "XLEN", "XRANGE", "XREVRANGE", "ZADD",
        "ZCARD", "ZRANGE", "ZREM", "ZSCORE",
    }
)  # fmt: skip

_NOT_ENOUGH_DATA = object()  # hiredis.Reader.gets() until a whole reply has arrived
# RESP3's out-of-band messages: no command's reply (none is asked for; dropped if one arrives).
_PUSH = getattr(hiredis, "PushNotification", ())


async def _ignore(error: Exception) -> None:
    pass  # a failed connection has failed every command on it already


def _pack(args: tuple[Any, ...]) -> bytes:
    """``args`` in the Redis protocol, as redis-py's hiredis serializer packs them."""
    name = args[0]
    if " " in name:  # "SCRIPT LOAD": two words of the protocol
        args = (*name.split(), *args[1:])
    try:
        return hiredis.pack_command(args)
    except TypeError:
        # bytearray and memoryview arguments, or a type nothing packs (redis-py's DataError)
        return b"".join(HiredisRespSerializer().pack(*args))


class MultiplexedRedis(redis.asyncio.Redis):
    """redis-py's asyncio client whose :data:`MULTIPLEXED` commands go through a :class:`Multiplexer`
    (when its pool's connections can be: plain TCP or a Unix socket, a password or none);
    every other call is redis-py's own, on the pool."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._mux = Multiplexer.for_pool(self.connection_pool)

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        name = args[0]
        mux = self._mux
        if mux is None or name not in MULTIPLEXED or NEVER_DECODE in options:
            return await super().execute_command(*args, **options)
        # What redis-py's parse_response does with a reply.
        try:
            response = await mux.execute(_pack(args))
        except redis.exceptions.ResponseError:
            if EMPTY_RESPONSE in options:
                return options[EMPTY_RESPONSE]
            raise
        callback = self.response_callbacks.get(name)
        if callback is None:
            return response
        options.pop(EMPTY_RESPONSE, None)
        options.pop("keys", None)
        value = callback(response, **options)
        return await value if inspect.isawaitable(value) else value

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        if self._mux is not None:
            self._mux.close()
        await super().aclose(close_connection_pool)


class Multiplexer:
    """One connection to Redis shared by every command given to :meth:`execute` (see the module)."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 6379,
        path: str | None = None,
        db: int = 0,
        protocol: int = 2,
        username: str | None = None,
        password: str | None = None,
        client_name: str | None = None,
        encoding: str | None = None,
        encoding_errors: str = "strict",
        connect_timeout: float | None = None,
        socket_timeout: float | None = None,
        retry: Retry | None = None,
        max_in_flight: int = 64,
        wait_timeout: float = 5.0,
    ) -> None:
        self.host, self.port, self.path = host, port, path
        self.connect_timeout = connect_timeout
        self.socket_timeout = socket_timeout
        self.retry = retry
        self.max_in_flight = max_in_flight
        self.wait_timeout = wait_timeout
        reader_args: dict[str, Any] = {
            "protocolError": redis.exceptions.InvalidResponse,
            "replyError": BaseParser.parse_error,  # the exception class of each error, as redis-py's
            "notEnoughData": _NOT_ENOUGH_DATA,
        }
        if encoding:
            reader_args.update(encoding=encoding, errors=encoding_errors)
        self._reader_args = reader_args
        # What a new connection sends before any command, as redis-py's connection sends it.
        self._handshake: list[tuple[Any, ...]] = []
        if protocol == 3:
            auth = ("AUTH", username or "default", password) if password or username else ()
            self._handshake.append(("HELLO", 3, *auth))
        elif password or username:
            self._handshake.append(("AUTH", username, password) if username else ("AUTH", password))
        if db:
            self._handshake.append(("SELECT", db))
        if client_name:
            self._handshake.append(("CLIENT SETNAME", client_name))
        self._connection: _Connection | None = None
        self._connecting: asyncio.Future[_Connection] | None = None
        self._slot_waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._opening = 0  # commands in flight that wait for the connection to open (see _in_line)
        self._closed = False

    @classmethod
    def for_pool(cls, pool: Any) -> Multiplexer | None:
        """A multiplexer to the Redis of ``pool``, with the settings of its connections, holding one
        of them (``pool.max_connections`` drops by one); None when ``pool``'s connections are of a
        kind it does not open (TLS, a credential provider) or the pool has only one."""
        if pool.connection_class not in (Connection, UnixDomainSocketConnection) or pool.max_connections < 2:
            return None
        like = pool.connection_class(**pool.connection_kwargs)  # never connected: its settings, resolved
        if like.credential_provider is not None or str(like.protocol or 2) not in ("2", "3"):
            return None
        in_flight = pool.max_connections
        pool.max_connections -= 1
        encoder = like.encoder
        return cls(
            host=getattr(like, "host", "localhost"),
            port=int(getattr(like, "port", 6379)),
            path=getattr(like, "path", None),
            db=int(like.db or 0),
            protocol=int(like.protocol or 2),
            username=like.username,
            password=like.password,
            client_name=like.client_name,
            encoding=encoder.encoding if encoder.decode_responses else None,
            encoding_errors=encoder.encoding_errors,
            connect_timeout=like.socket_connect_timeout,
            socket_timeout=like.socket_timeout,
            retry=like.retry,
            max_in_flight=in_flight,
            wait_timeout=getattr(pool, "timeout", None) or 5.0,
        )

    async def execute(self, packed: bytes) -> Any:
        """The reply to one packed command (an error reply raised)."""
        connection = self._connection
        if connection is None or len(connection.pending) + self._opening >= self.max_in_flight:
            await self._slot()  # its ConnectionError is not sent again, as the pool's is not
            connection = None
        try:
            if connection is None:
                connection = await self._in_line()
            return await connection.send(packed)
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as e:
            if self.retry is None:
                raise
            return await self._again(packed, e)

    async def _again(self, packed: bytes, error: Exception) -> Any:
        """``packed`` sent again after ``error`` as the client's retry policy resends a pooled command:
        the policy counts ``error`` as its first failure (and raises it if it is of a kind it does
        not retry)."""
        failed = [error]

        async def attempt() -> Any:
            if failed:
                raise failed.pop()
            return await (await self._in_line()).send(packed)

        assert self.retry is not None
        return await self.retry.call_with_retry(attempt, _ignore)

    async def _slot(self) -> None:
        """Wait until fewer than ``max_in_flight`` commands are unanswered (see the module)."""
        deadline = asyncio.get_running_loop().time() + self.wait_timeout
        while self._in_flight() >= self.max_in_flight:
            await wait_in_line(self._slot_waiters, deadline)

    def _in_flight(self) -> int:
        connection = self._connection
        return self._opening + (len(connection.pending) if connection is not None else 0)

    async def _in_line(self) -> _Connection:
        """The shared connection, for a command that counts among those in flight while it waits for
        the connection to open: commands that arrive meanwhile wait for a place (without it, every
        command of a stall that began as the connection opened waited for Redis)."""
        connection = self._connection
        if connection is not None and not connection.lost:
            return connection
        self._opening += 1
        try:
            # Its caller sends at once (nothing awaited in between): it moves into ``pending``.
            return await self._connected()
        except BaseException:
            wake(self._slot_waiters, 1)  # after the count below drops: its place is free
            raise
        finally:
            self._opening -= 1

    async def _connected(self) -> _Connection:
        """The shared connection, opened (once, for every command waiting for it) if there is none."""
        if self._closed:
            raise redis.exceptions.ConnectionError("the Redis client is closed")
        connection = self._connection
        if connection is not None and not connection.lost:
            return connection
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._open())
            self._connecting.add_done_callback(self._opened)
        # Shielded: a caller cancelled while waiting does not cancel the others' connection.
        return await asyncio.shield(self._connecting)

    def _opened(self, opening: asyncio.Future[_Connection]) -> None:
        self._connecting = None
        # (A failure is retrieved here, and raised in each command that waited for the connection.)
        if not opening.cancelled() and opening.exception() is None and not opening.result().lost:
            self._connection = opening.result()

    async def _open(self) -> _Connection:
        loop = asyncio.get_running_loop()
        where = self.path or f"{self.host}:{self.port}"
        connection = _Connection(self, hiredis.Reader(**self._reader_args), where)
        try:
            async with asyncio.timeout(self.connect_timeout):
                if self.path:
                    await loop.create_unix_connection(lambda: connection, self.path)
                else:
                    await loop.create_connection(lambda: connection, self.host, self.port)
                for command in self._handshake:
                    await connection.send(_pack(command))
        except TimeoutError:
            connection.close()
            raise redis.exceptions.TimeoutError(f"Timeout connecting to {where}") from None
        except OSError as e:
            connection.close()
            raise redis.exceptions.ConnectionError(f"Error connecting to {where}: {e}") from None
        except redis.exceptions.ResponseError as e:
            connection.close()
            raise redis.exceptions.ConnectionError(f"Redis at {where} refused the connection: {e}") from e
        except BaseException:
            connection.close()
            raise
        return connection

    def close(self) -> None:
        """Close the connection; commands waiting on it fail, later ones too."""
        self._closed = True
        if self._connection is not None:
            self._connection.close()
        if self._connecting is not None:
            self._connecting.cancel()


class _Connection(asyncio.Protocol):
    """One connection of a :class:`Multiplexer`: commands queued, written once an iteration, and the
    futures waiting for their replies, oldest first."""

    def __init__(self, mux: Multiplexer, reader: Any, where: str) -> None:
        self.mux = mux
        self.reader = reader
        self.where = where
        self.pending: collections.deque[asyncio.Future[Any]] = collections.deque()
        self.out: list[bytes] = []
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self.loop = asyncio.get_running_loop()
        self._answered = 0  # replies read so far (the stall check compares it)
        self._watch: asyncio.TimerHandle | None = None

    def send(self, packed: bytes) -> asyncio.Future[Any]:
        """Queue ``packed``; the future of its reply."""
        if self.lost:
            raise redis.exceptions.ConnectionError(f"Connection to {self.where} lost")
        future = self.loop.create_future()
        if not self.out:
            self.loop.call_soon(self._flush)  # after every callback ready in this iteration
        self.out.append(packed)
        self.pending.append(future)
        if self._watch is None and self.mux.socket_timeout:
            self._watch = self.loop.call_later(self.mux.socket_timeout, self._check, self._answered)
        return future

    def _flush(self) -> None:
        out = self.out
        if self.lost or self.transport is None:
            out.clear()  # their futures failed with the connection
            return
        self.transport.write(out[0] if len(out) == 1 else b"".join(out))
        out.clear()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        reader = self.reader
        reader.feed(data)
        pending = self.pending
        answered = 0
        try:
            while True:
                try:
                    reply = reader.gets()
                except UnicodeDecodeError as e:
                    # Not in the client's encoding: that command's error, as a pooled command raises
                    # it. hiredis raises it once the whole reply is read: the next one is in step.
                    reply = e
                if reply is _NOT_ENOUGH_DATA:
                    break
                if isinstance(reply, _PUSH):
                    continue
                future = pending.popleft()
                answered += 1
                if future.done():
                    continue  # its caller stopped waiting: the reply is dropped
                if isinstance(reply, Exception):
                    future.set_exception(reply)
                else:
                    future.set_result(reply)
        except (redis.exceptions.InvalidResponse, IndexError) as e:
            # Out of step with Redis (a reply nobody asked for, or not the protocol): start again.
            self._fail(redis.exceptions.ConnectionError, f"Protocol error from {self.where}: {e!r}")
        self._answered += answered
        # (The replies to a new connection's handshake free no place: it is not the shared one yet.)
        if self.mux._slot_waiters and self.mux._connection is self:
            wake(self.mux._slot_waiters, answered)

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(
            redis.exceptions.ConnectionError, f"Connection to {self.where} lost: {exc or 'closed by the server'}"
        )

    def _check(self, answered: int) -> None:
        """``socket_timeout`` after the watch began: a connection that answered nothing since, with
        commands waiting, is stalled."""
        self._watch = None
        if self.lost or not self.pending:
            return
        if self._answered == answered:
            self._fail(redis.exceptions.TimeoutError, f"Timeout reading from {self.where}")
            return
        self._watch = self.loop.call_later(self.mux.socket_timeout or 0, self._check, self._answered)

    def _fail(self, kind: type[Exception], message: str) -> None:
        """Close the connection; every command waiting on it raises ``kind``."""
        if not self.lost:
            self.lost = True
            if self.mux._connection is self:
                self.mux._connection = None
            if self._watch is not None:
                self._watch.cancel()
                self._watch = None
            if self.transport is not None:
                self.transport.abort()
        pending = list(self.pending)
        self.pending.clear()
        self.out.clear()
        for future in pending:
            if not future.done():
                future.set_exception(kind(message))
        wake(self.mux._slot_waiters, len(self.mux._slot_waiters))

    def close(self) -> None:
        self._fail(redis.exceptions.ConnectionError, f"Connection to {self.where} closed")
