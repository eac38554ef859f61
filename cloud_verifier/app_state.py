"""What the service's endpoints and session sockets share: the config, keys, admission, metrics,
the target and engine once loaded, the open sessions and HTTP requests, and whether it is draining."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from cloud_verifier.admission import Admission
from cloud_verifier.auth import KeyStore
from cloud_verifier.engine import Engine
from cloud_verifier.metrics import Metrics
from cloud_verifier.resume import ParkedSessions
from cloud_verifier.server_config import ServerConfig
from cloud_verifier.session import ModelInfo, ServerSession
from shared.messages import SessionLimits
from shared.model import Target


@dataclass
class AppState:
    config: ServerConfig
    keys: KeyStore
    admission: Admission
    metrics: Metrics = field(default_factory=Metrics)
    target: Target | None = None
    engine: Engine | None = None
    info: ModelInfo | None = None
    limits: SessionLimits | None = None
    load_error: str | None = None
    sessions: set[ServerSession] = field(default_factory=set)
    draining: bool = False
    http_running: int = 0  # HTTP requests past the gate (server.py's HttpGate) and not yet answered
    http_cut: asyncio.Event = field(default_factory=asyncio.Event)  # the drain's deadline: end them
    on_load_error: Callable[[str], None] | None = None  # serve(): stop the process
    # dropped sessions kept for their client's resume (resume.py); made from the config in create_app
    parked: ParkedSessions = field(default_factory=ParkedSessions)
    # this verifier's own address, offered to clients in the welcome (a fleet replica's; None: no
    # offer), and the sessions offered it that a connection there may still take over (direct.py)
    direct: str | None = None
    offers: dict[str, ServerSession] = field(default_factory=dict)

    @property
    def ready(self) -> bool:
        return self.engine is not None and self.engine.healthy() and not self.draining

    @property
    def admitted(self) -> int:
        return sum(1 for s in self.sessions if s.admitted)
