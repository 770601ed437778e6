"""What the lean profile's Lua response reader costs Envoy per streamed chunk, and where that cost lies:
`python -m bench.overhead.lua [--rounds N] [--streams N] [--variants a,b,...] [--before REV]`.

The same slope method as `profiles.py` (CPU per chunk = (CPU per 100-chunk stream - CPU per 10-chunk stream)
/ 90, four clients in a closed loop, chunks 2 ms apart), but every variant runs at once in its own Envoy
(the rendered lean config, the no-op lean processor of `noop_processor.py` answering with the sidecar's
metadata, one shared no-op upstream), and the variants take turns phase by phase, in a rotated order each
round. On a shared machine that is what makes their differences readable: a neighbour's burst lands on every
variant alike instead of on whichever stack happened to run then. CPU is each Envoy's threads' scheduler
run time (`/proc/<pid>/task/*/schedstat`, nanoseconds) over its own phases.

Variants (`VARIANTS`): `envoy` is plain Envoy without ext_proc or Lua (section 2b's baseline); `idle` the
lean stack with a Lua filter that reads no body; `iterate`, `copy` and `copy-set` the steps every reader pays
(resume per chunk, copying the chunk into Lua, one metadata write per chunk); `before` the reader at
`--before` (a git revision), `shipped` extproc/envoyconf/response.lua as it is now and `shipped-nojit` the
same with LuaJIT's compiler off. Requests ask for `stream_options.include_usage`, so the upstream ends each
stream with a usage event the reader strips (the noop admits with `strip`, as the sidecar does when it
injected the option).

`--callgrind` runs each Envoy under valgrind and counts its instructions per phase instead (repeatable to a
fraction of a percent where CPU time on a shared machine varies by tens of percent; kernel time is not
counted, and the Lua reader adds none). It uses one client and chunks 10 ms apart: a slowed Envoy serving
four clients falls behind, reads several upstream writes at once, and the count per chunk then measures
the coalescing, not the reader.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from bench.common import REPO, validate_envoy_config, write_json
from bench.overhead.main import _wait_port, prompt_text
from devstack.envoy import remove_ext_proc, render_envoy_config
from devstack.processes import Ports, Process, envoy_command, free_port, wait_http
from extproc.envoyconf.lean import LUA, lua_source

SHORT, LONG = 10, 100
CHUNK_GAP_MS = 2.0
CLIENTS = 4

_IDLE = "function envoy_on_response(handle) end\n"
_ITERATE = """
function envoy_on_response(handle)
  for chunk in handle:bodyChunks() do end
end
"""
_COPY = """
function envoy_on_response(handle)
  for chunk in handle:bodyChunks() do
    local text = chunk:getBytes(0, chunk:length())
  end
end
"""
_COPY_SET = """
function envoy_on_response(handle)
  local n = 0
  for chunk in handle:bodyChunks() do
    local text = chunk:getBytes(0, chunk:length())
    n = n + 1
    handle:streamInfo():dynamicMetadata():set("extproc.response", "n", n)
  end
