"""The Mooncake Store client as the remote tier uses it: imported lazily, every call
bounded in time, a master that fails counted down for a while (no call waits on it).

Mooncake's own client retries a dead master for seconds per call (and 20 times at
``setup``); an engine must never wait on that.  :class:`MooncakeClient` therefore

* checks that the master's port accepts a connection *and answers an RPC* before
  ``setup``, in plain Python (the wait releases the GIL): a refused port fails at
  once, a port that accepts but never answers after ``timeout`` (Mooncake's
  ``setup`` holds the GIL and retries such a port for minutes: the whole process
  would stop);
* runs every call on a daemon thread and waits at most ``timeout`` seconds for it
  (a call that does not come back is abandoned: the thread never blocks exit);
* counts the master *down* when a call times out or fails with an RPC error, and for
  ``retry`` seconds then answers :class:`RemoteDown` at once; after that, the
  client's own ``health_check`` (a local flag, no round trip) says when it is back;
* logs why, at most once per ``LOG_EVERY`` seconds (with the number of calls
  refused in between);
* closes every client still open when the interpreter exits (an ``atexit`` hook, while
  threads still run), so that a store left open never waits on a dead master at exit.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import socket
import struct
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from hybridstore.backends.remote.staging import Staging
from hybridstore.errors import BackendIOError, ConfigError, MissingExtraError
from hybridstore.remote_url import RemoteSpec

log = logging.getLogger("hybridstore.remote")

T = TypeVar("T")

PIP_PACKAGE = "mooncake-transfer-engine-non-cuda"
"""The CPU build of Mooncake (``mooncake-transfer-engine`` is the CUDA one)."""

RPC_PROBE = struct.pack("<BBBBIIII", 21, 0, 0, 0, 1, 0xDEADBEEF, 0, 0)
"""A coro_rpc request (magic 21) for a function no master has: a master answers it with
an error reply (magic 21 again) at once."""
OBJECT_NOT_FOUND = -704
TRANSFER_FAIL = -800
LOG_EVERY = 30.0


class RemoteDown(BackendIOError):
    """The master did not answer (or was counted down a moment ago); nothing was done."""


def import_store() -> Any:
    """``mooncake.store``; a typed error naming the pip package when it is missing."""
    try:
        import mooncake.store as store  # noqa: PLR0402  (the import system, not an attribute)
    except ImportError as e:      # the module, or a shared library it needs (libibverbs)
        err = MissingExtraError(
            f"the remote tier needs Mooncake Store: pip install {PIP_PACKAGE} "
            f"(or 'hybridstore[remote]'; Debian/Ubuntu also need: apt-get install libibverbs1); "
            f"importing it failed: {e}", name="mooncake")
        err.extra = "remote"
        raise err from e
    return store


def bounded(fn: Callable[[], T], timeout: float, what: str) -> T:
    """``fn()`` on a daemon thread; ``TimeoutError`` after ``timeout`` seconds (the
    thread is abandoned, never joined), and at once while the interpreter exits (no
    thread starts then: waiting for one would never end)."""
    if sys.is_finalizing():
        raise TimeoutError(f"{what} not attempted: the interpreter is exiting")
    box: list[tuple[bool, Any]] = []
    done = threading.Event()

    def run() -> None:
        try:
            box.append((True, fn()))
        except BaseException as e:  # handed to the caller
            box.append((False, e))
        done.set()

    threading.Thread(target=run, name=f"hybridstore-remote-{what}", daemon=True).start()
    if not done.wait(timeout):
        raise TimeoutError(f"{what} took longer than {timeout:g} s")
    ok, value = box[0]
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]


class MooncakeClient:
    """One Mooncake Store client of one tier (see the module docstring).

    Raises:
        MissingExtraError: Mooncake is not installed.
        ConfigError: the master cannot be reached, or ``setup`` fails.
    """

    def __init__(self, spec: RemoteSpec) -> None:
        self.spec = spec
        module = import_store()
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._down = False
        self.down_events = 0
        self.refused = 0
        self._last_log = -LOG_EVERY
        self._quiet = 0
        _probe(spec)
        store = module.MooncakeDistributedStore()

        def setup() -> int:
            return int(store.setup(spec.hostname, spec.metadata, spec.segment_bytes,
                                   spec.buffer_bytes, spec.protocol, spec.device, spec.master))

        try:
            rc = bounded(setup, max(spec.timeout_s, 10.0), "setup")
        except TimeoutError as e:
            raise ConfigError(f"Mooncake master {spec.master}: setup did not finish ({e})") from None
        if rc != 0:
            raise ConfigError(f"Mooncake master {spec.master}: setup failed with code {rc} "
                              f"(protocol={spec.protocol!r}, metadata={spec.metadata!r})")
        self.store: Any = store
        self.staging = Staging(store, spec.staging_bytes)
        _OPEN.add(self)

    # -- the breaker ------------------------------------------------------------------
    @property
    def available(self) -> bool:
        """Whether calls go to the master now (False while it is counted down)."""
        with self._lock:
            if not self._down:
                return True
            if time.monotonic() < self._down_until:
                return False
        store = self.store
        if store is None:
            return False
        try:
            healthy = bounded(store.health_check, self.spec.timeout_s, "health") == 0
        except Exception:
            healthy = False
        with self._lock:
            if healthy:
                self._down = False
                log.warning("Mooncake master %s answers again", self.spec.master)
            else:
                self._down_until = time.monotonic() + self.spec.retry_s
            return healthy

    def trip(self, reason: str) -> None:
        """Count the master down for ``retry`` seconds; log why (rate-limited)."""
        with self._lock:
            if not self._down:
                self.down_events += 1
            self._down = True
            self._down_until = time.monotonic() + self.spec.retry_s
        self.warn(f"Mooncake master {self.spec.master} is unreachable ({reason}); remote "
                  f"objects are misses, retrying in {self.spec.retry_s:g} s")

    def warn(self, message: str) -> None:
        """Log ``message`` at most once per :data:`LOG_EVERY` seconds."""
        now = time.monotonic()
        with self._lock:
            if now - self._last_log < LOG_EVERY:
                self._quiet += 1
                return
            quiet, self._quiet, self._last_log = self._quiet, 0, now
        log.warning("%s%s", message, f" ({quiet} more since the last message)" if quiet else "")

    # -- calls ------------------------------------------------------------------------
    def call(self, what: str, fn: Callable[[Any], T]) -> T:
        """``fn(store)``, bounded; :class:`RemoteDown` when the master is down or fails.

        An integer result (or list of them) in Mooncake's RPC-failure range
        (-900..-999) counts as a failure too.
        """
        if not self.available:
            with self._lock:
                self.refused += 1
            raise RemoteDown(f"Mooncake master {self.spec.master} is counted down; {what} "
                             "not attempted")
        store = self.store
        if store is None:
            raise RemoteDown(f"the Mooncake client is closed; {what} not attempted")
        try:
            out = bounded(lambda: fn(store), self.spec.timeout_s, what)
        except TimeoutError as e:
            self.trip(str(e))
            raise RemoteDown(f"Mooncake {what}: {e}") from None
        codes = out if isinstance(out, list) else [out]
        if any(isinstance(c, int) and -999 <= c <= -900 for c in codes):
            self.trip(f"{what} returned an RPC error")
            raise RemoteDown(f"Mooncake {what}: RPC error from {self.spec.master}")
        return out

    def close(self) -> None:
        """Close the client.

        Mooncake's ``close`` (and its destructor) holds the GIL: about 2 s with a live
        master, and 15 s or more of retries with a dead one, during which no Python
        thread runs.  With the master counted down the client is therefore left open
        on purpose (its reference count is raised so that no destructor ever runs; the
        master drops it after ``client_ttl``); otherwise it is closed here.
        """
        store, self.store = self.store, None
        if store is None:
            return
        try:
            down = self._down or bounded(store.health_check, self.spec.timeout_s, "health") != 0
        except Exception:
            down = True
        if down:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(store))
            log.warning("Mooncake master %s is down: its client is abandoned, not closed",
                        self.spec.master)
            return
        store.close()


_OPEN: weakref.WeakSet[MooncakeClient] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """Close the clients still open at exit (see the module docstring)."""
    for client in list(_OPEN):
        try:
            client.close()
        except Exception as e:   # exiting: log, never raise
            log.warning("Mooncake client of %s not closed at exit: %s", client.spec.master, e)


def _probe(spec: RemoteSpec) -> None:
    """Fail within ``timeout`` unless the master's port accepts a connection and answers
    an RPC (:data:`RPC_PROBE`) as a Mooncake master does."""
    bound = spec.timeout_s
    try:
        with socket.create_connection((spec.host, spec.port), timeout=bound) as sock:
            sock.settimeout(bound)
            sock.sendall(RPC_PROBE)
            reply = sock.recv(16)
    except TimeoutError:
        raise ConfigError(f"Mooncake master {spec.master} accepted a connection but did not "
                          f"answer an RPC within {bound:g} s: check that it is the master's "
                          f"--rpc_port and that the master is not stuck (or raise the URL's "
                          f"timeout=)") from None
    except OSError as e:
        raise ConfigError(f"Mooncake master {spec.master} is unreachable ({e}); start it "
                          f"with: mooncake_master --rpc_port={spec.port}") from None
    if reply[:1] != RPC_PROBE[:1]:
        raise ConfigError(f"{spec.master} answered, but not as a Mooncake master does "
                          f"({'it closed the connection' if not reply else 'not coro_rpc'}): "
                          "point the URL at mooncake_master's --rpc_port")
