"""Any other OpenAI-compatible server: one that answers GET /v1/models, and says nothing more."""

from __future__ import annotations

from typing import Any

from neuralgrid.agent.servers.base import ServerKind


class OpenAI(ServerKind):
    name = "openai"
    identify = "/v1/models"
    health = "/v1/models"

    def recognise(self, identity: Any) -> bool:
        return True


KIND = OpenAI()
