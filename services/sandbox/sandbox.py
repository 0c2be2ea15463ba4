"""The sandbox as callers use it: `Sandbox.run(code, caller)` with bounded, fair concurrency and a result cache.

Fairness: at most `concurrency` calls run at once and at most `per_caller` of them for one caller, so a caller with
a queue of slow calls leaves the other slots to the rest. Each running call holds a slot, and a slot is a host uid
(`run_as_uid + slot`): the process-count limit counts per user, so concurrent calls do not share it.
"""

from __future__ import annotations

import os
import threading
from collections import Counter, OrderedDict
from dataclasses import replace

from rlep.services.sandbox.config import SandboxConfig
from rlep.services.sandbox.executor import cache_key, check_code, run_code
from rlep.services.sandbox.types import ToolResult

UNCACHED = ("timeout", "sandbox_failure")  # depend on the machine's load or state, not on the code


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

    def run(self, code: str, caller: str = "") -> ToolResult:
        """Runs `code` once a slot is free for `caller` (blocks until then); a cached result when the same code
        ran before under the same limits. ValueError, before it waits for a slot, for code the config refuses (not
        UTF-8, too large, NUL)."""
        check_code(code, self.config)
        key = cache_key(code, self.config)
        with self._lock:
            if (hit := self._cache.get(key)) is not None:
                self._cache.move_to_end(key)
                return replace(hit, cached=True)
            self._waiting[caller] += 1
            self._lock.wait_for(lambda: self._free_slots and self._running[caller] < self.config.per_caller)
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
