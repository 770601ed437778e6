"""The lean profile's admitted requests, whose answers the sidecar never sees: until the proxy reports each
one's end, admission follows them here.

* The end report settles a request (`report`): what Envoy's Lua reader saw, and when the tokens came.
* A request whose ext_proc stream ended waits for its report at most `admission.end_report_wait_seconds`
  (`ended`), then settles as `expired`, charged its share of what the engines generated over its life where
  the feed counts them, else the decode-rate estimate (`InFlight.expire`); at once where the report channel
  is known lost (`ReportChannel`): the channel's death is one event, reported as such, not a miss per lease.
* A request the proxy never forwarded gets no report: Envoy answered 504 when its ext_proc message timer
  fired before the admitting reply landed, so the report key was never applied. Its reply was seen not to
  reach the transport (`InFlight.never_forwarded`), or Envoy's access log says that its ext_proc exchange
  failed (`unforwarded`, by the request's `x-request-id`): at the end of its wait it settles as
  `not_forwarded`, refunded in full, and the report channel does not count it as a miss. The id is not a
  key: a client may send its own, so it only ever refunds a request that ended, whose report never came, and
  that shares its id with a request Envoy itself failed.
* A tick (`TICK_SECONDS`) grows each running request's KV-budget footprint at the pool's decode rate, and
  cuts the requests of a class whose KV watermark is passed (`next_or_cut`: the one rule is
  `InFlight.cut`), since there is no per-chunk check in this profile.

Nothing here knows the wire: the translator hands over the stream's next message as an awaitable, and the
access log hands over the report's fields.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import logging
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TypeVar

from extproc.admission.replies.verdicts import Refusal
from extproc.admission.service import AdmissionService
from extproc.admission.tracking.inflight import InFlight, Seen
from extproc.admission.tracking.reading import ReportedTiming, ResponseReading, facts_of

log = logging.getLogger(__name__)

T = TypeVar("T")

TICK_SECONDS = 0.2
"""How often open lean requests are checked: the KV budget's estimate of their progress, and cuts."""

WARN_EVERY_SECONDS = 60.0
"""At most one warning per minute about leases expiring for want of their end report."""

UNFORWARDED_IDS_KEPT = 10_000
"""The most request ids Envoy recently said it never forwarded that are kept (`UnseenStreams.unforwarded`):
each is kept one end-report wait, so this bounds a flood of message timeouts, not normal traffic."""

MISSES_FOR_LOSS = 3
"""Ended requests in a row whose end report never came before the channel counts as lost. One miss can be a
report dropped in a reconnect; three in a row, with none arriving in between, is a broken path."""


class ChannelState(enum.Enum):
    """What the sidecar knows of Envoy's end-report channel (its gRPC access log)."""

    UP = "up"  # reports arrive, or nothing says they do not (a fresh sidecar: Envoy opens it on first use)
    LOST = "lost"  # no access-log stream is open, or requests keep ending without a report


class ReportChannel:
    """Whether Envoy's end reports reach the sidecar, from two signals only the sidecar has: the access-log
    streams open to it (Envoy keeps one per worker for good, so the last one closing means Envoy went away or
    the path to the sidecar broke) and the ended requests whose report never came. Any report, or a new
    access-log stream, proves the channel again. Shown as `extproc_end_report_channel_up`, counted in
    `extproc_end_report_channel_losses_total{cause}`, and logged on each change."""

    def __init__(self, service: AdmissionService, on_lost: Callable[[], None]) -> None:
        self.service = service
        self.state = ChannelState.UP
        self.streams = 0
        self.ever_connected = False
        """Whether any access-log stream or report has come since start: Envoy opens the stream on its first
        log entry, so its absence says nothing until requests end without reports; then it tells a channel
        that never came up (a misconfigured access log) from one that broke."""
        self._misses = 0
        self._on_lost = on_lost

    @property
    def lost(self) -> bool:
        return self.state is ChannelState.LOST

    def stream_opened(self) -> None:
        self.streams += 1
        self.ever_connected = True
        self._restore("access-log stream opened")

    def stream_closed(self, closing: bool = False) -> None:
        """An access-log stream ended; with none left open (and the sidecar not shutting down) the reports of
        requests ending now have no way in."""
        self.streams = max(0, self.streams - 1)
        if self.streams == 0 and not closing:
            self._lose("stream_closed")

    def reported(self) -> None:
        """An access-log entry arrived (whichever lease it names): the channel works."""
        self._misses = 0
        self.ever_connected = True
        self._restore("end report received")

    def missed(self) -> None:
        """A request's report did not come within the bounded wait."""
        self._misses += 1
        if self._misses >= MISSES_FOR_LOSS:
            self._lose("misses" if self.ever_connected else "never_connected")

    def _lose(self, cause: str) -> None:
        if self.lost:
            return
        self.state = ChannelState.LOST
        metrics = self.service.metrics
        metrics.end_report_channel.set(0)
        self.service.child(metrics.end_report_channel_losses, cause).inc()
        log.warning(
            "end-report channel down: leases are released when their request ends and charged what the "
            "engines counted for them (the decode-rate estimate where the feed has no count; "
            "extproc_unfinished_answers_total{basis}); is Envoy's access log reaching the sidecar's gRPC "
            "port?"
            if cause != "never_connected"
            else "end-report channel never came up: no access-log stream has connected since the sidecar "
            "started and requests end without reports; leases are released when their request ends and "
            "charged what the engines counted for them, else the decode-rate estimate (check the access "
            "logger's cluster in Envoy's config: it must reach the sidecar's gRPC port)",
            extra={"cause": cause, "misses": self._misses, "access_log_streams": self.streams},
        )
        self._on_lost()

    def _restore(self, why: str) -> None:
        if not self.lost:
            return
        self.state = ChannelState.UP
        self._misses = 0
        self.service.metrics.end_report_channel.set(1)
        log.info("end-report channel restored", extra={"reason": why})


