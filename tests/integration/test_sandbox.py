"""The tool sandbox against the code a policy may write (issue 50, part 2): real bubblewrap, real limits.

Each hostile call gets its own clear status, the host sees none of its effects, and the next honest call runs at
once. Without `bwrap` (scripts/system-deps.sh installs Debian's) the tests skip, saying so.
"""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time

import psutil
import pytest

from rlep.services.sandbox.config import SandboxConfig
from rlep.services.sandbox.executor import run_code
from rlep.services.sandbox.sandbox import Sandbox

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="no `bwrap`: apt-get install bubblewrap to run these"),
]

# The wall-clock bound is generous: on 2 cores busy with other tests, 1 s of CPU took over 5 s of wall time.
# Host users of their own (61000+): under xdist another worker runs sandbox calls as the default 60000+ at the same
# time (test_sandbox_service, test_tool_rollouts), and both the leftover-process scan below and RLIMIT_NPROC count
# per user: sharing them, this file saw the other file's 4 s sleeps as its own leftovers (CI, 2026-11-29).
LIMITS = {"cpu_seconds": 1, "wall_seconds": 20.0, "memory_mb": 256, "max_processes": 8, "cache_entries": 0,
          "run_as_uid": 61000}  # fmt: skip


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    return Sandbox(SandboxConfig(**LIMITS))


def sandbox_processes(config: SandboxConfig) -> list[psutil.Process]:
    """Processes of the sandbox's users still on the host."""
    users = range(config.run_as_uid, config.run_as_uid + config.concurrency)
    return [p for p in psutil.process_iter(["uids"]) if p.info["uids"] and p.info["uids"].real in users]


def assert_healthy(sandbox: Sandbox) -> None:
    """An honest call right after: it runs, fast, and nothing of the last call is left on the host."""
    started = time.monotonic()
    result = sandbox.run("print(6 * 7)")
    assert (result.status, result.stdout) == ("ok", "42\n"), result
    assert time.monotonic() - started < 3.0
    assert not sandbox_processes(sandbox.config)


def test_an_honest_call_runs_as_an_unprivileged_user_in_an_empty_world(sandbox):
    code = "import os, sys; print(os.getuid(), os.getcwd(), sorted(os.listdir('/')), hash('abc'))"
    first, second = sandbox.run(code), sandbox.run(code)
    assert first.status == "ok" and first.exit_code == 0 and first.detail == "" and not first.truncated
    uid, cwd, *listing = first.stdout.split(" ", 2)
    assert (uid, cwd) == (str(sandbox.config.run_as_uid), "/work")  # slot 0's unprivileged user, never root
    assert "etc" not in first.stdout and "root" not in first.stdout and "home" not in first.stdout
    assert first.stdout == second.stdout  # a fixed hash seed: the same output every run (slot 0 both times)


def test_a_fork_bomb_stops_at_the_process_limit(sandbox):
    result = sandbox.run("import os\nwhile True:\n    os.fork()")
    assert result.status in ("error", "killed") and "BlockingIOError" in result.stderr + result.detail, result
    assert result.duration_s < LIMITS["wall_seconds"]
    assert_healthy(sandbox)


def test_an_endless_loop_ends_at_its_cpu_limit_and_a_sleep_at_its_wall_limit(sandbox):
    spinning = Sandbox(SandboxConfig(**LIMITS | {"wall_seconds": 120.0}))  # 2 s of CPU took 16 s on a busy box
    spin = spinning.run("while True: pass")
    # As PID 1 of its namespace the code never gets SIGXCPU: the hard limit's SIGKILL ends it, a second later.
    assert spin.status == "cpu_limit" and spin.signal == 9 and "CPU time" in spin.detail, spin
    napping = Sandbox(SandboxConfig(**LIMITS | {"wall_seconds": 2.0}))
    asleep = napping.run("import time; time.sleep(60)")  # no CPU used: the wall-clock bound ends it
    assert asleep.status == "timeout" and asleep.signal == 9 and 2.0 <= asleep.duration_s < 5.0, asleep
    assert_healthy(sandbox)


def test_a_20_gb_allocation_is_a_memory_error(sandbox):
    result = sandbox.run("block = bytearray(20 * 2**30)")
    assert result.status == "memory_limit" and "MemoryError" in result.stderr, result
    assert_healthy(sandbox)


def test_no_socket_reaches_the_host_or_the_internet(sandbox):
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.5)
    port = server.getsockname()[1]
    try:
        for address in (("127.0.0.1", port), ("1.1.1.1", 80)):
            code = f"import socket\nsocket.create_connection({address!r}, timeout=2)\nprint('connected')"
            result = sandbox.run(code)
            assert result.status == "error" and "connected" not in result.stdout, result
            assert "OSError" in result.stderr or "ConnectionRefusedError" in result.stderr, result
        with pytest.raises(TimeoutError):
            server.accept()  # nothing ever arrived
    finally:
        server.close()
    assert_healthy(sandbox)


def test_host_files_are_out_of_sight_and_out_of_reach(sandbox, tmp_path):
    token = tmp_path / "auth-token"
    token.write_text("s3cret-token")
    for path in ("/etc/passwd", "/etc/shadow", str(token), "/root/.cache/rlep", "/proc/1/root/etc/passwd"):
        result = sandbox.run(f"print(open({path!r}).read())")
        assert result.status == "error" and "s3cret" not in result.stdout + result.stderr, (path, result)
        assert "root:" not in result.stdout
    for path in ("/usr/escape", "/escape", str(tmp_path / "escape")):
        result = sandbox.run(f"open({path!r}, 'w').write('x')")
        assert result.status == "error" and ("Read-only" in result.stderr or "No such file" in result.stderr), result
        assert not os.path.exists(path)
    assert token.read_text() == "s3cret-token"
    assert_healthy(sandbox)


