"""Every outcome of a config file change is counted, so a refused edit shows on the dashboard and alerts.

A refused edit used to be logged only: the watcher caught the validation error before the sidecar's counter
saw it, so `extproc_config_reloads_total` only ever counted `applied`. A reload also used to run on the
event loop: a large file stalled `/healthz` and admission for as long as it took to parse, and a YAML bomb
stalled it too, and was logged with its expanded value. Applying the limits of 10^5 tenants then still
held the loop 1-4 s (every key rebuilt at once), and each `/metrics` scrape at that size took seconds and
returned 27 MB (a gauge per configured tenant).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from extproc.app import Sidecar
from extproc.config import MAX_PROBLEM_CHARS, Config, ConfigError, ConfigWatcher, ReloadResult, load_config
from extproc.config.load import load_isolated
from extproc.metrics import MAX_TENANT_KEYS, Metrics
from extproc.store.local import LocalStore
from tests.support.servicer import body_msg, chat, headers_msg
from tests.support.waiting import until

REPO = Path(__file__).resolve().parents[2]
CONFIG: dict[str, Any] = {
    "server": {
        "grpc_listen": "127.0.0.1:0",
        "admin_listen": "127.0.0.1:0",
        "config_poll_seconds": 3600,  # the test calls check() itself
    },
    "limits": {"global": {"max_concurrency": 2}},
}


def write(path: Path, data: Any) -> None:
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)


async def test_watcher_reports_every_outcome(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    write(path, CONFIG)
    results: list[ReloadResult] = []
    fail_next = False

    async def on_change(_config: Config) -> None:
        if fail_next:
            raise RuntimeError("store refused the limits")

    watcher = ConfigWatcher(path, on_change, 3600, on_result=results.append)
    assert await watcher.check() is False and results == []  # unchanged

    write(path, {**CONFIG, "limits": {"global": {"max_concurrency": -1}}})
    assert await watcher.check() is False
    write(path, "limits: [unclosed\n")
    assert await watcher.check() is False
    fail_next = True
    write(path, {**CONFIG, "limits": {"global": {"max_concurrency": 3}}})
    assert await watcher.check() is False
    fail_next = False
    path.unlink()
    assert await watcher.check() is False
    assert await watcher.check() is False  # still gone: reported once, not once per poll
    write(path, {**CONFIG, "limits": {"global": {"max_concurrency": 4}}})
    assert await watcher.check() is True

    assert results == [
        ReloadResult.REFUSED,
        ReloadResult.REFUSED,
        ReloadResult.FAILED,
        ReloadResult.UNREADABLE,
        ReloadResult.APPLIED,
    ]
    assert watcher.reloads == 1 and watcher.failures == 4


@pytest.fixture
async def sidecar(tmp_path: Path) -> AsyncIterator[Sidecar]:
    path = tmp_path / "config.yaml"
    write(path, CONFIG)
    sidecar = Sidecar(config=load_config(path), config_path=path, metrics=Metrics())
    await sidecar.start()
    try:
        yield sidecar
    finally:
        await sidecar.stop(grace_s=0)


def reloads(sidecar: Sidecar) -> dict[str, float]:
    registry = sidecar.metrics.registry
    out: dict[str, float] = {}
    for result in ReloadResult:
        value = registry.get_sample_value("extproc_config_reloads_total", {"result": result.value})
        assert value is not None, f"result={result.value} not exported"
        out[result.value] = value
    return out


async def test_sidecar_counts_each_reload_outcome_from_zero(
    sidecar: Sidecar, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert sidecar.watcher is not None and sidecar.config_path is not None
    path = sidecar.config_path
    # Exported at 0 before anything happens, so increase() over the first refusal is not lost.
    assert reloads(sidecar) == {"applied": 0, "refused": 0, "failed": 0, "unreadable": 0}

    write(path, {**CONFIG, "limits": {"global": {"max_concurrency": "many"}}})
    await sidecar.watcher.check()
    assert reloads(sidecar)["refused"] == 1
    assert sidecar.config.limits.global_.max_concurrency == 2

    async def broken(*_args: object) -> None:
        raise ConnectionError("store went away")

    assert sidecar.store is not None
    monkeypatch.setattr(sidecar.store, "apply_limits", broken)
    write(path, {**CONFIG, "limits": {"global": {"max_concurrency": 5}}})
    await sidecar.watcher.check()
    assert reloads(sidecar)["failed"] == 1
    assert sidecar.config.limits.global_.max_concurrency == 2
    monkeypatch.undo()

    path.unlink()
    await sidecar.watcher.check()
    write(path, {**CONFIG, "limits": {"global": {"max_concurrency": 6}}})
    await sidecar.watcher.check()
    assert reloads(sidecar) == {"applied": 1, "refused": 1, "failed": 1, "unreadable": 1}
    assert sidecar.config.limits.global_.max_concurrency == 6


ENVOY_MESSAGE_TIMEOUT_S = 1.0
"""The bar a loop stall must stay under: the ext_proc `message_timeout` the shipped Envoy configs had (1 s);
they now give 5 s (envoy/envoy.yaml's header), so the bar keeps a fivefold margin."""


def many_tenants(count: int) -> str:
    """The config above with `count` tenants of their own limits (10^5 of them: 6.7 MB), the tenant read
    from `x-tenant-id`."""
    rows = "\n".join(
        f"    t{i:06d}: {{max_concurrency: 4, tokens_per_minute: {1000 + i}}}" for i in range(count)
    )
    head = yaml.safe_dump({"server": CONFIG["server"], "admission": {"tenant": {"header": "x-tenant-id"}}})
    return f"{head}limits:\n  global: {{max_concurrency: 2}}\n  tenants:\n{rows}\n"


class HealthProbe:
    """Probes `/healthz` from another thread, as the kubelet does, and keeps each answer's latency."""

    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}/healthz"
        self.latencies: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="healthz-probe")

    def _run(self) -> None:
        while not self._stop.is_set():
            start = time.perf_counter()
            with urllib.request.urlopen(self.url, timeout=60) as response:
                assert response.status == 200
            self.latencies.append(time.perf_counter() - start)
            self._stop.wait(0.02)

    def start(self) -> None:
        self._thread.start()

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.to_thread(self._thread.join)  # the loop must keep serving the probe's last request


