"""`python -m extproc.kvfeed.exporter` as a process: serves metrics, exits cleanly on SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import sys

import aiohttp

from devstack.processes import free_port

from .fakes import FakeInferenceServer, eventually


async def test_process_serves_metrics_and_stops_on_sigterm() -> None:
    server = FakeInferenceServer.from_file("sglang_0.5.10_dp2_tp2.txt")
    await server.start()
    grpc_port, metrics_port = free_port(), free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "extproc.kvfeed.exporter",
        "--node-name=n1",
        f"--grpc-address=127.0.0.1:{grpc_port}",
        f"--metrics-address=127.0.0.1:{metrics_port}",
        "--interval=0.2",
        f"--target=url={server.url},kind=sglang",
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        async with aiohttp.ClientSession() as http:

            async def scraped() -> bool:
                try:
                    async with http.get(f"http://127.0.0.1:{metrics_port}/metrics") as resp:
                        text = await resp.text()
                except aiohttp.ClientError:
                    return False
                return "extproc_exporter_targets_up 1.0" in text

            await eventually(scraped, deadline_s=20.0)
        proc.send_signal(signal.SIGTERM)
        rc = await asyncio.wait_for(proc.wait(), 10)
        assert rc == 0
        assert proc.stderr is not None
        logs = (await proc.stderr.read()).decode()
        assert '"msg": "exporter stopped"' in logs
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await server.stop()
