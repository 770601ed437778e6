"""`python -m extproc.sim` as a subprocess: ready line, serving, clean exit on SIGTERM and SIGINT."""

from __future__ import annotations

import asyncio
import re
import signal
import socket
import subprocess
import sys

import aiohttp
import pytest

from tests.support.sim import chat_body


async def _start(*args: str) -> tuple[asyncio.subprocess.Process, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "extproc.sim",
        "--port",
        "0",
        "--time-scale",
        "100",
        "--log-level",
        "WARNING",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None
    line = (await asyncio.wait_for(proc.stdout.readline(), timeout=30)).decode()
    match = re.search(r"listening on (http://\S+)", line)
    assert match, line
    return proc, match.group(1)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
async def test_subprocess_serves_and_stops_cleanly(sig: signal.Signals) -> None:
    proc, url = await _start("--model", "sub-model", "--num-gpu-blocks", "2048")
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(url + "/health") as resp:
                assert resp.status == 200
            body = chat_body(max_tokens=4)
            body["model"] = "sub-model"
            async with http.post(url + "/v1/chat/completions", json=body) as resp:
                assert (await resp.json())["usage"]["completion_tokens"] == 4
            async with http.get(url + "/metrics") as resp:
                assert 'num_gpu_blocks="2048"' in await resp.text()
        proc.send_signal(sig)
        assert await asyncio.wait_for(proc.wait(), timeout=15) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def test_help_documents_every_knob() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "extproc.sim", "--help"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    for flag in (
        "--host",
        "--port",
        "--model",
        "--max-model-len",
        "--num-gpu-blocks",
        "--time-scale",
        "--overflow",
        "--seed",
        "--oom-restart-seconds",
        "--legacy-kv-metric",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--gpu-memory-utilization",
        "--step-base-ms",
        "--decode-per-seq-ms",
        "--prefill-per-token-ms",
    ):
        assert flag in out


def test_invalid_configuration_exits_with_an_error() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "extproc.sim", "--num-gpu-blocks", "4", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "exceeds KV capacity" in proc.stderr


def test_a_taken_port_is_one_line_not_a_traceback() -> None:
    """Beside a running local stack (its simulator on 8000), a second simulator says so in one line."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "extproc.sim", "--port", str(port), "--log-level", "WARNING"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert proc.returncode == 1, proc.stderr
    assert f"extproc.sim: cannot listen on 127.0.0.1:{port}" in proc.stderr
    assert "Traceback" not in proc.stderr