async def test_a_large_reload_keeps_healthz_answering(sidecar: Sidecar) -> None:
    """30,000 tenants (2 MB) used to parse on the event loop for seconds; now the loop barely notices."""
    assert sidecar.watcher is not None and sidecar.config_path is not None and sidecar.admin_port
    sidecar.config_path.write_text(many_tenants(30_000))
    probe = HealthProbe(sidecar.admin_port)
    probe.start()
    try:
        applied = await sidecar.watcher.check()
    finally:
        await probe.stop()
    assert applied is True
    assert len(sidecar.config.limits.tenants) == 30_000
    assert reloads(sidecar)["applied"] == 1
    assert len(probe.latencies) >= 3, probe.latencies  # it kept answering while the file loaded
    assert max(probe.latencies) < ENVOY_MESSAGE_TIMEOUT_S, max(probe.latencies)


class AdmissionProbe:
    """Sends requests through the ext_proc admission path from another thread, as Envoy does, each message
    answered within Envoy's `message_timeout` or counted as timed out; keeps each request's latency."""

    def __init__(self, port: int, tenant: str) -> None:
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.stub = pb_grpc.ExternalProcessorStub(self.channel)
        self.tenant = tenant
        self.latencies: list[float] = []
        self.replies: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="admission-probe")

    def _messages(self) -> Iterator[pb.ProcessingRequest]:
        head = headers_msg("POST", "/v1/chat/completions")
        head.request_headers.headers.headers.add(key="x-tenant-id", raw_value=self.tenant.encode())
        yield head
        yield body_msg(chat(5))

    def _run(self) -> None:
        while not self._stop.is_set():
            start = time.perf_counter()
            call = self.stub.Process(self._messages(), timeout=2 * ENVOY_MESSAGE_TIMEOUT_S)
            try:
                replies = [next(call).WhichOneof("response") for _ in range(2)]
            except grpc.RpcError as err:
                replies = [f"error {err.code().name}"]
            finally:
                call.cancel()  # the client goes away: its lease is settled
            self.latencies.append(time.perf_counter() - start)
            self.replies.append(replies[-1] or "")
            self._stop.wait(0.02)

    def start(self) -> None:
        self._thread.start()

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.to_thread(self._thread.join)
        self.channel.close()


