"""The estimates the speculation core sizes and gates its trees by, as explicit state.

`Learned` lives as long as the client (it carries over between generations): the acceptance
calibration, one outcome model per target temperature, the measured round trip and the last
tree sent (which sizes the next dynamic budget). `RoundEstimates` lives for one generation: the
running drafting, per-evaluation and verify times, and when the verdict in flight is due.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from edge_client.speculation.budget import AcceptanceCalibration
from edge_client.speculation.outcomes import ChoiceModel
from edge_client.trees import DraftResult


def ema(old: float | None, new: float) -> float:
    """Exponential average of the running estimates (the first sample starts it)."""
    return new if old is None else 0.7 * old + 0.3 * new


@dataclass
class Learned:
    """What the edge learns across generations (one per client).

    calibration: accepted tree tokens over the draft's own estimate (dynamic budgets)
    choice:      outcome models per (target temperature, coupled), speculation.outcomes.ChoiceModel
    rtt_ms:      exponential average of the measured round trip (0: none measured yet)
    last_draft:  the last tree sent (its reach and frontier size the next dynamic budget)
    """

    calibration: AcceptanceCalibration = field(default_factory=AcceptanceCalibration)
    choice: dict[tuple[float, bool], ChoiceModel] = field(default_factory=dict)
    rtt_ms: float = 0.0
    last_draft: DraftResult | None = None

    def choice_model(self, temperature: float, coupled: bool = False) -> ChoiceModel:
        """The outcome model for this temperature (its acceptance estimate carries over). Coupled
        drafting (trees.Coupling) is modelled like greedy: the target takes the draft's coupled
        token with a learned probability, else one by the landing model (where p's inverse CDF
        lands near the keyed uniform; its scale is learned here too and carries over)."""
        key = (round(float(temperature), 3), coupled)
        if key not in self.choice:
            self.choice[key] = ChoiceModel(temperature=0.0 if coupled else key[0])
        return self.choice[key]

    def observe_rtt(self, rtt_ms: float) -> None:
        a = self.rtt_ms
        self.rtt_ms = rtt_ms if a == 0 else 0.8 * a + 0.2 * rtt_ms


@dataclass
class RoundEstimates:
    """Running estimates of one generation, for the cost gate (PrespecConfig.gate).

    draft_ms:    one tree's drafting time (None: nothing drafted yet)
    step_ms:     one drafter evaluation (a conditional draft is abandoned between evaluations)
    verify_ms:   one verification at the server
    verdict_due: perf_counter time the verdict in flight is expected (None: not known)
    """

    draft_ms: float | None = None
    step_ms: float | None = None
    verify_ms: float = 0.0
    verdict_due: float | None = None

    def note_draft(self, dr: DraftResult) -> None:
        self.draft_ms = ema(self.draft_ms, dr.draft_ms)
        if dr.evaluations > 0:
            self.step_ms = ema(self.step_ms, dr.draft_ms / dr.evaluations)

    def note_verify(self, verify_ms: float) -> None:
        self.verify_ms = ema(self.verify_ms or None, verify_ms)