end
"""


LUA_PATHS = ("extproc/envoyconf/response.lua", "extproc/lean/response.lua")
"""Where the reader has lived, newest first: a `--before` revision may predate the move to envoyconf/."""


def _at(rev: str) -> str:
    for path in LUA_PATHS:
        shown = subprocess.run(
            ["git", "show", f"{rev}:{path}"], cwd=REPO, capture_output=True, text=True, check=False
        )
        if shown.returncode == 0:
            return shown.stdout
    raise SystemExit(f"{rev}: no Lua response reader at {' or '.join(LUA_PATHS)}")


VARIANTS: dict[str, Callable[[str], str | None]] = {
    "envoy": lambda _rev: None,
    "idle": lambda _rev: _IDLE,
    "iterate": lambda _rev: _ITERATE,
    "copy": lambda _rev: _COPY,
    "copy-set": lambda _rev: _COPY_SET,
    "before": _at,
    "shipped": lambda _rev: lua_source(),
    "shipped-nojit": lambda _rev: "jit.off()\n" + lua_source(),
}


def chat(chunks: int) -> bytes:
    return json.dumps(
        {
            "model": "llama-3-8b",
            "messages": [{"role": "user", "content": prompt_text(64)}],
            "max_tokens": 16,
            "stream": True,
            "stream_options": {"include_usage": True},
            "x_chunks": chunks,
        }
    ).encode()


def _with_lua(config: dict[str, Any], source: str) -> None:
    for listener in config["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for network_filter in chain["filters"]:
                for http_filter in network_filter["typed_config"]["http_filters"]:
                    if http_filter["name"] == LUA:
                        http_filter["typed_config"]["default_source_code"] = {"inline_string": source}


def cpu_ns(pid: int) -> int:
    """Scheduler run time of every thread of `pid`, in nanoseconds (finer than utime's 10 ms ticks)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended between the listing and the read
    return total


@dataclass
class Bench:
    names: list[str]
    before: str
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="bench-lua-")))
    ports: Ports = field(default_factory=Ports.free)
    callgrind: bool = False
    clients: int = CLIENTS
    gap_ms: float = CHUNK_GAP_MS
    processes: dict[str, Process] = field(default_factory=dict)
    envoy_ports: dict[str, int] = field(default_factory=dict)

    def start(self) -> None:
        py = sys.executable
        p = self.ports
        up = Process.start(
            "upstream",
            [
                py,
                "-m",
                "bench.overhead.upstream",
                "--port",
                str(p.upstream),
                "--chunk-gap-ms",
                str(self.gap_ms),
            ],
            self.workdir,
        )
        self.processes["upstream"] = up
        noop = Process.start(
            "processor",
            [py, "-m", "bench.overhead.noop_processor", "--port", str(p.grpc), "--lean"],
            self.workdir,
        )
        self.processes["processor"] = noop
        for name in self.names:
            source = VARIANTS[name](self.before)
            ports = Ports(**{**vars(p), "envoy": free_port(), "envoy_admin": free_port()})
            config = render_envoy_config(ports, profile="inline" if source is None else "lean")
            if source is None:
                remove_ext_proc(config)
            else:
                _with_lua(config, source)
            path = self.workdir / f"envoy-{name}.yaml"
            path.write_text(yaml.safe_dump(config))
            validate_envoy_config(path)
            argv = envoy_command(path, ports.envoy_admin)
            if self.callgrind:
                out = self.workdir / f"callgrind-{name}.out"
                argv = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", *argv]
            self.processes[name] = Process.start(f"envoy-{name}", argv, self.workdir)
            self.envoy_ports[name] = ports.envoy
            wait_http(f"http://127.0.0.1:{ports.envoy_admin}/ready", timeout_s=180, proc=self.processes[name])
        wait_http(f"http://127.0.0.1:{p.upstream}/metrics", proc=up)
        _wait_port(p.grpc, noop)

    def stop(self) -> None:
        for name in [*self.names, "processor", "upstream"]:
            proc = self.processes.pop(name, None)
            if proc is not None:
                proc.stop()

    def phase(self, name: str, chunks: int, streams: int) -> float:
        """Envoy `name`'s CPU µs (with `callgrind`: instructions) per stream over `streams` streamed
        answers of `chunks` chunks."""
        pid = self.processes[name].popen.pid
        url = f"http://127.0.0.1:{self.envoy_ports[name]}/v1/chat/completions"
        if self.callgrind:
            _callgrind_control("--zero", pid)
        before = cpu_ns(pid)
        errors = asyncio.run(closed_loop(url, chat(chunks), streams, self.clients))
        used = self._instructions(name, pid) * 1000 if self.callgrind else cpu_ns(pid) - before
        if errors:
            raise RuntimeError(f"{name}: {errors} of {streams} streams failed")
        return used / 1000 / streams

    def _instructions(self, name: str, pid: int) -> int:
        """Instructions Envoy `name` ran since callgrind was last zeroed, from the dump this writes."""
        _callgrind_control("--dump", pid)
        dumps = self.workdir.glob(f"callgrind-{name}.out.*")
        latest = max(dumps, key=lambda p: int(p.suffix[1:]))
        for line in latest.read_text().splitlines():
            if line.startswith("summary:"):
                return int(line.split()[1])
        raise RuntimeError(f"no summary in {latest}")


