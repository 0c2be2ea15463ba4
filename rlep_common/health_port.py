"""A service's health check on a port of its own (`server.health_port`): what probes ask when the data port is busy.

gRPC's Python server takes every call of a port from one completion queue, drained by one thread: under issue 46's
mixed load (64 callers, 60 MB messages among them) a health check on the data port waited behind the others'
events, up to 1.2-2.8 s, while a second server in the same process, with its own queue, answered in 0.06 s
(median) and 0.6 s at most. So the health port is a second gRPC server answering only `grpc.health.v1`'s `Check`,
plaintext (the kubelet's gRPC probe speaks no TLS; the port tells only SERVING or not), asynchronous on a thread
of its own: a caller that never sends its request holds no thread, and every message is at most 1 KiB.

It is not blind to the data port. A watcher checks the data server's own health service every `WATCH_EVERY_S`
through a private Unix socket the data server also listens on (same server, same queue, so the same waits), and
the health port reports what that check last said, for each service name. When the data server has not answered
for `health_stall_s`, the health port says NOT_SERVING (a wedged server is restarted by its liveness probe), and
says so in the log; it reports SERVING again, and logs it, once the data server answers.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import threading
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

log = logging.getLogger(__name__)

WATCH_EVERY_S = 1.0  # how stale a status the health port may report, when the data server answers at once
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
# A health check is a service name: a request or answer of more is refused by gRPC before any code runs.
MAX_MESSAGE_BYTES = 1024
# Connections are closed after this long (calls still open get the grace, then are cancelled): the kubelet opens
# one per probe, and a caller that opens a call and never sends its request holds nothing past it.
MAX_CONNECTION_AGE_MS, MAX_CONNECTION_AGE_GRACE_MS = 10_000, 2_000


def private_socket() -> str:
    """A gRPC target of a Unix socket in a fresh folder only this user can enter (the data server listens there
    too, without TLS: only the health watcher connects)."""
    folder = Path(tempfile.mkdtemp(prefix="rlep-health-"))  # mode 0700
    return f"unix:{folder / 'data.sock'}"


class _CheckOnly(health_pb2_grpc.HealthServicer):
    """`Check` from a table the watcher fills; `Watch` refused (a stream per watcher is what probes do not need).
    Asynchronous: a caller that opens a call and sends nothing holds a coroutine, not one of a few threads."""

    def __init__(self, names: list[str]):
        self.statuses = dict.fromkeys(names, NOT_SERVING)  # nothing is known until the first check
        self.stopping = False

    async def Check(self, request, context):
        status = self.statuses.get(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, "no such service on this health port")
        return health_pb2.HealthCheckResponse(status=NOT_SERVING if self.stopping else status)

    async def Watch(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "the health port answers Check only; Watch the data port")


class HealthPort:
    """The health port's server (asyncio, on a thread and event loop of its own) and its watcher of the data server
    at `data_target`, for `names` ("" and each service's full name)."""

    def __init__(self, host: str, port: int, data_target: str, names: list[str], stall_s: float):
        self._data_target, self._names, self._stall_s = data_target, names, stall_s
        self._servicer = _CheckOnly(names)
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._loop.run_forever, name="health-port", daemon=True)
        self._loop_thread.start()
        self._server = None
        self.port = asyncio.run_coroutine_threadsafe(self._serve(f"{host}:{port}"), self._loop).result(timeout=30)
        self._stop, self._answered = threading.Event(), threading.Event()
        self._channel = grpc.insecure_channel(data_target)  # closed by stop(): cancels a check in flight
        self._thread = threading.Thread(target=self._watch, name="health-port-watch", daemon=True)
        self._thread.start()

    async def _serve(self, address: str) -> int:
        self._server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_connection_age_ms", MAX_CONNECTION_AGE_MS),
                ("grpc.max_connection_age_grace_ms", MAX_CONNECTION_AGE_GRACE_MS),
                ("grpc.so_reuseport", 0),
            ]
        )
        health_pb2_grpc.add_HealthServicer_to_server(self._servicer, self._server)
        port = self._server.add_insecure_port(address)
        if port == 0:
            raise OSError(f"could not bind the health port {address}")
        await self._server.start()
        return port

    def status(self, name: str = "") -> int:
        """What the health port answers for `name` now."""
        return NOT_SERVING if self._servicer.stopping else self._servicer.statuses[name]

    def wait_first_check(self, timeout_s: float) -> bool:
        """Whether the watcher's first check of the data server has answered within `timeout_s`."""
        return self._answered.wait(timeout_s)

    def _watch(self) -> None:
        stub = health_pb2_grpc.HealthStub(self._channel)
        last_answer, stalled = time.monotonic(), False
        while not self._stop.is_set():
            try:
                statuses = {
                    name: stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=self._stall_s).status
                    for name in self._names
                }
            except grpc.RpcError as err:
                if self._stop.is_set():
                    return
                if time.monotonic() - last_answer >= self._stall_s and not stalled:
                    stalled = True
                    log.warning(
                        "health port: NOT_SERVING, the data port's health check has not answered for %.0f s"
                        " (health_stall_s): %s",
                        time.monotonic() - last_answer,
                        err.code().name,
                    )
                    self._servicer.statuses = dict.fromkeys(self._names, NOT_SERVING)
                self._stop.wait(WATCH_EVERY_S)
                continue
            last_answer = time.monotonic()
            if stalled:
                stalled = False
                log.warning("health port: the data port answers again; reporting its status")
            self._servicer.statuses = statuses  # one assignment: a check reads one table or the other
            self._answered.set()
            self._stop.wait(WATCH_EVERY_S)

    def enter_graceful_shutdown(self) -> None:
        """NOT_SERVING for good, at once (the service is stopping)."""
        self._servicer.stopping = True

    def stop(self) -> None:
        self.enter_graceful_shutdown()
        self._stop.set()
        self._channel.close()
        asyncio.run_coroutine_threadsafe(self._server.stop(0), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._loop_thread.join(timeout=5)
        self._thread.join(timeout=5)
        socket_path = Path(self._data_target.removeprefix("unix:"))
        shutil.rmtree(socket_path.parent, ignore_errors=True)
