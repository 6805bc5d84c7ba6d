"""The gateway's side of the referee (verify/referee.py): its models, and its scores of answers.

Not imported by the referee, whose Python has neither httpx nor the rest of the project's packages."""

from __future__ import annotations

from dataclasses import dataclass

import httpx

SCORE_TIMEOUT_S = 60.0  # the referee scores one at a time: a queue of long challenges takes a while


class RefereeError(Exception):
    """The referee did not score: no verdict (the challenge counts for nothing)."""


class Unscorable(Exception):
    """The referee could not score the node's answer (413: more than fits its context, more than was
    asked; 422: text it cannot read): the node's doing, a failed challenge."""


@dataclass(frozen=True)
class Scores:
    gaps: list[float]
    prompt_tokens: int
    answer_tokens: int
    cpu_s: float


class RefereeClient:
    """The referee process, over HTTP."""

    def __init__(self, url: str, client: httpx.AsyncClient | None = None) -> None:
        self.url = url.rstrip("/")
        self.client = client or httpx.AsyncClient(timeout=SCORE_TIMEOUT_S)

    async def artifacts(self) -> list[str]:
        """The sha256s of the GGUFs it holds."""
        try:
            resp = await self.client.get(f"{self.url}/v1/artifacts")
            resp.raise_for_status()
            return [str(a["sha256"]) for a in resp.json()["artifacts"]]
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as err:
            raise RefereeError(f"the referee at {self.url} did not list its models: {err}") from err

    async def score(self, sha256: str, messages: list[dict[str, str]], answer: str, finish: str) -> Scores:
        body = {"sha256": sha256, "messages": messages, "answer": answer, "finish_reason": finish}
        try:
            resp = await self.client.post(f"{self.url}/v1/score", json=body)
            if resp.status_code in (413, 422):
                raise Unscorable(resp.text[:200])
            if resp.status_code != 200:
                raise RefereeError(f"the referee answered HTTP {resp.status_code}: {resp.text[:200]}")
            got = resp.json()
            gaps = [float(gap) for gap in got["gaps"]]
            return Scores(gaps, int(got["prompt_tokens"]), int(got["answer_tokens"]), float(got["cpu_s"]))
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as err:
            raise RefereeError(f"the referee at {self.url} did not score: {err}") from err

    async def aclose(self) -> None:
        await self.client.aclose()
