"""Speculation on the edge: one generation's rounds as a core without I/O, and its asyncio shell.

- `config`: TreeSpec, PrespecConfig, Request (what a generation asks for);
- `outcomes`: the outcome model, Saguaro's fan-out and the cost gate (pure functions);
- `estimates`: what is learned across generations (Learned) and within one (RoundEstimates);
- `ledger`: the sent trees; `planner`: the candidate outcomes, most likely first;
- `actions`: what the core asks of its shell; `core`: SpeculationCore (events in, actions out);
- `executor`: the asyncio shell, and the draft step it runs on the drafting thread (DraftStep).
"""

from __future__ import annotations

from edge_client.speculation.actions import (
    Action,
    Deliver,
    DraftConditional,
    Drafted,
    DraftPlain,
    FinishLeaves,
    Reanchor,
    SendPrompt,
    SendTree,
)
from edge_client.speculation.config import PrespecConfig, Request, TreeSpec
from edge_client.speculation.core import DrafterProfile, Refused, SpeculationCore
from edge_client.speculation.estimates import Learned, RoundEstimates
from edge_client.speculation.executor import DraftStep, RoundExecutor
from edge_client.speculation.ledger import Ledger, Speculation

__all__ = [
    "Action",
    "Deliver",
    "DraftConditional",
    "DraftPlain",
    "DraftStep",
    "Drafted",
    "DrafterProfile",
    "FinishLeaves",
    "Learned",
    "Ledger",
    "PrespecConfig",
    "Reanchor",
    "Refused",
    "Request",
    "RoundEstimates",
    "RoundExecutor",
    "SendPrompt",
    "SendTree",
    "Speculation",
    "SpeculationCore",
    "TreeSpec",
]
