"""The sandbox as callers use it: `Sandbox.run(code, caller)` with bounded, fair concurrency and a result cache.

Fairness: at most `concurrency` calls run at once and at most `per_caller` of them for one caller, so a caller with
a queue of slow calls leaves the other slots to the rest. Each running call holds a slot, and a slot is a host uid
(`run_as_uid + slot`): the process-count limit counts per user, so concurrent calls do not share it.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import replace

from rlep.services.sandbox.config import SandboxConfig
from rlep.services.sandbox.executor import cache_key, check_code, run_code
from rlep.services.sandbox.types import ToolResult

UNCACHED = ("timeout", "sandbox_failure")  # depend on the machine's load or state, not on the code
GONE_POLL_S = 0.25  # how often a waiting call looks whether its caller left (a free slot wakes it at once)


class SlotTimeout(TimeoutError):
    """No slot was free for the caller within its wait, or the caller left: nothing ran."""


class Sandbox:
    def __init__(self, config: SandboxConfig):
        config.interpreter()  # fail at start, naming the setting, not at the first call
        config.prlimit()
        if os.geteuid() == 0:  # root runs each call as an unprivileged user
            config.setpriv()
        if config.isolation == "bubblewrap":
            config.bubblewrap()
        self.config = config
        self._lock = threading.Condition()
        self._free_slots = list(range(config.concurrency))
        self._running: Counter[str] = Counter()
        self._waiting: Counter[str] = Counter()
        self._cache: OrderedDict[str, ToolResult] = OrderedDict()

    def running(self) -> dict[str, int]:
        """Calls running now, per caller."""
        with self._lock:
            return dict(self._running)

    def waiting(self) -> dict[str, int]:
        """Calls waiting for a slot now, per caller."""
        with self._lock:
            return dict(self._waiting)

    def run(
        self, code: str, caller: str = "", wait_s: float | None = None, gone: Callable[[], bool] | None = None
    ) -> ToolResult:
        """Runs `code` once a slot is free for `caller`; a cached result when the same code ran before under the same
        limits. ValueError, before it waits for a slot, for code the config refuses (not UTF-8, too large, NUL).
        The wait for a slot is bounded by `wait_s` (None: none) and ends when `gone()` says the caller left
        (`SlotTimeout` either way, nothing run); a call that has its slot runs to its own limits."""
        check_code(code, self.config)
        key = cache_key(code, self.config)
        deadline = None if wait_s is None else time.monotonic() + wait_s
        with self._lock:
            if (hit := self._cache.get(key)) is not None:
                self._cache.move_to_end(key)
                return replace(hit, cached=True)
            self._waiting[caller] += 1
            try:
                while not (self._free_slots and self._running[caller] < self.config.per_caller):
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise SlotTimeout(f"no sandbox slot for caller {caller!r} within {wait_s:g} s")
                    if gone is not None and gone():
                        raise SlotTimeout(f"caller {caller!r} left before a slot was free")
                    self._lock.wait(GONE_POLL_S if left is None else min(left, GONE_POLL_S))
            finally:
                self._waiting[caller] -= 1
                if not self._waiting[caller]:
                    del self._waiting[caller]
            slot = min(self._free_slots)  # the lowest free: a lone caller always runs as the same user
            self._free_slots.remove(slot)
            self._running[caller] += 1
        try:
            result = run_code(code, self.config, uid=self.config.run_as_uid + slot)
        finally:
            with self._lock:
                self._free_slots.append(slot)
                self._running[caller] -= 1
                if not self._running[caller]:
                    del self._running[caller]
                self._lock.notify_all()
        if self.config.cache_entries and result.status not in UNCACHED:
            with self._lock:
                self._cache[key] = result
                while len(self._cache) > self.config.cache_entries:
                    self._cache.popitem(last=False)
        return result
