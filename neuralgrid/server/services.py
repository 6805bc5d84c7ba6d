"""The parts every route shares, built once per app by server/app.py; routes take them through
server/deps.py's `ServicesDep`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from neuralgrid.db.store import Store
    from neuralgrid.gateway.auth import KeyStore
    from neuralgrid.gateway.heartbeats import Heartbeats
    from neuralgrid.gateway.metrics import Metrics
    from neuralgrid.gateway.peers import Peers
    from neuralgrid.gateway.pipeline import Pipeline
    from neuralgrid.gateway.tunnel import Tunnels
    from neuralgrid.realtime.hub import Hub
    from neuralgrid.server.settings import Settings
    from neuralgrid.server.tokens import TokenKeys
    from neuralgrid.web.stats import StatsCache


@dataclass(frozen=True)
class Services:
    settings: Settings
    store: Store  # the general pool (the request path's own pool is the pipeline's)
    keys: KeyStore
    pipeline: Pipeline
    metrics: Metrics
    tunnels: Tunnels
    peers: Peers  # the other gateways: how this one asks them, and checks what they forward here
    realtime: Hub
    stats: StatsCache
    tokens: TokenKeys  # what verifies users' JWTs and the stack's opaque API keys
    heartbeats: Heartbeats  # agents' heartbeats, checked at once and written in batches
