"""The fleet's request router: a resumed session to the replica that holds its KV cache, every other
session to the least-loaded replica.

Serve's proxy routes each request (a WebSocket is one request, for as long as it is open) through
the deployment's router, in the proxy's process. A resuming client names its dropped session's
token in the upgrade's `X-Session-Id` header (`shared.handshake.SESSION_HEADER`), which Serve puts
in the request's metadata (`session_id`); the token's tag is the Serve replica id of the replica
that gave it (`cloud_verifier.resume`). `choose_replicas` ranks:

1. that replica, while it is running (it keeps the session for `--resume-keep` seconds);
2. every running replica, ordered by its engine's queue (its routing stats).

The holder is ranked first only while its last routing stats (at most a second old) show room
for a session: a holder at its session cap would refuse the resume (1013), so the resume goes to
the least-loaded replica instead, which prefills it from the committed tokens. Serve takes the
first rank with a replica under its `max_ongoing_requests`, and within a rank the replica with the
fewest requests in flight (sessions, handshakes and HTTP requests), ties going to the earlier.

Replicas report `{"sessions", "queue", "parked", "room"}` as routing stats
(`VerifierReplica.record_routing_stats`); a replica that has not reported yet counts as idle.
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from cloud_verifier.resume import token_tag


def _stat(replica: RunningReplica, name: str, default: int) -> int:
    stats: dict[str, Any] = replica.routing_stats or {}
    value = stats.get(name, default)
    return value if isinstance(value, int) else default


def _queue(replica: RunningReplica) -> int:
    return _stat(replica, "queue", 0)


def _has_room(replica: RunningReplica) -> bool:
    return _stat(replica, "room", 1) > 0


def rank(candidates: list[RunningReplica], token: str | None) -> list[list[RunningReplica]]:
    """The ranks for a request whose session header is `token` (None: a new session)."""
    ranks: list[list[RunningReplica]] = []
    if token:
        tag = token_tag(token)
        holder = [r for r in candidates if tag and r.replica_id.unique_id == tag and _has_room(r)]
        if holder:
            ranks.append(holder)
    if candidates:
        ranks.append(sorted(candidates, key=_queue))
    return ranks


class SessionRouter(RequestRouter):
    """Resumes to their KV holder, new sessions to the least-loaded replica (module doc)."""

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        token = None
        if pending_request is not None:
            token = pending_request.metadata.session_id or None
            # every replica full: wait before asking again (Serve's backoff), do not spin
            pending_request.routing_context.should_backoff = True
        return rank(candidate_replicas, token)
