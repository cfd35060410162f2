"""``ckptconv serve --workers N``: the API in N processes that share one listening socket and take
its connections in turn.

uvicorn's own multi-process mode lets every process accept from the shared socket as fast as it
can. A client pool that opens its connections at once (50 from a load balancer or a load test)
then lands mostly on whichever process woke first: 44 against 6 of 50 connections was measured
here, and 50 against 0, and that process's requests queue behind each other while the other
process idles. Its tail latency is the service's.

Here each process accepts one connection at a time and holds back while it serves more connections
than the least busy of its siblings that are serving (live counts in shared memory). It holds back
for at most ``HOLD_BACK_SECONDS`` per connection, so a slow sibling delays a new connection by that
much at worst. A sibling that is starting, shutting down or dead is not waited for, nor one whose
event loop has not run for ``STALE_SECONDS`` (each process notes in shared memory when its loop last
ran); one that has not run for ``HANG_SECONDS`` (stopped, deadlocked) is killed. A process that
dies is started again in its slot; SIGHUP restarts them all, one at a time (the API processes
ignore a SIGHUP sent to the whole group and leave it to the supervisor).

Signals to the supervisor: SIGINT, SIGTERM and SIGQUIT stop every process gracefully (each finishes
the requests under way; one still running after uvicorn's graceful-shutdown timeout is killed);
SIGHUP restarts them; SIGUSR1 and SIGUSR2 are logged and ignored, here and in the API processes (a
signal sent to the whole process group must not end them), as uvicorn's own supervisor ignores
them. An API process whose supervisor is gone (killed with SIGKILL, say) stops by itself, as if it
had received SIGTERM: it is never left serving with no one to restart or stop it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import signal
import socket
import time
from collections.abc import Callable
from typing import Any

import uvicorn

log = logging.getLogger("uvicorn.error")

NOT_SERVING = -1  # the count of a process that is starting, or dead: siblings do not wait for it
HOLD_BACK_SECONDS = 0.05  # the longest a new connection waits for a less busy process to take it
RECHECK_SECONDS = 0.001  # how often a process holding back looks again
RESTART_PAUSE_SECONDS = 0.5  # between a process's death and its replacement
BEAT_SECONDS = 0.1  # how often a serving process notes that its event loop runs
STALE_SECONDS = 0.5  # a sibling whose loop has not run for this long is not waited for
HANG_SECONDS = 30.0  # a serving process whose loop has not run for this long is killed and replaced
QUICK_DEATHS = 3  # processes that die this many times in a row within STARTUP_SECONDS: give up
STARTUP_SECONDS = 10.0
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGQUIT)
# Nothing in these processes reopens or reloads anything; by default they would end the process.
IGNORED_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)


class Slots:
    """What the N processes know of each other, in shared memory: per slot, the live connections
    of its process (NOT_SERVING while it starts, shuts down or is dead) and the last time (the
    system's monotonic clock) its event loop ran."""

    def __init__(self, ctx: Any, processes: int) -> None:
        self.counts = ctx.RawArray("q", processes)
        self.beats = ctx.RawArray("d", processes)

    def waits_for(self, slot: int, mine: int) -> list[int]:
        """The siblings of ``slot`` that serve fewer than ``mine`` connections and are not stuck."""
        now = time.monotonic()
        counts, beats = self.counts, self.beats
        return [i for i in range(len(counts)) if i != slot and mine > counts[i] >= 0 and now - beats[i] < STALE_SECONDS]


class CountedConnections(set):
    """uvicorn's set of a process's live connections (``server_state.connections``: protocols add
    themselves when made and discard themselves when lost) that also publishes its size in the
    process's slot of the shared counts."""

    def __init__(self, slots: Slots, slot: int) -> None:
        super().__init__()
        self._counts, self._slot = slots.counts, slot
        self._retired = False

    def add(self, item: Any) -> None:
        super().add(item)
        self._publish()

    def discard(self, item: Any) -> None:
        super().discard(item)
        self._publish()

    def retire(self) -> None:
        """The process takes no more connections (it is shutting down): its siblings stop holding
        back for it while it finishes the connections it has."""
        self._retired = True
        self._counts[self._slot] = NOT_SERVING

    def _publish(self) -> None:
        if not self._retired:
            self._counts[self._slot] = len(self)


class Acceptor:
    """Accepts from a listening socket one connection at a time, while this process is not busier
    than its least busy sibling. Closed like an ``asyncio.Server`` when uvicorn shuts down."""

    def __init__(
        self,
        listener: socket.socket,
        protocol: Callable[[], asyncio.Protocol],
        slots: Slots,
        slot: int,
        connections: set,
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self._listener, self._protocol = listener, protocol
        self._slots, self._slot = slots, slot
        self._opening = 0  # accepted, not yet in ``connections``
        self._held_since: float | None = None
        self._closed = False
        self._resume_handle: asyncio.TimerHandle | None = None
        self._pending: set[asyncio.Task[None]] = set()
        listener.setblocking(False)
        self._beat()
        slots.counts[slot] = len(connections)  # serving from now on: siblings compare themselves with it
        self._loop.add_reader(listener.fileno(), self._readable)

    def _beat(self) -> None:
        self._slots.beats[self._slot] = time.monotonic()
        self._beat_handle = self._loop.call_later(BEAT_SECONDS, self._beat)

    def _busier_than_a_sibling(self) -> bool:
        return bool(self._slots.waits_for(self._slot, self._slots.counts[self._slot] + self._opening))

    def _readable(self) -> None:
        if self._busier_than_a_sibling():
            now = time.monotonic()
            if self._held_since is None:
                self._held_since = now
            if now - self._held_since < HOLD_BACK_SECONDS:
                self._pause(RECHECK_SECONDS)
                return
        self._held_since = None
        try:
            conn, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return  # a sibling took it
        except OSError as e:  # out of file descriptors, say: stop accepting a moment rather than spin
            log.error("accepting a connection failed: %s", e)
            self._pause(0.1)
            return
        conn.setblocking(False)
        self._opening += 1
        task = self._loop.create_task(self._connect(conn))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _connect(self, conn: socket.socket) -> None:
        try:
            await self._loop.connect_accepted_socket(self._protocol, conn)
        except Exception as e:  # the client left at once, say
            log.debug("a connection closed before it was served: %s", e)
            conn.close()
        finally:
            self._opening -= 1

    def _pause(self, seconds: float) -> None:
        self._loop.remove_reader(self._listener.fileno())
        self._resume_handle = self._loop.call_later(seconds, self._resume)

    def _resume(self) -> None:
        self._resume_handle = None
        if not self._closed:
            self._loop.add_reader(self._listener.fileno(), self._readable)
            self._readable()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._beat_handle.cancel()
        if self._resume_handle is not None:
            self._resume_handle.cancel()
        else:
            self._loop.remove_reader(self._listener.fileno())

    async def wait_closed(self) -> None:
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)


class CoalescedWrites:
    """A connection's transport whose writes of one event-loop iteration go out as one (``writelines``:
    one ``writev``). uvicorn writes a response's head and its body separately, two ``send()`` calls
    and two trips through the kernel's loopback or network path per response; here they are one.
    Whatever was written goes out before the transport closes."""

    __slots__ = ("_loop", "_pending", "_transport")

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._pending: list[bytes] = []
        self._loop = asyncio.get_running_loop()

    def write(self, data: bytes) -> None:
        if not self._pending:
            self._loop.call_soon(self._flush)
        self._pending.append(data)

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        if pending and not self._transport.is_closing():
            self._transport.writelines(pending)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def coalescing(protocol_class: type[asyncio.Protocol]) -> type[asyncio.Protocol]:
    """``protocol_class`` (uvicorn's HTTP protocol) writing through :class:`CoalescedWrites`."""

    class Coalescing(protocol_class):  # type: ignore[misc, valid-type]
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(CoalescedWrites(transport))  # type: ignore[arg-type]

    return Coalescing


class BalancedServer(uvicorn.Server):
    """uvicorn's server for one of the N processes: uvicorn starts the application (lifespan, state)
    with no socket of its own, and the :class:`Acceptor` feeds it connections."""

    def __init__(self, config: uvicorn.Config, slots: Slots, slot: int, supervisor: int | None = None) -> None:
        super().__init__(config)
        self._slots, self._slot = slots, slot
        self._supervisor = supervisor  # its pid: once the parent is another process, it is gone

    async def on_tick(self, counter: int) -> bool:
        # Checked every tick (0.1 s): an orphan that went on serving would take connections nobody
        # can stop, and would hold the port against the next supervisor.
        if not self.should_exit and self._supervisor is not None and os.getppid() != self._supervisor:
            log.error("the supervisor [%d] is gone; stopping", self._supervisor)
            self.should_exit = True
        return await super().on_tick(counter)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self.server_state.connections = CountedConnections(self._slots, self._slot)
        await super().startup(sockets=[])
        config, loop = self.config, asyncio.get_running_loop()
        http_protocol = coalescing(config.http_protocol_class)

        def protocol() -> asyncio.Protocol:
            return http_protocol(  # type: ignore[call-arg]
                config=config, server_state=self.server_state, app_state=self.lifespan.state, _loop=loop
            )

        self.servers = []
        for sock in sockets or []:
            # As asyncio's create_server would: the socket takes connections once a process serves it.
            sock.listen(config.backlog)
            self.servers.append(Acceptor(sock, protocol, self._slots, self._slot, self.server_state.connections))

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.server_state.connections.retire()  # type: ignore[attr-defined]
        await super().shutdown(sockets=sockets)


def _run_process(config: uvicorn.Config, listener: socket.socket, slots: Slots, slot: int, supervisor: int) -> None:
    config.configure_logging()
    for sig in IGNORED_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    # SIGHUP sent to the process group is the supervisor's to act on (it restarts the processes one
    # at a time, each finishing its requests); by default it would end every process here at once.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    server = BalancedServer(config, slots, slot, supervisor)
    # uvicorn handles SIGINT and SIGTERM only; SIGQUIT (to the process group, say) is a stop as well.
    signal.signal(signal.SIGQUIT, server.handle_exit)
    with contextlib.suppress(KeyboardInterrupt):
        server.run(sockets=[listener])


def serve(config: uvicorn.Config, *, hang_seconds: float = HANG_SECONDS) -> int:
    """Run ``config.workers`` API processes until SIGINT, SIGTERM or SIGQUIT (SIGHUP restarts them
    one at a time); returns the exit status."""
    listener = config.bind_socket()
    ctx = multiprocessing.get_context("spawn")
    slots = Slots(ctx, config.workers)
    counts, beats = slots.counts, slots.beats
    stopping: list[int] = []
    restarts: list[int] = []
    ignored: list[int] = []
    supervisor = os.getpid()

    def start(slot: int) -> multiprocessing.process.BaseProcess:
        counts[slot] = NOT_SERVING
        process = ctx.Process(target=_run_process, args=(config, listener, slots, slot, supervisor), name=f"api-{slot}")
        process.start()
        log.info("Started API process %d [%d]", slot, process.pid)
        return process

    def stop(sig: int, frame: Any) -> None:
        stopping.append(sig)

    def restart(sig: int, frame: Any) -> None:
        restarts.append(sig)

    def ignore(sig: int, frame: Any) -> None:
        ignored.append(sig)

    previous = {sig: signal.signal(sig, stop) for sig in STOP_SIGNALS}
    previous.update({sig: signal.signal(sig, ignore) for sig in IGNORED_SIGNALS})
    # SIGHUP restarts the processes, as in uvicorn's mode; by default it would end this process alone
    # and leave the API processes serving with no one to restart or stop them.
    previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, restart)
    processes = [start(slot) for slot in range(config.workers)]
    started = [time.monotonic()] * config.workers
    quick_deaths = [0] * config.workers
    to_restart: list[int] = []  # slots whose process is to be stopped and started again, in turn
    retiring: set[int] = set()  # slots whose process was stopped to be started again
    status = 0
    try:
        while not stopping:
            time.sleep(0.2)
            while ignored:
                log.info("Received %s; ignored", signal.Signals(ignored.pop()).name)
            if restarts:
                restarts.clear()
                log.info("Received SIGHUP, restarting the API processes one at a time")
                to_restart = list(range(config.workers))
            # One at a time, once every process serves: the others take the connections meanwhile.
            if to_restart and not retiring and all(counts[slot] >= 0 for slot in range(config.workers)):
                slot = to_restart.pop(0)
                retiring.add(slot)
                processes[slot].terminate()  # SIGTERM: uvicorn finishes what is under way, then stops
            for slot, process in enumerate(processes):
                if process.is_alive() and counts[slot] >= 0 and time.monotonic() - beats[slot] > hang_seconds:
                    # Stopped or stuck (uvicorn's own mode pinged its processes for this): its
                    # connections go nowhere. Replaced as a process that died.
                    log.error("API process %d [%d] has not run for %g s; killing it", slot, process.pid, hang_seconds)
                    process.kill()
                    process.join()
                if process.is_alive() or stopping:
                    continue
                counts[slot] = NOT_SERVING
                if slot in retiring:
                    retiring.discard(slot)
                    processes[slot], started[slot] = start(slot), time.monotonic()
                    continue
                quickly = time.monotonic() - started[slot] < STARTUP_SECONDS
                quick_deaths[slot] = quick_deaths[slot] + 1 if quickly else 0
                log.error("API process %d [%d] exited with %s", slot, process.pid, process.exitcode)
                if quick_deaths[slot] >= QUICK_DEATHS:
                    log.error("API process %d keeps dying at start; stopping", slot)
                    stopping.append(0)
                    status = 3
                    break
                time.sleep(RESTART_PAUSE_SECONDS)
                processes[slot], started[slot] = start(slot), time.monotonic()
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()  # SIGTERM: uvicorn finishes what is under way, then stops
        deadline = time.monotonic() + (config.timeout_graceful_shutdown or 30) + 5
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()
        listener.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return status
