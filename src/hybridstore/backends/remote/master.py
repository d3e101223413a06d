"""A ``mooncake_master`` on a free loopback port: what the tests and ``hybridstore bench
remote`` start (a deployment runs its own: docs/remote.md)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path


def master_binary(name: str = "mooncake_master") -> str | None:
    """A binary the installed Mooncake package ships (``mooncake_master``,
    ``mooncake_client``), or None."""
    try:
        from hybridstore.backends.remote.client import import_store

        store = import_store()
    except ImportError:
        return None
    path = Path(store.__file__).parent / name
    return str(path) if path.exists() else None


def free_port() -> int:
    """A TCP port free on the loopback interface now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Master:
    """A ``mooncake_master`` started on a free loopback port; :meth:`kill` it (SIGKILL),
    :meth:`restart` it (on the same port, with no metadata) or :meth:`stop` it.

    Args:
        binary: the ``mooncake_master`` executable (:func:`master_binary`).
        log_path: where its output goes.
    """

    def __init__(self, binary: str, log_path: Path) -> None:
        self.port = free_port()
        self.binary = binary
        self.log = open(log_path, "wb")  # noqa: SIM115  (closed by stop())
        self._start()

    def _start(self) -> None:
        binary, log_path = self.binary, self.log.name
        self.proc = subprocess.Popen(
            [binary, f"--rpc_port={self.port}", "--rpc_address=127.0.0.1",
             f"--metrics_port={free_port()}", "--default_kv_lease_ttl=100"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with {self.proc.returncode}; "
                                   f"see {log_path}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"mooncake_master did not listen on {self.port} within 20 s")

    def restart(self) -> None:
        """Kill the master and start a fresh one on the same port (it knows no object,
        client or segment of the one before, as after a crash)."""
        self.kill()
        self._start()

    def url(self, **options: object) -> str:
        """``mooncake://127.0.0.1:PORT?options`` of this master."""
        query = "&".join(f"{k}={v}" for k, v in options.items())
        return f"mooncake://127.0.0.1:{self.port}" + (f"?{query}" if query else "")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        _stop(self.proc)
        self.log.close()


class Lender:
    """A ``mooncake_client`` that lends ``segment`` bytes of its memory to the pool of a
    :class:`Master`: objects put there outlive the stores that put them (stores
    then use ``segment=0``)."""

    def __init__(self, master: Master, log_path: Path, segment: str = "256MB") -> None:
        binary = master_binary("mooncake_client")
        if binary is None:
            raise RuntimeError("the Mooncake package ships no mooncake_client")
        self.log = open(log_path, "wb")  # noqa: SIM115  (closed by stop())
        self.proc = subprocess.Popen(
            [binary, f"--global_segment_size={segment}",
             f"--master_server_address=127.0.0.1:{master.port}", "--metadata_server=P2PHANDSHAKE",
             "--host=127.0.0.1", f"--port={free_port()}", "--protocol=tcp"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 20
        while b"Starting real client service" not in log_path.read_bytes():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"mooncake_client did not start; see {log_path}")
            time.sleep(0.05)

    def stop(self) -> None:
        _stop(self.proc)
        self.log.close()


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Terminate a service process; SIGKILL it if it has not exited within 10 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
