"""Acceptance statistics over the rounds of one or more generations (spec §9): ``Tally``."""

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator


def source_name(source: str) -> str:
    """A round's source as statistics name it ("" -> "none": nothing proposed)."""
    return source or "none"


@dataclass
class Tally:
    """Running totals; ``add`` one verify round at a time (with its source,
    also counted apart per source: see ``sources``)."""

    rounds: int = 0
    emitted: int = 0
    accepted: int = 0
    drafted: int = 0
    proposals: int = 0  # rounds that verified at least one draft
    slot_proposed: list = field(default_factory=list)
    slot_accepted: list = field(default_factory=list)
    by_source: dict = field(default_factory=dict)  # source name -> Tally of its rounds

    @classmethod
    def of(cls, events: Iterable) -> "Tally":
        """The totals of a stream of ``Event``s."""
        tally = cls()
        for event in events:
            tally.count(event)
        return tally

    def count(self, event) -> None:
        """A step's ``Event`` for one row: a round adds its tokens, accepted
        and verified proposals under its source; a prefill adds nothing."""
        if event.kind == "round":
            self.add(len(event.emitted), event.accepted, len(event.drafted), event.source)

    def add(self, emitted: int, accepted: int, drafted: int, source: str | None = None) -> None:
        """One round: tokens emitted, proposals accepted and verified, and
        where they came from ("draft", a point source's name, "": see ``Event.source``)."""
        if source is not None:
            self.by_source.setdefault(source_name(source), Tally()).add(emitted, accepted, drafted)
        self.rounds += 1
        self.emitted += emitted
        self.accepted += accepted
        self.drafted += drafted
        self.proposals += drafted > 0
        grow = drafted - len(self.slot_proposed)
        if grow > 0:
            self.slot_proposed += [0] * grow
            self.slot_accepted += [0] * grow
        for slot in range(drafted):
            self.slot_proposed[slot] += 1
            self.slot_accepted[slot] += slot < accepted

    @property
    def tau(self) -> float:
        """Mean tokens emitted per verify round (accepted drafts + the target's token)."""
        return self.emitted / self.rounds if self.rounds else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def verify_rate(self) -> float:
        """Emitted tokens per verified token: ``sum(A + 1) / sum(n + 1)``."""
        verified = self.drafted + self.rounds
        return self.emitted / verified if verified else 0.0

    @property
    def drafted_share(self) -> float:
        """Share of rounds that verified drafts (the rest were plain target steps)."""
        return self.proposals / self.rounds if self.rounds else 0.0

    @property
    def per_slot(self) -> list:
        """P(slot j accepted | slot j proposed), slot 0 first."""
        return [a / p if p else 0.0 for a, p in zip(self.slot_accepted, self.slot_proposed)]

    def absorb(self, other: "Tally") -> "Tally":
        """Add ``other``'s rounds to these totals (returns self)."""
        self.rounds += other.rounds
        self.emitted += other.emitted
        self.accepted += other.accepted
        self.drafted += other.drafted
        self.proposals += other.proposals
        grow = len(other.slot_proposed) - len(self.slot_proposed)
        self.slot_proposed += [0] * max(grow, 0)
        self.slot_accepted += [0] * max(grow, 0)
        for slot, (proposed, kept) in enumerate(zip(other.slot_proposed, other.slot_accepted)):
            self.slot_proposed[slot] += proposed
            self.slot_accepted[slot] += kept
        for name, part in other.by_source.items():
            self.by_source.setdefault(name, Tally()).absorb(part)
        return self

    def sources(self) -> dict:
        """Per source ("draft", "copy", "forced", "store", ..., "none"): its rounds, their share of
        all rounds, tau and acceptance over them."""
        return {
            name: {"rounds": part.rounds, "share": part.rounds / self.rounds if self.rounds else 0.0,
                   "tau": part.tau, "acceptance_rate": part.acceptance_rate}
            for name, part in sorted(self.by_source.items())
        }

    def summary(self) -> dict:
        return {
            "rounds": self.rounds,
            "tau": self.tau,
            "acceptance_rate": self.acceptance_rate,
            "verify_rate": self.verify_rate,
            "per_slot_acceptance": self.per_slot,
            "drafted_share": self.drafted_share,
            "sources": self.sources(),
        }

    def sources_line(self) -> str:
        """The per-source statistics in one line of text."""
        return ", ".join(
            f"{name} {part['share']:.0%} of rounds (tau {part['tau']:.2f}, acceptance {part['acceptance_rate']:.0%})"
            for name, part in self.sources().items()
        )


def combined(parts: Iterable[Tally]) -> Tally:
    """The totals of several tallies (e.g. the requests of one reply)."""
    total = Tally()
    for part in parts:
        total.absorb(part)
    return total


class DecodeClock:
    """The steady decoding speed of a stream of ``generate`` events.

    A round's work happens while its first event is produced; the prefill
    and every round in which a kernel was compiled (the one-off cost) are
    left out, so the number is what a person waiting on a warm model sees.
    ``compilations`` reads the kernels compiled so far (``kernel.compilations``).
    """

    def __init__(self, compilations: Callable[[], int]):
        self.compilations = compilations
        self.tokens = 0
        self.seconds = 0.0
        self._counted = False
        self._last_tag = None

    def watch(self, events: Iterable) -> Iterator:
        iterator = iter(events)
        while True:
            compiled, start = self.compilations(), time.perf_counter()
            try:
                event = next(iterator)
            except StopIteration:
                return
            spent = time.perf_counter() - start
            if event.kind == "round":
                if self._last_tag is None or event.tag <= self._last_tag:  # generate's tags ascend within a round
                    self._counted = self.compilations() == compiled
                    self.seconds += spent if self._counted else 0.0
                self.tokens += len(event.emitted) if self._counted else 0
                self._last_tag = event.tag
            yield event

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0