async def test_a_reload_to_many_tenants_keeps_admission_and_metrics_within_envoys_timeout(
    sidecar: Sidecar,
) -> None:
    """10^5 tenants of their own limits: admission and `/healthz` keep answering within Envoy's message
    timeout while the file loads and its limits are applied, and `/metrics` stays small and quick."""
    assert sidecar.watcher is not None and sidecar.config_path is not None and sidecar.admin_port
    assert sidecar.grpc_port
    count = 100_000
    sidecar.config_path.write_text(many_tenants(count))
    health = HealthProbe(sidecar.admin_port)
    admission = AdmissionProbe(sidecar.grpc_port, tenant=f"t{count - 1:06d}")  # a key created on first use
    health.start()
    admission.start()
    try:
        applied = await sidecar.watcher.check()
        await asyncio.sleep(0.5)  # requests judged under the new limits, too
    finally:
        await admission.stop()
        await health.stop()
    assert applied is True and len(sidecar.config.limits.tenants) == count
    assert len(health.latencies) >= 3, health.latencies
    assert max(health.latencies) < ENVOY_MESSAGE_TIMEOUT_S, max(health.latencies)
    assert len(admission.latencies) >= 3, admission.latencies
    assert set(admission.replies) == {"request_body"}, admission.replies  # each admitted, none timed out
    assert max(admission.latencies) < ENVOY_MESSAGE_TIMEOUT_S, max(admission.latencies)
    assert isinstance(sidecar.store, LocalStore)
    limiter = sidecar.store.limiter
    key = f"tenant:{admission.tenant}"
    # The probe's last cancel reaches the server after the probe returns; its settlement follows.
    await until(lambda: limiter.snapshot([key])[0].active == 0, limit_s=5.0)
    (judged,) = limiter.snapshot([key])
    assert judged.max_concurrency == 4 and judged.active == 0  # under its own limits; nothing leaked

    start = time.perf_counter()
    page = await asyncio.to_thread(_scrape, sidecar.admin_port)
    assert time.perf_counter() - start < ENVOY_MESSAGE_TIMEOUT_S
    assert len(page) < 1_000_000, len(page)
    tenants = {
        line.split('"')[1]
        for line in page.splitlines()
        if line.startswith('extproc_limit_scale_ratio{key="tenant:')
    }
    assert 0 < len(tenants) <= MAX_TENANT_KEYS, len(tenants)
    assert 'extproc_limit_concurrency{key="global"} 2.0' in page


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as response:
        body: bytes = response.read()
    return body.decode()


