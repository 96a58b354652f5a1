"""`FaultyMemoryStore`: the in-memory store (`rlgate.store.MemoryStore`) with the failures a real backend only
produces under load or damage, on demand.

- `fail(method, error, times=, after=)`: after `after` more calls of `method` (a `SessionStore` method name)
  succeed, the next `times` calls (None: every call until `heal`) raise `error` (default: StoreError) before
  they touch anything;
- `paused()`: every call waits until the block exits (a store busy behind another process's write lock).

Both hold for every view of the same data (`FaultyMemoryStore(store.data)`: another replica on that store).
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from rlgate.store import MemoryStore, SessionStore, StoreError
from rlgate.store.memory import MemoryData

T = TypeVar("T")


@dataclass
class _Hooks:
    pause: asyncio.Event | None = None  # calls wait while this is set (one waiter event per pause)
    # method -> [error, calls left (None: until healed), calls spared before the first]
    faults: dict[str, list[Any]] = field(default_factory=dict)


_hooks: weakref.WeakKeyDictionary[MemoryData, _Hooks] = weakref.WeakKeyDictionary()


class FaultyMemoryStore(MemoryStore):
    """A `MemoryStore` whose calls fail or wait on demand (see the module docstring)."""

    @property
    def _hooks(self) -> _Hooks:
        return _hooks.setdefault(self.data, _Hooks())

    def fail(self, method: str, error: BaseException | None = None, *, times: int | None = 1, after: int = 0) -> None:
        """Make calls of `method` raise `error` (see the module docstring)."""
        if not callable(getattr(SessionStore, method, None)):
            raise ValueError(f"SessionStore has no method {method!r}")
        error = error or StoreError(f"memory store: injected failure of {method}")
        self._hooks.faults[method] = [error, times, after]

    def heal(self, method: str | None = None) -> None:
        """Stop failing `method` (every method when None)."""
        if method is None:
            self._hooks.faults.clear()
        else:
            self._hooks.faults.pop(method, None)

    @contextlib.asynccontextmanager
    async def paused(self) -> AsyncIterator[None]:
        """Every call on this data waits until the block exits (as behind another process's write lock)."""
        hooks = self._hooks
        if hooks.pause is not None:
            raise RuntimeError("the memory store is paused already")
        hooks.pause = asyncio.Event()
        try:
            yield
        finally:
            pause, hooks.pause = hooks.pause, None
            pause.set()

    async def _call(self, method: str, op: Callable[[], T]) -> T:
        hooks = self._hooks
        while (pause := hooks.pause) is not None:
            await pause.wait()
        fault = hooks.faults.get(method)
        if fault is not None:
            error, left, spared = fault
            if spared > 0:
                fault[2] = spared - 1
            else:
                if left is not None:
                    if left <= 1:
                        hooks.faults.pop(method, None)
                    else:
                        fault[1] = left - 1
                self._open()  # a closed store says so first, as the store itself does
                raise error
        return await super()._call(method, op)


def store_calls(store: FaultyMemoryStore) -> list[str]:
    """The names of the store calls made from now on (the in-memory store runs each through `_call`)."""
    calls: list[str] = []
    run = store._call

    async def counted(method: str, op: Any) -> Any:
        calls.append(method)
        return await run(method, op)

    store._call = counted  # type: ignore[method-assign]
    return calls
