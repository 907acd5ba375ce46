"""Several gateway processes on one port: `whisper-triton gateway --workers N`.

One gateway process reads every live session's audio, runs its speech detector
and sends its hypotheses on one core, which a hundred sessions fill
(docs/benchmarks/live-gpu). Here a parent process binds the listening socket
and starts N worker processes that accept from it, each a whole gateway with
its own connection to Triton; the kernel hands each new connection to one of
them. The live session limit stays one limit: each worker counts its sessions
in an array the processes share (`session_slots.SessionSlots`). The parent starts a
worker again when one dies, with its count reset, since its sessions went with
it; on SIGTERM or SIGINT it stops them all, each finishing what it has in
flight, as one gateway does. A worker whose parent was killed stops by itself.

Each worker makes its app with the factory it is given (`app.create_app`), so
this module needs nothing of the app above it; `serve_until_stopped` runs a lone
gateway process too.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from gateway import session_slots

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

    import fastapi
    import uvicorn

    from gateway.app import GatewaySettings

    # create_app: a module's function, so that it reaches a spawned worker by name.
    AppFactory = Callable[[GatewaySettings, session_slots.SessionSlots], fastapi.FastAPI]

MAX_WORKERS = 64
WATCH_EVERY_S = 0.5
# A worker that ends this soon after its start failed to start: starting it again would only repeat that.
STARTUP_S = 5.0
STOP_TIMEOUT_S = 30.0  # for the sessions and requests in flight to finish, after SIGTERM
PARENT_CHECK_S = 1.0

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Listen:
    host: str
    port: int


def check_workers(workers: int) -> None:
    if not 1 <= workers <= MAX_WORKERS:
        raise ValueError(f"--workers must be between 1 and {MAX_WORKERS}, got {workers}")


def serve(create_app: AppFactory, settings: GatewaySettings, listen: Listen, workers: int) -> int:
    """Run `workers` gateway processes on `listen` until SIGTERM or SIGINT; 0 after a
    graceful stop, 1 when a worker could not start."""
    import uvicorn

    check_workers(workers)
    listener = uvicorn.Config(app=None, host=listen.host, port=listen.port).bind_socket()
    counts = session_slots.session_counts(workers)
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no threads or event loop carried over

    def start(index: int) -> BaseProcess:
        process = context.Process(target=_worker, args=(create_app, settings, listen, listener, counts, index),
                                  name=f"gateway-worker-{index}", daemon=False)
        process.start()
        return process

    stopping = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopping.set())
    processes = [start(index) for index in range(workers)]
    started = [time.monotonic()] * workers
    failed = False
    while not stopping.wait(WATCH_EVERY_S):
        for index, process in enumerate(processes):
            if process.is_alive():
                continue
            with counts.get_lock():
                counts[index] = 0
            if time.monotonic() - started[index] < STARTUP_S:
                log.error("gateway worker %d ended as it started (exit code %s): stopping", index, process.exitcode)
                failed = True
                stopping.set()
                break
            log.warning("gateway worker %d (pid %d) ended with exit code %s: starting another",
                        index, process.pid, process.exitcode)
            processes[index], started[index] = start(index), time.monotonic()
    _stop(processes)
    listener.close()
    return 1 if failed else 0


def _stop(processes: list[BaseProcess]) -> None:
    for process in processes:
        if process.is_alive():
            process.terminate()  # SIGTERM: uvicorn finishes what is in flight
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            log.warning("gateway worker pid %d did not stop in %.0f s: killing it", process.pid, STOP_TIMEOUT_S)
            process.kill()
            process.join()


def _worker(create_app: AppFactory, settings: GatewaySettings, listen: Listen, listener: socket.socket,
            counts: session_slots.SessionCounts, index: int) -> None:
    """One worker process: a whole gateway on the parent's socket, counting its live sessions at `index`."""
    import uvicorn

    threading.Thread(target=_stop_without_parent, args=(os.getppid(),), name="parent-watch", daemon=True).start()
    slots = session_slots.SessionSlots(settings.max_live_sessions, counts, index)
    config = uvicorn.Config(create_app(settings, slots), host=listen.host, port=listen.port, log_level="info")
    serve_until_stopped(uvicorn.Server(config), sockets=[listener])


def _stop_without_parent(parent: int) -> None:
    """A worker whose parent is gone (killed with SIGKILL, it could not stop us) stops as on
    SIGTERM, rather than hold the port with nobody to replace it or stop it."""
    while os.getppid() == parent:
        time.sleep(PARENT_CHECK_S)
    os.kill(os.getpid(), signal.SIGTERM)


class _Stopped(Exception):
    """SIGTERM, raised again by uvicorn once it has shut down gracefully."""


def _raise_stopped(signum: int, frame: object) -> None:
    raise _Stopped()


def serve_until_stopped(server: uvicorn.Server, sockets: list[socket.socket] | None = None) -> None:
    """Serve until SIGINT or SIGTERM, then return once uvicorn has stopped gracefully."""
    # uvicorn finishes the requests in flight on SIGINT or SIGTERM, restores the
    # handlers it found and raises the signal again: these turn it into a clean exit.
    signal.signal(signal.SIGTERM, _raise_stopped)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        server.run(sockets=sockets)
    except (KeyboardInterrupt, _Stopped):
        pass
