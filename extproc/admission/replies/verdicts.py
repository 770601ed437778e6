"""What the admission core answers at each step of a request's life, free of any wire protocol.

A protocol handler (the ext_proc servicer today) turns each value into its own message: `Forward` into a
CONTINUE with mutations, `Passthrough` into a mode override that stops further messages, `Hold` into an
extension of the proxy's per-message timer, `Refusal` into a direct reply to the client. Keeping the
answers as values means one place decides and any number of profiles translate.
"""

from __future__ import annotations

from dataclasses import dataclass

from extproc.admission.vocabulary.readspec import ReadSpec

Header = tuple[str, str]


@dataclass(frozen=True, slots=True)
class ReportTicket:
    """What the lean profile's proxy needs to report an admitted request's end: the key the report names,
    and how to read the answer (`strip_usage`: drop the usage event the client did not ask for)."""

    key: str
    spec: ReadSpec
    strip_usage: bool


@dataclass(frozen=True, slots=True)
class Forward:
    """Let the message through, optionally with header changes and a replacement body.

    Where the proxy reports the request's end itself (the lean profile), `report` says how, and `metadata`
    holds the name-value pairs the proxy's route turns into headers (`x-ratelimit-*` on the response, the
    backend priority on the upstream request): a translator writes them as they are, deciding nothing.
    """

    set_headers: tuple[Header, ...] = ()
    remove_headers: tuple[str, ...] = ()
    body: bytes | None = None
    report: ReportTicket | None = None
    metadata: tuple[Header, ...] = ()


FORWARD = Forward()
"""Forward unchanged (the common case, shared to avoid an allocation per message)."""


@dataclass(frozen=True, slots=True)
class Passthrough:
    """Not metered here (a free path): no further messages of this request need the sidecar."""


PASSTHROUGH = Passthrough()


@dataclass(frozen=True, slots=True)
class Hold:
    """The decision will take up to `seconds` (the request waits in a queue): extend the proxy's timer."""

    seconds: int


@dataclass(frozen=True, slots=True)
class Refusal:
    """Answer the client directly; the request never reaches (or stops reaching) the upstream.

    `reason` is the bounded label the refusal is counted under (`extproc_requests_total{reason}`);
    `details` is what the proxy logs as the response code details.
    """

    status: int
    body: bytes
    reason: str
    headers: tuple[Header, ...] = ()
    details: str = ""

    @property
    def all_headers(self) -> tuple[Header, ...]:
        """Headers to send: the body is always OpenAI error JSON."""
        return (("content-type", "application/json"), *self.headers)


RequestVerdict = Forward | Passthrough | Refusal
BodyVerdict = Forward | Refusal | Hold
