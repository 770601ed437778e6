"""Reading a config file safely, and reloading it without taking admission offline.

A config file is operator input, but a ConfigMap edit can still carry a mistake or a hostile paste. Three
things used to hurt the running sidecar:

- *Size and aliases.* YAML aliases let a few hundred bytes stand for 10^9 nodes (the "billion laughs"
  file); building that object, or quoting it in an error, runs out of memory. The file is bounded in bytes
  (`MAX_CONFIG_BYTES`), and its parser events are counted before anything is built: nesting depth, nodes
  and scalar bytes *after* alias expansion (each anchor's expanded size is remembered, so an alias costs
  what it stands for), all in one pass without recursion. A file past a bound is refused cheaply, naming
  the bound, never quoting the content.
- *The event loop.* A reload parsed and validated the file on the event loop: 10^5 tenants (6 MB) stalled
  `/healthz` and admission for tens of seconds. `load_isolated` runs the whole load (read, bounds, YAML,
  validation) in a child Python process, so the sidecar's loop, memory and GIL are untouched; the child
  sends back the validated `Config` (pickled) or the problems, and a child that runs past
  `LOAD_TIMEOUT_S`, exceeds its memory cap or dies is a refused reload, not a crash. Unpickling holds the
  GIL, and 10^5 tenants' limits took 0.5 s at once, so the tenant table comes back in chunks of
  `TENANT_CHUNK` rows, each unpickled in its own turn of the loop and followed by as long a rest
  (`rest_after`), with Python's cyclic collector paused until the table is whole.
- *Exceptions that are not `ConfigError`.* `MemoryError`, `RecursionError` or a too-long integer literal
  (`ValueError`) used to escape the watcher uncounted. Every failure becomes a `ConfigError` that names
  its kind, so the watcher counts it as `refused` in `extproc_config_reloads_total` and logs a bounded line.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import pickle
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

import extproc
from extproc.config.build import collector_paused, parse_config
from extproc.config.errors import ConfigError
from extproc.config.runtime import Config
from extproc.core.limiter.limiter import LimitSpec

MAX_CONFIG_BYTES = 16 << 20
"""Largest config file read (16 MiB: about 2.5 x 10^5 tenants with their own limits)."""
MAX_YAML_NODES = 2_000_000
"""Most YAML nodes after alias expansion (10^5 tenants with two limits each are about 6 x 10^5)."""
MAX_YAML_DEPTH = 64
"""Deepest nesting of mappings and sequences (the schema needs 6)."""
MAX_SCALAR_BYTES = 64 << 20
"""Most characters in scalars after alias expansion (an alias of a large string counts once per use)."""
LOAD_TIMEOUT_S = 120.0
"""How long the child that loads a reloaded file may take (10^5 tenants: about 8 s on a busy machine)."""
TENANT_CHUNK = 4096
"""Tenant rows unpickled per turn of the event loop on a reload (about 20 ms of one busy core)."""
CHILD_MEMORY_BYTES = 4 << 30
"""Address-space cap of that child: whatever slips past the bounds ends in its MemoryError, not ours."""

_PACKAGE_ROOT = str(Path(extproc.__file__).resolve().parent.parent)
"""Where the child finds this same `extproc` package (appended to its path only where it is missing, so
an installed package never shadows anything)."""
_CHILD_MAIN = (
    "import sys\n"
    "if sys.argv[1] not in sys.path: sys.path.append(sys.argv[1])\n"
    "from extproc.config.load import _child\n"
    "sys.exit(_child(sys.argv[2]))\n"
)
_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when PyYAML was built with it


@dataclass(frozen=True)
class YamlBounds:
    """What building one YAML document may cost; checked on its events before anything is built."""

    max_nodes: int = MAX_YAML_NODES
    max_depth: int = MAX_YAML_DEPTH
    max_scalar_bytes: int = MAX_SCALAR_BYTES


def read_bounded(path: str | os.PathLike[str], max_bytes: int = MAX_CONFIG_BYTES) -> str:
    """The file's text, refused past `max_bytes` without reading more than one byte beyond it."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read(max_bytes + 1)
    except OSError as exc:
        raise ConfigError(f"<file>: cannot read {path}: {exc.strerror}") from None
    if len(raw) > max_bytes:
        raise ConfigError(f"<file>: {path} is larger than {max_bytes} bytes, the most a config may be")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"<file>: {path} is not UTF-8 (byte {exc.start})") from None


