"""End reports between replicas: an access-log entry that reached a replica which did not admit its request is
handed to the one that did, through the shared store's `Mailbox` (extproc/core/ports.py).

Where the sidecar runs as its own Deployment behind a Service (Envoy Gateway, docs/gateways.md), Envoy's
ext_proc stream and its gRPC access-log stream are two separate connections to that Service, balanced on
their own: the entry that ends a request often reaches another replica than the one holding its lease. The
lease lives in the admitting replica's memory (the reservation, the reading spec, the decode pace), so only
that replica can settle it exactly. Every report key starts with the admitting replica's prefix
(UnseenStreams.expect_report: `<prefix>-<counter>`), so the receiving replica sends the serialized entry to
the owner by that name (with Redis: on the channel `<store.key_prefix>reports:<prefix>`,
extproc/store/redis/mailbox.py), and the owner settles it as if Envoy had sent it there.

The mailbox delivers at most once: an entry sent while the owner is not listening (restarting, the store
unreachable) is lost, and the lease expires by the lean profile's rule (`admission.end_report_wait_seconds`),
as for any lost report. Anyone who can publish on the shared store can forge a report; that is the same
trust as the limiter state kept there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from envoy.data.accesslog.v3 import accesslog_pb2
from google.protobuf.message import DecodeError

from extproc.core.ports import Mailbox

log = logging.getLogger(__name__)

Deliver = Callable[[accesslog_pb2.HTTPAccessLogEntry], None]


class ReportRelay:
    """Sends foreign entries to their owners and delivers this replica's own to `deliver`."""

    def __init__(self, mailbox: Mailbox, own_prefix: str, deliver: Deliver) -> None:
        self.mailbox = mailbox
        self.own_prefix = own_prefix
        self.deliver = deliver
        self.received = 0

    @property
    def published(self) -> int:
        return self.mailbox.published

    @property
    def dropped(self) -> int:
        return self.mailbox.dropped

    async def start(self) -> None:
        await self.mailbox.start(self._received)

    async def close(self) -> None:
        await self.mailbox.close()

    def forward(self, key: str, entry: accesslog_pb2.HTTPAccessLogEntry) -> bool:
        """Hand an entry whose key this replica does not hold to the replica that issued it. False when the
        key is this replica's own (settled already) or names no replica: the entry is then unknown."""
        owner, sep, _ = key.partition("-")
        if not sep or not owner or owner == self.own_prefix or self.mailbox.closed:
            return False
        self.mailbox.send(owner, entry.SerializeToString())
        return True

    def _received(self, payload: bytes) -> None:
        entry = accesslog_pb2.HTTPAccessLogEntry()
        try:
            entry.ParseFromString(payload)
        except DecodeError:
            log.warning("report relay: undecodable entry ignored")
            return
        self.received += 1
        self.deliver(entry)
