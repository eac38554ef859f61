"""Speculation on the edge: one generation's rounds as a core without I/O, and its asyncio shell.

- `config`: TreeSpec, PrespecConfig, Request (what a generation asks for);
- `outcomes`: Saguaro's fan-out over the likely outcomes and the cost gate (pure functions);
- `estimates`: what is learned across generations (Learned, with the outcome model ChoiceModel) and
  within one (RoundEstimates), and the budget of a dynamic tree;
- `ledger`: the sent trees (a method per transition); `planner`: the candidate outcomes, most likely
  first; `schedule`: the outcome cache's chains, planned to the verdict; `backup`: the miss path's
  tree, priced with measured costs;
- `actions`: what the core asks of its shell; `core`: SpeculationCore (events in, actions out);
- `executor`: the asyncio shell, and the draft step it runs on the drafting thread (DraftStep).

Follow one round (default: greedy, a static tree, no pre-speculation), file by file (docs/architecture.md
§2 tells the same round with the state each object owns):

1. edge_client/client.py: `EdgeClient.generate` builds the Prompt, the core and its shell (`_rounds`)
   and streams each verdict's text.
2. edge_client/speculation/executor.py: `RoundExecutor.run` executes the core's actions (typed:
   speculation.actions); `DraftStep` drafts on the drafting thread; the pump decodes frames as they arrive.
3. edge_client/speculation/core.py: `SpeculationCore.start` / `receive`: draft, send, account the
   verdict, draft again after a miss.
4. edge_client/trees/builder.py: `draft_static` grows the tree level by level (`TreeBuilder`).
5. shared/tree.py: `TokenTree`, the arrays both sides share (tokens, parents, depth, base, cond).
6. shared/client_protocol.py: `ClientProtocol.prompt` / `tree` / `receive` / `acknowledge`: the
   committed sequence and the round in flight, checked against what was sent.
7. shared/messages.py: the Prompt, Tree and Verdict messages and a tree's wire form.
8. cloud_verifier/session.py: `ServerSession.receive` turns frames into protocol events and hands the tree
   to the engine; `_on_result` sends the verdict (shared/server_protocol.py keeps the pending trees).
9. cloud_verifier/step.py: `StepRunner.execute` packs every session's ready rows into one
   forward, verifies, commits the accepted rows' KV (engine.py schedules it).
10. shared/model/inputs.py: `tree_round`, the rows (row 0 + nodes), positions and tree mask.
11. shared/model/llama.py: `forward_packed`, the target's tree-attention forward.
12. cloud_verifier/verify.py: `verify_tree`, the accepted path and the bonus token; back in 9, 8, 6,
    3 and 1.
"""

from __future__ import annotations

from edge_client.speculation.actions import (
    Action,
    Ask,
    Deliver,
    Delivered,
    DraftConditional,
    Drafted,
    DraftPlain,
    FinishLeaves,
    Reanchor,
    Reanchored,
    Send,
    Sent,
    Steps,
)
from edge_client.speculation.config import PrespecConfig, Request, TreeSpec
from edge_client.speculation.core import Clock, DrafterProfile, Refused, SpeculationCore
from edge_client.speculation.estimates import Learned, RoundEstimates
from edge_client.speculation.executor import DraftStep, RoundExecutor
from edge_client.speculation.ledger import Ledger, Speculation

__all__ = [
    "Action",
    "Ask",
    "Clock",
    "Deliver",
    "Delivered",
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
    "Reanchored",
    "Refused",
    "Request",
    "RoundEstimates",
    "RoundExecutor",
    "Send",
    "Sent",
    "Speculation",
    "SpeculationCore",
    "Steps",
    "TreeSpec",
]
