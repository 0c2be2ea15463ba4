"""Issue 50's hostile tool code against the sandbox (`rlep.services.sandbox`, default limits, real bubblewrap): per
case, the status it gets and how long it took, then how long an honest call takes right after (bound: 2 s) and
whether any process of the sandbox's users is left on the host (bound: 0). Then the service (`rlep serve sandbox`)
under hostile callers: 64 concurrent slow calls, code over the size limits, and the health check meanwhile."""

from __future__ import annotations

import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import psutil

from hostile.common import Service, checked, code_of, health_check_s
from rlep.common.grpc_channel import make_channel
from rlep.sandbox.v1 import sandbox_pb2, sandbox_pb2_grpc
from rlep.services.sandbox.config import SandboxConfig
from rlep.services.sandbox.sandbox import Sandbox

HONEST_BOUND_S = 2.0


def cases(host_port: int, token_path: str) -> dict[str, str]:
    me = os.getpid()
    return {
        "fork bomb": "import os\nwhile True:\n    os.fork()",
        "endless loop": "while True: pass",
        "sleep past the wall clock": "import time; time.sleep(3600)",
        "20 GB allocation": "block = bytearray(20 * 2**30)",
        "socket to 127.0.0.1": f"import socket; socket.create_connection(('127.0.0.1', {host_port}), timeout=2)",
        "socket to a public address": "import socket; socket.create_connection(('1.1.1.1', 80), timeout=2)",
        "read /etc/passwd": "print(open('/etc/passwd').read())",
        "read a token file": f"print(open({token_path!r}).read())",
        "write outside /work": "open('/usr/escape', 'w').write('x')",
        "100 MB print": "print('x' * 100_000_000)",
        "kill the parent": "import os, signal; os.kill(os.getppid(), signal.SIGKILL)",
        "kill a host PID": f"import os, signal; os.kill({me}, signal.SIGKILL)",
        "ctypes kill + setuid": f"import ctypes\nlibc = ctypes.CDLL(None)\nprint(libc.kill({me}, 9), libc.setuid(0))",
    }


def leftovers(config: SandboxConfig) -> int:
    users = range(config.run_as_uid, config.run_as_uid + config.concurrency)
    return sum(1 for p in psutil.process_iter(["uids"]) if p.info["uids"] and p.info["uids"].real in users)


def sandbox_items(work) -> dict:
    config = SandboxConfig(cache_entries=0)
    sandbox = Sandbox(config)
    token = work / "auth-token"
    token.write_text("s3cret-token")
    server = socket.create_server(("127.0.0.1", 0))
    server.setblocking(False)
    out = {}
    try:
        for name, code in cases(server.getsockname()[1], str(token)).items():
            result = sandbox.run(code)
            started = time.monotonic()
            honest = sandbox.run("print(6 * 7)")
            honest_s = time.monotonic() - started
            left = leftovers(config)
            leaked = "s3cret" in result.stdout + result.stderr or "root:" in result.stdout
            out[f"50 sandbox: {name}"] = {
                "status": result.status,
                "seconds": round(result.duration_s, 2),
                "detail": result.detail[:80],
                "secret_or_etc_seen": leaked,
                "honest_call_s": round(honest_s, 3),
                "honest_ok": honest.stdout == "42\n",
                "processes_left": left,
                "bounds": {"honest_call_s": HONEST_BOUND_S, "processes_left": 0},
                "met": honest_s <= HONEST_BOUND_S and left == 0 and honest.stdout == "42\n" and not leaked,
            }
        try:
            server.accept()
            out["50 sandbox: host port reached"] = {"met": False}
        except BlockingIOError:
            out["50 sandbox: host port reached"] = {"connections": 0, "met": True}
    finally:
        server.close()
    out["50 sandbox service: hostile callers"] = service_items()
    return out


def service_items() -> dict:
    """`rlep serve sandbox` (2 slots, 14 calls in the server at most): 64 callers each sending a 3-s sleep at once
    (the ones past the bound get UNAVAILABLE at once, the rest queue and run), the health check's worst answer
    meanwhile, code at and past `max_code_bytes`, a request past `server.max_request_bytes`."""
    service = Service("sandbox", "sandbox.cache_entries=0", "max_wait_s=120")
    stub = sandbox_pb2_grpc.SandboxStub(make_channel(service.address))

    def call(i: int) -> str:
        return code_of(
            lambda: stub.Run(sandbox_pb2.RunRequest(code="import time; time.sleep(3)", caller=f"c{i}"), timeout=150)
        )

    try:
        with ThreadPoolExecutor(64) as pool:
            started = time.monotonic()
            codes = pool.map(call, range(64))
            health = []
            while time.monotonic() - started < 10:
                health.append(health_check_s(service.address) or 99.0)
                time.sleep(0.2)
            codes = list(codes)
        limit = 64 << 10
        figures = {
            "OK": codes.count("OK"),
            "UNAVAILABLE": codes.count("UNAVAILABLE"),
            "other codes": len(codes) - codes.count("OK") - codes.count("UNAVAILABLE"),
            "health_check_worst_s": round(max(health), 3),
            "code at max_code_bytes": code_of(lambda: stub.Run(sandbox_pb2.RunRequest(code="#" * limit), timeout=30)),
            "code past max_code_bytes": code_of(
                lambda: stub.Run(sandbox_pb2.RunRequest(code="#" * (limit + 1)), timeout=30)
            ),
            "2 MiB request": code_of(lambda: stub.Run(sandbox_pb2.RunRequest(code="#" * (2 << 20)), timeout=30)),
        }
    finally:
        service.stop()
    return checked(figures, {"health_check_worst_s": 1.0, "other codes": 0})