class UnseenStreams:
    """The lean profile's in-flight requests (see the module docstring), by the report key each one's end
    report names (`expect_report`): shutdown, the service's retry hints and other replicas' relays find
    them here."""

    def __init__(self, service: AdmissionService) -> None:
        self.service = service
        self._reports: dict[str, InFlight] = {}
        self._report_prefix = secrets.token_hex(4)
        self._report_seq = itertools.count(1)
        service.holders.append(self._reports.values)  # each holds its lease until it settles
        self._cuts: dict[InFlight, asyncio.Future[Refusal]] = {}
        self._task: asyncio.Task[None] | None = None
        self._warned_at: float | None = None
        self._unforwarded: dict[str, float] = {}  # request id -> when Envoy said so (insertion order)
        self.channel = ReportChannel(service, self._expire_ended)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._tick_forever(), name="lean-tick")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    # -- the registry of report keys ----------------------------------------------------------------------

    def expect_report(self, inflight: InFlight) -> str:
        """Register an admitted request whose end the proxy will report, under a key the proxy echoes back.

        The key is the sidecar's own (a per-process random prefix and a counter), never a client-supplied
        request id: a client cannot make its report settle another request's lease, and a report from before
        a restart matches nothing. The request leaves the registry when it settles, whichever way.
        """
        key = f"{self._report_prefix}-{next(self._report_seq)}"
        self._reports[key] = inflight
        inflight.await_report(key, self._forget)
        return key

    @property
    def report_prefix(self) -> str:
        """The prefix of every report key this process issues: names this replica to the others."""
        return self._report_prefix

    def _forget(self, key: str) -> None:
        self._reports.pop(key, None)

    def awaiting_reports(self) -> list[InFlight]:
        """Admitted requests whose end report has not arrived (the lean profile's in-flight requests)."""
        return list(self._reports.values())

    def expire_all(self) -> None:
        """On shutdown after the grace period: the reports still awaited will not come here."""
        for inflight in list(self._reports.values()):
            inflight.expire()

    # -- the end report -------------------------------------------------------------------------------------

    def report(
        self,
        key: str,
        status: int | None,
        reading: ResponseReading,
        timing: ReportedTiming | None = None,
        forwarded: bool = True,
        engine_answered: bool = True,
        passed_bytes: int | None = None,
        engine_unreachable: bool = False,
    ) -> bool:
        """Settle the request `key` names from the proxy's end report: the response code (None: no response
        started), what its reader saw, when the answer's tokens came, and whether any byte of the request was
        sent upstream, and whether the status came from the engine (not made by the proxy after the request
        went upstream), and how many of the answer's bytes passed the proxy, and whether the proxy could not
        connect to any engine for it. False when no request here waits for that key."""
        inflight = self._reports.pop(key, None)
        if inflight is None:
            return False
        admitted = inflight.admitted
        facts = facts_of(status, reading, admitted.request.api, admitted.policy.encoding)
        if not forwarded or not engine_answered or engine_unreachable:
            facts = replace(
                facts,
                forwarded=forwarded,
                engine_answered=engine_answered,
                engine_unreachable=engine_unreachable,
            )
        timed = reading.streamed and timing is not None
        inflight.observe(
            Seen(
                facts,
                responded=facts.upstream_status is not None,
                streamed=reading.streamed,
                decode_s=timing.decode_s if timing is not None and timed else None,
                first_token_after_s=timing.first_token_after_s if timing is not None and timed else None,
                passed_bytes=passed_bytes,
                upstream_s=timing.upstream_s if timing is not None else None,
            )
        )
        inflight.settle()
        return True

    def unforwarded(self, request_id: str) -> None:
        """Envoy's access log says the request with this `x-request-id` failed its ext_proc exchange (the
        message timed out) and so never went upstream; a waiting request with that id, once its wait ends
        without a report, is refunded in full (see the module docstring). Kept one wait, at most
        `UNFORWARDED_IDS_KEPT` of them."""
        now = self.service.clock()
        kept = self._unforwarded
        horizon = now - self.service.rules().end_report_wait_seconds - 1.0
        while kept and (len(kept) >= UNFORWARDED_IDS_KEPT or next(iter(kept.values())) < horizon):
            del kept[next(iter(kept))]
        kept.pop(request_id, None)
        kept[request_id] = now

    def _give_up(self, inflight: InFlight) -> bool:
        """Settle a request whose report will not come: as not forwarded where that is known (refunded in
        full, no report was owed), else as expired. True when a report was owed: a miss."""
        request_id = inflight.request_id
        if request_id is not None and self._unforwarded.pop(request_id, None) is not None:
            inflight.never_forwarded()
        if inflight.known_unforwarded:
            inflight.settle()
            return False
        inflight.expire()
        return True

    # -- the bounded wait -----------------------------------------------------------------------------------

    def ended(self, inflight: InFlight) -> None:
        """The request's ext_proc stream closed, i.e. the HTTP request ended: wait for its end report at
        most `admission.end_report_wait_seconds`, then settle it as expired (at once: channel lost)."""
        inflight.mark_ended()
        if self.channel.lost:
            self._give_up(inflight)
            return
        wait = self.service.rules().end_report_wait_seconds
        asyncio.get_running_loop().call_later(wait, self._expire, inflight, wait)

    def _expire_ended(self) -> None:
        """The channel was just found lost: the requests that ended and still wait will get no report."""
        for inflight in self.awaiting_reports():
            if inflight.ended_at is not None:
                self._give_up(inflight)

    def _expire(self, inflight: InFlight, wait: float) -> None:
        """The bound passed: settle as expired, and say so (at most once a minute: a down access-log path
        expires every lease, and the metric counts them all); a request known never forwarded owed no
        report, and settles as such."""
        if not inflight.awaiting_report:
            return
        if not self._give_up(inflight):
            return
        self.channel.missed()
        now = asyncio.get_running_loop().time()
        if self._warned_at is None or now - self._warned_at >= WARN_EVERY_SECONDS:
            self._warned_at = now
            log.warning(
                "end report missing: lease expired (is Envoy's access log reaching the sidecar?)",
                extra={"wait_seconds": wait, "model": inflight.admitted.model_label},
            )

    # -- following and cutting ------------------------------------------------------------------------------

    async def next_or_cut(self, inflight: InFlight | None, following: Awaitable[T]) -> T | Refusal:
        """`following` (the stream's next message), or a cut decided while the response streams. Only a
        request of a class that can be cut waits on both."""
        can_cut = inflight is not None and inflight.admitted.klass.cut_streams_above_kv is not None
        if inflight is None or not can_cut or not inflight.awaiting_report:
            return await following
        cut: asyncio.Future[Refusal] = asyncio.get_running_loop().create_future()
        self._cuts[inflight] = cut
        step = asyncio.ensure_future(following)
        try:
            await asyncio.wait((step, cut), return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._cuts.pop(inflight, None)
        if step.done():
            cut.cancel()
            return step.result()
        step.cancel()
        return cut.result()

    async def _tick_forever(self) -> None:
        while True:
            await asyncio.sleep(TICK_SECONDS)
            try:
                self.tick()
            except Exception:  # a bug here must not stop the tick for every later request
                log.exception("lean tick failed")

    def tick(self) -> None:
        """Follow every admitted request still running: grow its KV-budget footprint at the decode rate (the
        budget cannot see tokens stream here), and cut it when its class's watermark is passed."""
        budgets: set[str] = set()  # the keys of the budgets followed: a pool's, or one engine's
        for inflight in self.awaiting_reports():
            booking = inflight.admitted.booking
            if booking.follow(inflight.estimate()):
                budgets.add(booking.pool)
            cut = self._cuts.get(inflight)
            if cut is not None and not cut.done():
                refusal = inflight.cut()
                if refusal is not None:
                    cut.set_result(refusal)
        for key in budgets:
            self.service.deps.budget_changed(key)