async def test_a_yaml_bomb_reload_is_counted_and_logged_briefly(
    sidecar: Sidecar, caplog: pytest.LogCaptureFixture
) -> None:
    assert sidecar.watcher is not None and sidecar.config_path is not None and sidecar.admin_port
    levels = [f"    l0: &l0 [{', '.join(['lol'] * 10)}]"]
    levels += [f"    l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, 7)]
    sidecar.config_path.write_text(
        "limits:\n  global:\n" + "\n".join(levels) + "\n    max_concurrency: *l6\n"
    )
    probe = HealthProbe(sidecar.admin_port)
    probe.start()
    try:
        with caplog.at_level(logging.ERROR, logger="extproc.config"):
            applied = await sidecar.watcher.check()
    finally:
        await probe.stop()
    assert applied is False
    assert reloads(sidecar)["refused"] == 1
    assert sidecar.config.limits.global_.max_concurrency == 2
    errors = [getattr(record, "error", "") for record in caplog.records]
    assert len(errors) == 1 and "YAML expands to more than" in errors[0], errors
    assert len(errors[0]) <= MAX_PROBLEM_CHARS + 40
    assert max(probe.latencies, default=0.0) < ENVOY_MESSAGE_TIMEOUT_S


@pytest.mark.parametrize("error", [MemoryError, RecursionError, OSError])
async def test_any_loader_failure_is_a_counted_refusal(tmp_path: Path, error: type[BaseException]) -> None:
    path = tmp_path / "config.yaml"
    write(path, CONFIG)
    results: list[ReloadResult] = []

    async def failing(_path: Path) -> Config:
        raise error("x" * 10_000)

    async def on_change(_config: Config) -> None:
        raise AssertionError("nothing may be applied")

    watcher = ConfigWatcher(path, on_change, 3600, on_result=results.append, load=failing)
    write(path, {**CONFIG, "log_level": "debug"})
    assert await watcher.check() is False
    assert results == [ReloadResult.REFUSED]


async def test_the_loading_child_reports_its_failures_as_config_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "config.yaml"
    write(path, CONFIG)
    assert (await load_isolated(path)).limits.global_.max_concurrency == 2
    write(path, {"surprise": 1, "log_levl": "info"})
    with pytest.raises(ConfigError) as err:
        await load_isolated(path)
    assert sorted(err.value.problems) == [
        "log_levl: unknown key (did you mean 'log_level'?)",
        "surprise: unknown key",
    ]
    with pytest.raises(ConfigError, match="took longer than"):
        await load_isolated(path, timeout_s=0.001)
    from extproc.config import load as config_load

    monkeypatch.setattr(config_load, "parse_config", lambda _data: [][0])  # IndexError, a bug
    with pytest.raises(ConfigError, match=r"cannot load .*: IndexError"):
        config_load.load_file(path)

    def exhausted(_data: Any) -> Config:
        raise MemoryError

    monkeypatch.setattr(config_load, "parse_config", exhausted)
    with pytest.raises(ConfigError, match="MemoryError while loading"):
        config_load.load_file(path)


SHIPPED = [REPO / "config" / "local.yaml", *sorted((REPO / "k8s").rglob("config.yaml"))]


async def test_the_child_sends_back_what_an_in_process_load_builds() -> None:
    """The config the sidecar applies after a reload is the one `check-config` and a start would build."""
    for path in SHIPPED:
        assert await load_isolated(path) == load_config(path), path


async def test_a_table_sent_back_in_chunks_arrives_whole(tmp_path: Path) -> None:
    """Past `TENANT_CHUNK` rows the tenant table comes back in pieces; every row, in order, still arrives."""
    from extproc.config.load import TENANT_CHUNK

    path = tmp_path / "c.yaml"
    path.write_text(many_tenants(2 * TENANT_CHUNK + 1))
    loaded = await load_isolated(path)
    assert loaded == load_config(path)
    assert list(loaded.limits.tenants) == [f"t{i:06d}" for i in range(2 * TENANT_CHUNK + 1)]


async def test_a_child_that_dies_is_a_refusal_naming_its_status() -> None:
    from extproc.config.load import _outcome

    with pytest.raises(ConfigError, match="exited with status -9: Killed"):
        await _outcome("c.yaml", -9, b"", b"Traceback...\nKilled\n")
    with pytest.raises(ConfigError, match="sent back no outcome"):
        await _outcome("c.yaml", 0, b"\x80\x05garbage", b"")
