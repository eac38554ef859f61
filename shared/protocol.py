"""The session protocol, sans I/O: bytes in, events and bytes out (PROTOCOL.md sections 3-5).

`ServerProtocol` (server_protocol.py, its events in server_events.py) and `ClientProtocol`
(client_protocol.py) accept only legal message orders; anything else becomes a `ProtocolError`
naming the field. Neither touches a socket: the FastAPI handler and the asyncio client are thin
shells that move bytes. The matching of conditional trees is shared/tree.py's (`tree_matches`,
`can_still_match`); this module gathers the public names.

Rounds. The server answers every prompt with a verdict of round 0 (it verifies the tree attached to
the prompt, or sends the first token). Tree rounds are >= 1 and strictly increase within a session.
A tree is conditional: it matches the committed sequence S iff `base + len(cond) == len(S)` and
`S[base:] == cond`. Besides the one round in flight the server keeps up to `max_pending` trees;
after each verdict it starts the matching pending tree with the highest round id at once (named in
`verdict.next_round`) and sends `stale` for every tree that can no longer match.
"""

from shared.client_protocol import ClientProtocol, ClientState
from shared.server_events import (
    CancelReceived,
    ClosedByPeer,
    ErrorSent,
    HelloReceived,
    PromptReceived,
    ServerEvent,
    ServerState,
    VerifyTree,
)
from shared.server_protocol import ServerGeneration, ServerProtocol
from shared.tree_match import can_still_match, tree_matches

__all__ = [
    "CancelReceived",
    "ClientProtocol",
    "ClientState",
    "ClosedByPeer",
    "ErrorSent",
    "HelloReceived",
    "PromptReceived",
    "ServerEvent",
    "ServerGeneration",
    "ServerProtocol",
    "ServerState",
    "VerifyTree",
    "can_still_match",
    "tree_matches",
]
