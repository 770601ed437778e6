"""Loading a config file, and watching it for changes.

`ConfigWatcher` polls the file for changes. A ConfigMap volume replaces a `..data` symlink atomically, which
inotify on the file itself misses, so the watcher compares the resolved target and its stat on every poll.
A changed file is loaded in a child process within bounds on size and alias expansion
(extproc/config/load.py), so the event loop keeps serving; a new file that fails validation is refused
with a log line and the running config stays.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
from collections.abc import Awaitable, Callable
from enum import StrEnum
from pathlib import Path

from extproc.config.errors import ConfigError, capped
from extproc.config.load import load_file, load_isolated
from extproc.config.runtime import Config
from extproc.config.warnings import log_warnings

log = logging.getLogger("extproc.config")


def load_config(path: str | os.PathLike[str]) -> Config:
    """Read and validate a YAML config file, within the bounds of extproc/config/load.py (size, aliases,
    depth); every failure, `MemoryError` included, is a `ConfigError`."""
    return load_file(path)


def _load_off_loop(path: Path) -> Awaitable[Config]:
    return load_isolated(path)


_FINGERPRINT_BYTES = 64 << 20
"""Bytes of the file hashed to notice a change (past the config size bound the loader refuses it anyway)."""


def _fingerprint(path: Path) -> tuple[str, int, bytes] | None:
    try:
        real = os.path.realpath(path)
        with open(real, "rb") as handle:
            head = handle.read(_FINGERPRINT_BYTES)
            return real, os.fstat(handle.fileno()).st_size, hashlib.sha256(head).digest()
    except OSError:
        return None


class ReloadResult(StrEnum):
    """What became of one changed config file: every outcome is reported, so a refused edit is visible."""

    APPLIED = "applied"
    REFUSED = "refused"  # the file is invalid (YAML or a key): nothing applied
    FAILED = "failed"  # valid, but applying it raised: the running config stays
    UNREADABLE = "unreadable"  # the file vanished or cannot be read (reported once until it is back)


class ConfigWatcher:
    """Polls a config file and hands each valid new version to `on_change`; keeps the old one otherwise.

    `on_result` hears the outcome of every change (the sidecar counts them in `extproc_config_reloads_total`).
    A changed file is loaded off the event loop (`load`: by default a child process, see
    extproc/config/load.py), so admission and `/healthz` keep answering while a large file loads; whatever
    goes wrong there is a counted refusal with a bounded log line.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        on_change: Callable[[Config], Awaitable[None]],
        interval_s: float,
        on_result: Callable[[ReloadResult], None] = lambda _result: None,
        load: Callable[[Path], Awaitable[Config]] = _load_off_loop,
    ) -> None:
        self.path = Path(path)
        self.on_change = on_change
        self.on_result = on_result
        self.load = load
        self.interval_s = interval_s
        self._last = _fingerprint(self.path)
        self._unreadable = False
        self._task: asyncio.Task[None] | None = None
        self.reloads = 0
        self.failures = 0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="config-watcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def check(self) -> bool:
        """Reload if the file changed; returns True when a new config was applied."""
        current = await asyncio.to_thread(_fingerprint, self.path)
        if current is None:
            if not self._unreadable:
                self._unreadable = True
                self._refused(ReloadResult.UNREADABLE, f"cannot read {self.path}")
            return False
        self._unreadable = False
        if current == self._last:
            return False
        self._last = current
        try:
            config = await self.load(self.path)
        except ConfigError as exc:
            self._refused(ReloadResult.REFUSED, str(exc))
            return False
        except Exception as exc:  # the loader itself failed (could not start a process, say)
            self._refused(ReloadResult.REFUSED, capped(f"{type(exc).__name__}: {exc}"))
            return False
        log_warnings(config, self.path)
        try:
            await self.on_change(config)
        except Exception as exc:
            self._refused(ReloadResult.FAILED, capped(f"{type(exc).__name__}: {exc}"), exc)
            return False
        self.reloads += 1
        self.on_result(ReloadResult.APPLIED)
        log.info("config reloaded", extra={"path": str(self.path)})
        return True

    def _refused(self, result: ReloadResult, error: str, exc: BaseException | None = None) -> None:
        self.failures += 1
        self.on_result(result)
        log.error(
            "config reload not applied, keeping the running config",
            extra={"result": result.value, "error": error, "path": str(self.path)},
            exc_info=exc,
        )

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.check()
            except Exception:
                log.exception("config reload failed, keeping the running config")