def test_a_100_mb_print_is_cut_at_the_file_limit(sandbox):
    result = sandbox.run("print('x' * 100_000_000)")
    config = sandbox.config
    assert result.status == "output_limit" and result.truncated, result
    assert len(result.stdout) == config.max_output_bytes and set(result.stdout) == {"x"}
    assert_healthy(sandbox)


def test_killing_the_parent_or_the_host_reaches_nothing(sandbox):
    me = os.getpid()
    # The parent is outside the code's PID namespace: getppid() is 0, and kill(0) signals only the code itself.
    parent = sandbox.run("import os, signal; print(os.getppid()); os.kill(os.getppid(), signal.SIGKILL)")
    assert parent.stdout.split()[:1] == ["0"], parent
    host = sandbox.run(f"import os, signal; os.kill({me}, signal.SIGKILL)")  # the host's PID means nothing inside
    assert host.status == "error" and "ProcessLookupError" in host.stderr, host
    through_ctypes = sandbox.run(
        f"import ctypes, signal\nlibc = ctypes.CDLL(None)\nprint(libc.kill({me}, signal.SIGKILL), libc.setuid(0))"
    )
    assert (through_ctypes.status, through_ctypes.stdout) == ("ok", "-1 -1\n"), through_ctypes  # both refused
    assert psutil.pid_exists(me) and psutil.Process(me).status() != psutil.STATUS_ZOMBIE
    assert_healthy(sandbox)


def test_code_past_its_size_limit_or_not_text_is_refused_before_it_runs():
    config = SandboxConfig(**LIMITS, max_code_bytes=1024)
    with pytest.raises(ValueError, match="exceeds sandbox.max_code_bytes"):
        run_code("x = 1\n" * 400, config)
    with pytest.raises(ValueError, match="not valid UTF-8"):
        run_code("print('\ud800')", config)
    with pytest.raises(ValueError, match="NUL"):
        run_code("print(1)\x00", config)


def test_a_caller_with_many_slow_calls_leaves_a_slot_to_another():
    """Caller A queues 4 calls of 1.5 s; B's one call, sent after them, starts in the free slot, not behind A's."""
    sandbox = Sandbox(SandboxConfig(**LIMITS | {"wall_seconds": 10.0}, concurrency=2, per_caller=1))
    slow = [
        threading.Thread(target=sandbox.run, args=(f"import time; time.sleep(1.5); print({i})", "A")) for i in range(4)
    ]
    for thread in slow:
        thread.start()
    deadline = time.monotonic() + 10
    while (sandbox.running(), sandbox.waiting()) != ({"A": 1}, {"A": 3}):  # one runs, 3 wait behind A's one slot
        assert time.monotonic() < deadline, (sandbox.running(), sandbox.waiting())
        threading.Event().wait(0.01)
    started = time.monotonic()
    result = sandbox.run("print('b')", "B")
    waited = time.monotonic() - started
    for thread in slow:
        thread.join()
    assert result.status == "ok" and waited < 1.5, waited  # behind A's queued calls it would wait ~4.5 s


def test_the_same_code_is_answered_from_the_cache():
    sandbox = Sandbox(SandboxConfig(**LIMITS | {"cache_entries": 8, "wall_seconds": 1.0}))
    code = "import random; print(random.random())"  # would differ between runs: the cache answers the second
    first, second = sandbox.run(code), sandbox.run(code)
    assert not first.cached and second.cached and first.stdout == second.stdout
    other = sandbox.run(code + "\n")
    assert not other.cached
    asleep = "import time; time.sleep(60)"  # a timeout depends on the machine: never cached
    assert sandbox.run(asleep).status == "timeout" and not sandbox.run(asleep).cached


def test_calls_start_cleanly_while_other_threads_are_inside_grpc_calls():
    """A tool rollout runs sandbox calls while its Generate calls are in flight. Started with a plain fork (what
    Popen's `user=` makes CPython do), the child ran gRPC's fork handlers and crashed before exec: 2-5 of 300 calls
    came back `killed`, gRPC's poller errors as their stderr (a CI-sized run: 1 of 128 episodes failed)."""
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    server = grpc.server(futures.ThreadPoolExecutor(4))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    stop = threading.Event()

    def keep_calling() -> None:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while not stop.is_set():
                stub.Check(health_pb2.HealthCheckRequest(), timeout=10)

    callers = [threading.Thread(target=keep_calling) for _ in range(4)]
    for caller in callers:
        caller.start()
    config = SandboxConfig(**LIMITS | {"concurrency": 4})
    try:
        with futures.ThreadPoolExecutor(4) as pool:
            results = list(
                pool.map(lambda i: run_code(f"print({i})", config, uid=config.run_as_uid + i % 4), range(300))
            )
    finally:
        stop.set()
        for caller in callers:
            caller.join(10)
        server.stop(0)
    failed = [(r.status, r.stderr[-200:]) for r in results if r.status != "ok"]
    assert not failed, failed
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(300)]