class _Frame:
    """An open mapping or sequence while counting: its expanded size so far and its anchor."""

    __slots__ = ("anchor", "chars", "nodes")

    def __init__(self, anchor: str | None) -> None:
        self.anchor = anchor
        self.nodes = 1
        self.chars = 0


class _Counter:
    """Expanded size of a YAML stream from its events: nodes and scalar characters, aliases included."""

    def __init__(self, bounds: YamlBounds) -> None:
        self.bounds = bounds
        self.anchors: dict[str, tuple[int, int]] = {}
        self.stack: list[_Frame] = []

    def feed(self, event: yaml.Event) -> None:
        if isinstance(event, yaml.MappingStartEvent | yaml.SequenceStartEvent):
            self.stack.append(_Frame(event.anchor))
            if len(self.stack) > self.bounds.max_depth:
                raise ConfigError(f"<file>: YAML nested deeper than {self.bounds.max_depth} levels")
        elif isinstance(event, yaml.MappingEndEvent | yaml.SequenceEndEvent):
            frame = self.stack.pop()
            self._add(frame.nodes, frame.chars, frame.anchor)
        elif isinstance(event, yaml.ScalarEvent):
            self._add(1, len(event.value), event.anchor)
        elif isinstance(event, yaml.AliasEvent):
            size = self.anchors.get(event.anchor or "")
            if size is None:
                raise ConfigError("<file>: invalid YAML: an alias names an unknown anchor")
            self._add(*size, None)

    def _add(self, nodes: int, chars: int, anchor: str | None) -> None:
        if anchor is not None:
            self.anchors[anchor] = (nodes, chars)
        if self.stack:
            parent = self.stack[-1]
            parent.nodes += nodes
            parent.chars += chars
            nodes, chars = parent.nodes, parent.chars
        if nodes > self.bounds.max_nodes:
            raise ConfigError(
                f"<file>: YAML expands to more than {self.bounds.max_nodes} nodes (aliases included)"
            )
        if chars > self.bounds.max_scalar_bytes:
            raise ConfigError(
                f"<file>: YAML scalars expand to more than {self.bounds.max_scalar_bytes} characters "
                "(aliases included)"
            )


def safe_yaml(text: str, bounds: YamlBounds = YamlBounds(), source: str | None = None) -> Any:
    """`yaml.safe_load`, after checking on the event stream that building the result stays within bounds. A
    syntax error names `source` (the file) where PyYAML would say `"<unicode string>"`."""
    counter = _Counter(bounds)
    try:
        for event in yaml.parse(text, Loader=_LOADER):
            counter.feed(event)
        return yaml.load(text, Loader=_LOADER)  # a safe loader: CSafeLoader or SafeLoader
    except yaml.YAMLError as exc:
        where = str(exc) if source is None else str(exc).replace('"<unicode string>"', f'"{source}"')
        raise ConfigError(f"<file>: invalid YAML: {where}") from None


def load_file(path: str | os.PathLike[str]) -> Config:
    """Read, bound, parse and validate a config file; every failure is a `ConfigError` naming its kind."""
    try:
        data = safe_yaml(read_bounded(path), source=os.fspath(path))
        if data is None:
            # An emptied ConfigMap would otherwise run with no limits; `{}` says "all defaults" on purpose.
            raise ConfigError(f"<file>: {path} holds no YAML document (write {{}} for all defaults)")
        return parse_config(data)
    except ConfigError:
        raise
    except (MemoryError, RecursionError) as exc:
        raise ConfigError(f"<file>: {type(exc).__name__} while loading {path}; nothing applied") from None
    except Exception as exc:  # e.g. ValueError: an integer literal longer than Python converts
        raise ConfigError(f"<file>: cannot load {path}: {type(exc).__name__}") from None


# -- off the event loop ------------------------------------------------------------------------------------


async def load_isolated(path: str | os.PathLike[str], timeout_s: float = LOAD_TIMEOUT_S) -> Config:
    """`load_file` in a child process: the caller's event loop keeps serving while a large file loads."""
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _CHILD_MAIN,
        _PACKAGE_ROOT,
        os.fspath(path),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(child.communicate(), timeout_s)
    except TimeoutError:
        child.kill()
        await child.wait()
        raise ConfigError(
            f"<file>: loading {path} took longer than {timeout_s:g} s; nothing applied"
        ) from None
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            child.kill()
        await child.wait()
        raise
    return await _outcome(path, child.returncode, out, err)


