"""The remote tier's staging arena: host memory registered once with the Mooncake
client, cut into equal slots that puts and gets borrow (``put_from`` / ``get_into``
move bytes between a slot and the pool with no further copy).  Objects larger than
a slot go through the client's own buffer instead (``put_parts`` / ``get_buffer``)."""

from __future__ import annotations

import queue
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from hybridstore.objects import aligned_empty


class Staging:
    """``slots`` registered slots of ``slot_bytes`` each.

    Args:
        store: the Mooncake client (``register_buffer``).
        total_bytes: the arena's size.
        slots: how many equal slots (concurrent transfers through it).
    """

    def __init__(self, store: object, total_bytes: int, slots: int = 4) -> None:
        self.slot_bytes = (total_bytes // slots) // 4096 * 4096
        self.arena = aligned_empty(self.slot_bytes * slots)
        self.registered = store.register_buffer(self.arena.ctypes.data,     # type: ignore[attr-defined]
                                                self.arena.nbytes) == 0
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(slots):
            self._free.put(i)

    def fits(self, nbytes: int) -> bool:
        """Whether a value of ``nbytes`` goes through a slot."""
        return self.registered and nbytes <= self.slot_bytes

    @contextmanager
    def slot(self) -> Iterator[np.ndarray]:
        """Borrow a slot (waits for one)."""
        i = self._free.get()
        try:
            yield self.arena[i * self.slot_bytes:(i + 1) * self.slot_bytes]
        finally:
            self._free.put(i)
