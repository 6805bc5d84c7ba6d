"""The small generations that verify a server before its node takes any work (at start, and again
after the server comes back): that each model answers (only then is it reported warm), whether the
server puts usage in streams, whether it goes on with an open assistant message
(`continue_final_message`), and whether it honours a completion's `echo`.

A dropped stream is resumed only on a node whose server passed the continuation check, so a server
that starts a new answer instead can never splice two.
"""

from __future__ import annotations

import io
import logging
import re
import wave
from dataclasses import dataclass, field
from typing import Any

import httpx

from neuralgrid.agent.servers.base import WARMUP_TIMEOUT_S, dig
from neuralgrid.protocol.routes import Route, path
from neuralgrid.protocol.sse import SseEvents

log = logging.getLogger(__name__)

# A prompt small models answer with confidence: greedy decoding then gives the same words whether
# the answer is generated in one go or continued from a prefix (floating-point noise between the
# two paths cannot flip a confident choice), which is what the continuation check compares.
PROBE_PROMPT = [
    {
        "role": "user",
        "content": "Repeat exactly these words: one two three four five six seven eight nine ten",
    }
]

# The completion that checks whether the server echoes: its answer must start with this.
ECHO_PROBE = "One two three"


@dataclass(frozen=True)
class WarmUpRefusal:
    """A server's refusal of a warm-up request: its status, and what it said, in its own words."""

    status: int
    request: str  # which request: "a streamed chat", "POST /v1/embeddings"
    said: str

    def __str__(self) -> str:
        return f"{self.request} gave HTTP {self.status}: {self.said}"


@dataclass
class Warmed:
    """What warming a server's models up showed."""

    models: list[str] = field(default_factory=list)  # those that answered: the warm ones
    usage_in_streams: bool = False  # a stream asked for usage got it
    continues: bool = False  # continue_final_message went on with the open message