async def _outcome(path: str | os.PathLike[str], returncode: int | None, out: bytes, err: bytes) -> Config:
    """What the child sent back: a validated `Config`, or its problems, or a note that it died."""
    if returncode != 0 or not out:
        last = err.decode("utf-8", "replace").strip().splitlines()[-1:] or [""]
        raise ConfigError(f"<file>: the loader of {path} exited with status {returncode}: {last[0]}")
    try:
        kind, payload, chunks = pickle.loads(out)  # our own child, over our own pipe; chunks stay bytes
    except Exception as exc:  # cut short: the child died while writing
        raise ConfigError(
            f"<file>: the loader of {path} sent back no outcome ({type(exc).__name__})"
        ) from None
    if kind == "problems":
        raise ConfigError(*payload)
    if not isinstance(payload, Config):
        raise ConfigError(f"<file>: the loader of {path} sent back {type(payload).__name__}")
    return await _with_tenants(payload, chunks)


async def _with_tenants(config: Config, chunks: list[bytes]) -> Config:
    """`config` with the tenant rows the child sent apart: one chunk per turn of the loop, each followed by
    a rest (`rest_after`), with the cyclic collector paused meanwhile (`collector_paused`: the heap grows by
    every tenant's objects, and CPython ran a full collection each time it had grown by a quarter)."""
    if not chunks:
        return config
    tenants: dict[str, LimitSpec] = {}
    with collector_paused():
        for chunk in chunks:
            started = time.perf_counter()
            tenants.update(pickle.loads(chunk))
            await rest_after(started)
        started = time.perf_counter()
        config = _tenants_replaced(config, tenants)
    await rest_after(started)
    return config


async def rest_after(started: float) -> None:
    """Leave the event loop idle for as long as the step begun at `started` (`time.perf_counter()`) held it.

    Why not `asyncio.sleep(0)`: a request takes several turns of the loop to be admitted (its messages, its
    count, its lease), and a timer's waiter resumes only on the turn after its timer fires. With steps
    queued back to back, each of those turns waited behind another step, so a request admitted during a
    reload of 10^5 tenants waited for most of the reload (0.4 s here, 1.1 s on a busy CI host). With the loop
    idle half the time, its turns run in the rests, and the reload takes twice as long (about 1 s).
    """
    await asyncio.sleep(max(0.0, time.perf_counter() - started))


def _split_tenants(config: Config) -> tuple[Config, list[bytes]]:
    """`config` without its tenant table, and the table as pickled chunks of `TENANT_CHUNK` rows."""
    rows = list(config.limits.tenants.items())
    if len(rows) <= TENANT_CHUNK:
        return config, []
    chunks = [
        pickle.dumps(rows[i : i + TENANT_CHUNK], protocol=pickle.HIGHEST_PROTOCOL)
        for i in range(0, len(rows), TENANT_CHUNK)
    ]
    return _tenants_replaced(config, {}), chunks


def _tenants_replaced(config: Config, tenants: dict[str, LimitSpec]) -> Config:
    """`config` with `tenants` as its tenant table (the rules admission reads are rebuilt: about 40 µs)."""
    return dataclasses.replace(config, limits=dataclasses.replace(config.limits, tenants=tenants))


def _cap_memory(limit: int = CHILD_MEMORY_BYTES) -> None:
    with contextlib.suppress(ValueError, OSError):
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        if soft == resource.RLIM_INFINITY or soft > limit:
            resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def _child(path: str) -> int:
    """The loading child (`_CHILD_MAIN`). Its stdout carries only the pickled outcome."""
    result = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # whatever a library prints, from Python or native code, goes to stderr
    _cap_memory()
    outcome: tuple[str, Any, list[bytes]]
    try:
        outcome = ("config", *_split_tenants(load_file(path)))
    except ConfigError as exc:
        outcome = ("problems", exc.problems, [])
    with result:
        result.write(pickle.dumps(outcome, protocol=pickle.HIGHEST_PROTOCOL))
    return 0