def _callgrind_control(option: str, pid: int) -> str:
    out = subprocess.run(["callgrind_control", option, str(pid)], capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"callgrind_control {option} {pid}: {out.stdout} {out.stderr}")
    return out.stdout


async def closed_loop(url: str, body: bytes, total: int, clients: int) -> int:
    remaining, errors = total, 0

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal remaining, errors
        while remaining > 0:
            remaining -= 1
            async with session.post(url, data=body, headers={"content-type": "application/json"}) as resp:
                async for _ in resp.content.iter_any():
                    pass
                errors += resp.status != 200

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=clients)) as session:
        await asyncio.gather(*(client(session) for _ in range(clients)))
    return errors


def run(bench: Bench, rounds: int, streams: int) -> dict[str, Any]:
    names = bench.names
    t0 = time.monotonic()
    slopes: dict[str, list[float]] = {name: [] for name in names}
    try:
        bench.start()
        for name in names:  # warm-up: Lua's JIT, connections, allocator
            bench.phase(name, LONG, bench.clients)
        for r in range(rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                short = bench.phase(name, SHORT, streams)
                long = bench.phase(name, LONG, streams)
                slopes[name].append((long - short) / (LONG - SHORT))
            print(f"lua: round {r + 1}: " + ", ".join(f"{n} {slopes[n][-1]:.1f}" for n in names), flush=True)
    finally:
        bench.stop()
    result = {
        "rounds": rounds,
        "streams": streams,
        "clients": bench.clients,
        "chunks": [SHORT, LONG],
        "chunk_gap_ms": bench.gap_ms,
        "before": bench.before,
        "unit": "instructions" if bench.callgrind else "µs",
        "slopes_per_chunk": slopes,
        "duration_s": time.monotonic() - t0,
    }
    write_json(f"overhead-lua{'-callgrind' if bench.callgrind else ''}.json", result)
    print(table(result))
    return result


def table(data: dict[str, Any]) -> str:
    """Per variant: Envoy µs per chunk (median, min-max over rounds) and its extra over plain Envoy's, paired
    round by round (both measured within seconds of each other)."""
    from bench.common import md_table

    slopes: dict[str, list[float]] = data["slopes_per_chunk"]
    unit = data["unit"]
    base = slopes.get("envoy")
    rows = []
    for name, values in slopes.items():
        extra = [v - b for v, b in zip(values, base, strict=True)] if base else []
        rows.append([name, _spread(values), _spread(extra) if base and name != "envoy" else "-"])
    note = (
        f"{data['rounds']} rounds of {data['streams']} streams per phase, {data['clients']} client(s), "
        f"chunks {data['chunk_gap_ms']:g} ms apart; median (min-max) over rounds.\n\n"
    )
    header = ["variant", f"Envoy {unit}/chunk", f"extra over plain Envoy, {unit}/chunk"]
    return note + md_table(header, rows)


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--streams", type=int, default=40)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--before", default="HEAD", help="git revision of the `before` reader")
    parser.add_argument(
        "--callgrind",
        action="store_true",
        help="count Envoy's instructions under valgrind instead of its CPU time: one client, chunks 10 ms "
        "apart, so that a slowed Envoy still reads each chunk on its own",
    )
    args = parser.parse_args()
    names = args.variants.split(",")
    if args.callgrind:
        bench = Bench(names, args.before, callgrind=True, clients=1, gap_ms=10.0)
    else:
        bench = Bench(names, args.before)
    run(bench, args.rounds, args.streams)