class WarmUp:
    """One round of warm-ups on one server, through the agent's own client."""

    def __init__(self, http: httpx.AsyncClient, url: str) -> None:
        self.http, self.url = http, url
        self.refusal: WarmUpRefusal | None = None  # the server's last refusal of a warm-up

    async def models(self, models: list[str], routes: tuple[Route, ...]) -> Warmed:
        """Warm each model up with a real request on one of `routes`; a chat model's answer also
        tells what the server does with streams and prefills."""
        warmed = Warmed()
        for model in models:
            try:
                answered = await self._warm_up(model, routes)
            except Exception as err:  # whatever the server sent, it is not a warm model
                log.warning("model %s did not answer its warm-up (%r): not reported warm", model, err)
                continue
            if answered is None:
                log.warning(
                    "model %s did not answer its warm-up (%s): not reported warm", model, self.refusal
                )
                continue
            warmed.models.append(model)
            text, streamed_usage = answered
            if text is not None:  # a chat model: what its server does with streams and prefills
                warmed.usage_in_streams = warmed.usage_in_streams or streamed_usage
                warmed.continues = warmed.continues or await self._continues(model, text)
        return warmed

    async def _warm_up(self, model: str, routes: tuple[Route, ...]) -> tuple[str | None, bool] | None:
        """A first request to the model on a route the server serves: a streamed chat (its text and
        whether usage came), else a completion, an embedding, a rerank, a score, a transcription of
        a moment of silence or a line of speech (no text). None when the model answers none."""
        if "chat/completions" in routes:
            chat = {"model": model, "messages": PROBE_PROMPT, "max_tokens": 24, "temperature": 0}
            streamed = await self._stream(chat)
            if streamed is not None:
                return streamed
        for route, request in _warm_ups(model):
            if route in routes:
                resp = await self.http.post(self.url + path(route), timeout=WARMUP_TIMEOUT_S, **request)
                if resp.is_success:
                    return None, False
                self.refusal = WarmUpRefusal(resp.status_code, f"POST /v1/{route}", resp.text[:200])
        return None

    async def _continues(self, model: str, text: str) -> bool:
        """Whether the server goes on with an open assistant message, in a stream as a resume asks:
        cut its own greedy answer after two words and ask it to continue; a server that does streams
        the rest of that answer (not the cut part again, not a new answer)."""
        cut = re.match(r"\s*\S+\s+\S+", text)
        rest = text[cut.end() :] if cut else ""
        if cut is None or len(rest.split()) < 2:
            log.info("continue_final_message: not checked (the warm-up answer %r is too short)", text)
            return False
        head = cut.group(0)
        body = {
            "model": model,
            "messages": [*PROBE_PROMPT, {"role": "assistant", "content": head}],
            "continue_final_message": True,
            "add_generation_prompt": False,
            "max_tokens": 4,
            "temperature": 0,
        }
        for _ in range(2):  # a second look, so that one unlucky answer does not cost the capability
            try:
                streamed = await self._stream(body)
            except (httpx.HTTPError, ValueError) as err:
                log.info("continue_final_message: the check failed (%r)", err)
                continue
            said = " ".join((streamed or ("", False))[0].split())
            verified = bool(said) and " ".join(rest.split()).startswith(said)
            log.info("continue_final_message: %s (asked to go on after %r, said %r)", verified, head, said)
            if verified:
                return True
        return False

    async def echoes(self, model: str) -> bool:
        """Whether the server honours a completion's `echo` (llama-server ignores it: the answer
        would come without the prompt a client asked to see, and nothing would say so)."""
        body = {"model": model, "prompt": ECHO_PROBE, "max_tokens": 1, "temperature": 0, "echo": True}
        try:
            resp = await self.http.post(self.url + "/v1/completions", json=body, timeout=WARMUP_TIMEOUT_S)
            text = dig(resp.json(), "choices")[0]["text"] if resp.is_success else None
        except (httpx.HTTPError, ValueError, LookupError, TypeError) as err:
            log.info("echo: the check failed (%r)", err)
            return False
        echoes = isinstance(text, str) and text.startswith(ECHO_PROBE)
        log.info("echo: %s (asked to echo %r, said %r)", echoes, ECHO_PROBE, text)
        return echoes

    async def _stream(self, chat: dict[str, Any]) -> tuple[str, bool] | None:
        """A streamed chat request asking for usage: its text and whether usage came; None when refused."""
        body = {**chat, "stream": True, "stream_options": {"include_usage": True}}
        url = self.url + "/v1/chat/completions"
        async with self.http.stream("POST", url, json=body, timeout=WARMUP_TIMEOUT_S) as resp:
            if not resp.is_success:
                await resp.aread()
                self.refusal = WarmUpRefusal(resp.status_code, "a streamed chat", resp.text[:200])
                log.info("%s", self.refusal)
                return None
            events = SseEvents(keep_usage_event=True)  # read as the gateway reads a node's stream
            async for raw in resp.aiter_raw():
                events.feed(raw)
            return "".join(events.text), events.usage is not None


def _silence(seconds: float = 0.25, rate: int = 16_000) -> bytes:
    """A WAV file of silence: what a transcription model is warmed up on."""
    out = io.BytesIO()
    with wave.open(out, "wb") as audio:
        audio.setnchannels(1)
        audio.setsampwidth(2)
        audio.setframerate(rate)
        audio.writeframes(b"\0\0" * int(seconds * rate))
    return out.getvalue()


SILENCE = _silence()


def _warm_ups(model: str) -> list[tuple[Route, dict[str, Any]]]:
    """A small request on each route but chat (the warm-up's first choice), as httpx's arguments."""
    return [
        ("completions", {"json": {"model": model, "prompt": "One, two,", "max_tokens": 4, "temperature": 0}}),
        ("embeddings", {"json": {"model": model, "input": "warm-up"}}),
        ("rerank", {"json": {"model": model, "query": "warm-up", "documents": ["warm-up"]}}),
        ("score", {"json": {"model": model, "text_1": "warm-up", "text_2": "warm-up"}}),
        (
            "audio/transcriptions",
            {"files": {"file": ("warm-up.wav", SILENCE, "audio/wav")}, "data": {"model": model}},
        ),
        ("audio/speech", {"json": {"model": model, "input": "Warm-up."}}),
    ]
