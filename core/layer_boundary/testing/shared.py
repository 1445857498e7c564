"""Process-wide settings changed for the ranks of one test world.

Ranks of a threaded world share a process: when each rank switches a setting on for its part of
a test (an opt-in environment variable, a patched hardware check), the first rank in must apply
it and the last one out restore it, or one rank's exit undoes another's setting mid-run.
`SharedSetting` counts the entries; one instance stands for one setting.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable, Optional

__all__ = ["SharedSetting", "shared_env"]


class SharedSetting:
    """`apply()` on the first entry (its return value is kept), `restore(saved)` on the last exit."""

    def __init__(self, apply: Callable[[], Any], restore: Callable[[Any], None]):
        self._apply, self._restore = apply, restore
        self._lock = threading.Lock()
        self._depth = 0
        self._saved: Any = None

    def __enter__(self) -> "SharedSetting":
        with self._lock:
            if self._depth == 0:
                self._saved = self._apply()
            self._depth += 1
        return self

    def __exit__(self, *exc) -> bool:
        with self._lock:
            self._depth -= 1
            if self._depth == 0:
                self._restore(self._saved)
                self._saved = None
        return False


def shared_env(name: str, value: str, *, after: Optional[Callable[[], None]] = None) -> SharedSetting:
    """The environment variable `name` set to `value` while any rank is inside; `after` runs
    each time it changes (e.g. a registry reset for a plugin switch)."""

    def apply():
        saved = os.environ.get(name)
        os.environ[name] = value
        if after is not None:
            after()
        return saved

    def restore(saved):
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved
        if after is not None:
            after()

    return SharedSetting(apply, restore)
