"""One admitted request as the KV budget books it (`KvBudget`): its prompt, its expected completion and its
progress, and from those its lifetime footprint and its forecast trajectory. Every part of the budget reads
leases; the ledger (`ledger.py`) alone adds and drops them, so the sum of their footprints stays exact.

Pure: no clock, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from extproc.core.kv.forecast import Steps
from extproc.core.kv.prefix import NO_CHUNKS, PromptChunks

PREFIX_MARGIN_TOKENS = 64
"""The block a shared run's credit is cut to while the engine's block size is unknown (`PromptChunks.credit`):
a multiple of a GPU vLLM's 16 and 32; with the block size from the feed, the engine's block (16 on a GPU's
vLLM, 128 on its CPU build)."""


@dataclass(slots=True)
class Lease:
    """One request booked against a pool's budget, from its admission to its release."""

    prompt: int
    allowance: int
    expected_completion: int
    learner_key: str = ""
    streamed: int = 0
    estimated: int = 0  # completion tokens a caller guessed, unseen (lean profile): footprint only
    sequences: int = 1
    admitted_at: float | None = None
    first_progress: tuple[float, int] | None = None  # (when, streamed) at the first streamed token
    last_progress_at: float | None = None
    chunks: PromptChunks = NO_CHUNKS
    credited: int = 0  # leading chunks other leases pay for (`PrefixIndex`)
    # The engine's whole-block rounding of its sequences' last blocks (`KvBudget.set_block_tokens`).
    slack: int = 0
    block: int = PREFIX_MARGIN_TOKENS  # the engine's block: a shared run is credited in whole blocks
    # A sample since admission counted at least this lease's sequences running (`EngineCorrection`).
    engine_ran: bool = False

    def settled_by(self, before: float) -> bool:
        """Admitted by `before`: long enough ago to be in the engine's gauges (`KvBudget.settle_after`)."""
        return self.admitted_at is not None and self.admitted_at <= before

    @property
    def own_prompt(self) -> int:
        """The prompt's KV this lease is booked for: all of it, less the shared chunks others pay for."""
        return self.prompt - self.chunks.credit(self.credited, self.prompt, self.block)

    @property
    def footprint(self) -> int:
        """What `lifetime` booking charges: prompt (less its credited prefix) + expected completion, never
        less than streamed (or than a caller's estimate of unseen progress)."""
        return self.own_prompt + self.slack + max(self.expected_completion, self.streamed, self.estimated)

    def generated(self, now: float, rate: float | None, delay: float) -> float | None:
        """Completion tokens so far: streamed, else estimated at `rate` tokens per second per sequence
        after `delay` (the pool's pace, see `LearnedPace`); None when unknowable."""
        if self.first_progress is not None:
            return float(self.streamed)
        if self.admitted_at is None or rate is None:
            return None
        running = now - self.admitted_at - delay
        guess = running * rate * self.sequences if running > 0 else 0.0
        if guess < self.streamed:
            guess = float(self.streamed)
        return guess if guess < self.allowance else float(self.allowance)

    def trajectory(self, now: float, rate: float | None, delay: float) -> Steps:
        """This lease's KV from now on, in engine steps: (base, slope, end) as `forecast.Trajectory`."""
        return self._steps(self.generated(now, rate, delay))

    def _steps(self, done: float | None) -> Steps:
        """`trajectory` with `done` completion tokens generated so far (None: unknowable)."""
        if done is None:
            # Nobody knows how far it is: its expected final size, for as long as it may still run.
            return (float(self.footprint), 0.0, self.expected_completion / self.sequences)
        final = float(self.expected_completion)
        if done >= final:
            # Past what was expected: it may run to its allowance (the server enforces that bound).
            final = done if done > self.allowance else float(self.allowance)
        return (self.own_prompt + self.slack + done, float(self.sequences), (final - done) / self.sequences)

    def pieces(self, now: float, rate: float | None, delay: float) -> tuple[Steps, ...]:
        """What the forecast books for this lease (`forecast_peaks`): its trajectory, held at its expected
        final size until its allowance's end where it is expected to stop short of the allowance.

        An expected completion below the allowance is a guess from the tenant's history (`kv_credit`),
        one the tenant can train down. Forecast to end at the guess, the lease would free its whole
        footprint from the forecast then, and admit a burst whose answers, run to the allowance, hold
        that footprint and more at the peak: on the real engine twelve 1,500-token streams trained to
        stop at 150 had eleven admitted where ten fit (a preemption in CI). Held until the allowance's
        end, it misses at most what it grows past the guess, the credit its tenant is bounded by. The
        forecast still frees it at its allowance's end, and its release frees it at once."""
        expected = self.expected_completion
        done = self.generated(now, rate, delay)
        if expected >= self.allowance:
            return (self._steps(done),)
        if done is None:  # nobody knows how far it is: its expected size while the allowance may last
            return ((float(self.footprint), 0.0, self.allowance / self.sequences),)
        if done >= expected:  # past the guess: its trajectory runs to the allowance already
            return (self._steps(done),)
        held = float(self.own_prompt + self.slack + expected)
        grows = (done - expected, float(self.sequences), (expected - done) / self.sequences)  # 0 at its end
        return ((held, 0.0, (self.allowance - done) / self.sequences), grows)

    def seconds_left(self, now: float, rate: float, delay: float) -> float:
        """Seconds until this lease's forecast end at `rate`, plus the first-token delay still ahead of it
        while it has shown no progress (`retry_after`'s releases)."""
        _, _, end = self.trajectory(now, rate, delay)
        seconds = max(0.0, end) / rate
        if self.first_progress is None and self.admitted_at is not None:
            seconds += max(0.0, delay - (now - self.admitted_at))
        return seconds

    def fit_key(self, now: float | None) -> tuple[float | None, int, int, int, str, int, PromptChunks]:
        """What a decision on this request compared (`KvBudget.would_fit`): an admission with the same key
        right after it books the sum that decision computed."""
        return (
            now,
            self.prompt,
            self.allowance,
            self.expected_completion,
            self.learner_key,
            self.sequences,
            self.chunks,
        )
