"""A real redis-server on a free 127.0.0.1 port in a temp dir, persistence off; start, pause, kill.

The binaries are required: `make test` installs them (scripts/system-deps.sh). A missing one fails the
tests that need it with the command to run, never skips them.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
from pathlib import Path

from devstack.processes import free_port


def binary(name: str) -> str:
    """The path of `redis-server` or `redis-cli`; a clear error when it is not installed."""
    path = shutil.which(name) or (f"/usr/bin/{name}" if os.access(f"/usr/bin/{name}", os.X_OK) else None)
    if path is None:
        raise RuntimeError(
            f"{name} is not installed: run `make system-deps` (apt packages redis-server and redis-tools)"
        )
    return path


class RedisServer:
    """`extra` adds redis-server options (cluster, ACL users). With `tls` (a CA, a server certificate and
    its key) the server listens with TLS only, on `port`."""

    def __init__(
        self, port: int | None = None, extra: tuple[str, ...] = (), tls: tuple[Path, Path, Path] | None = None
    ) -> None:
        self.port = port or free_port()
        self.extra = extra
        self.tls = tls
        self.dir = Path(tempfile.mkdtemp(prefix="extproc-redis-"))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = ["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        if self.tls is None:
            args += ["--port", str(self.port)]
        else:
            ca, cert, key = self.tls
            args += ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(cert)]
            args += [
                "--tls-key-file",
                str(key),
                "--tls-ca-cert-file",
                str(ca),
                "--tls-auth-clients",
                "optional",
            ]
        args += ["--dir", str(self.dir), "--daemonize", "no", "--loglevel", "warning", *self.extra]
        self.proc = subprocess.Popen(
            [binary("redis-server"), *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {err[-2000:]}")
            if self._answers():
                return
            time.sleep(0.02)
        raise RuntimeError("redis-server did not start")

    def _answers(self) -> bool:
        """PING answered (PONG, or NOAUTH when the default user is off)."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as raw:
                sock: socket.socket = raw
                if self.tls is not None:
                    context = ssl.create_default_context(cafile=str(self.tls[0]))
                    context.check_hostname = False
                    sock = context.wrap_socket(raw)
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith((b"+PONG", b"-NOAUTH"))
        except OSError:
            return False

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(5)
        if self.proc is not None and self.proc.stderr is not None:
            self.proc.stderr.close()
        self.proc = None

    def stop(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)
