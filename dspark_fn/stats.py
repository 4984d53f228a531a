"""Acceptance statistics over the rounds of one or more generations (spec §9)."""

from dataclasses import dataclass, field


@dataclass
class Acceptance:
    """Running totals; ``add`` one verify round at a time."""

    rounds: int = 0
    emitted: int = 0
    accepted: int = 0
    drafted: int = 0
    slot_proposed: list = field(default_factory=list)
    slot_accepted: list = field(default_factory=list)

    def add(self, emitted: int, accepted: int, drafted: int) -> None:
        self.rounds += 1
        self.emitted += emitted
        self.accepted += accepted
        self.drafted += drafted
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
    def per_slot(self) -> list:
        """P(slot j accepted | slot j proposed), slot 0 first."""
        return [a / p if p else 0.0 for a, p in zip(self.slot_accepted, self.slot_proposed)]

    def summary(self) -> dict:
        return {
            "rounds": self.rounds,
            "tau": self.tau,
            "acceptance_rate": self.acceptance_rate,
            "verify_rate": self.verify_rate,
            "per_slot_acceptance": self.per_slot,
        }
