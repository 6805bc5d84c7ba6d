"""Challenges: chat requests a node cannot tell from traffic, nor answer from an earlier one.

Each is an everyday task (a support reply, a summary, an extraction, a short explanation) filled in
at random, with a nonce that reads as part of it (an order or ticket number), asked greedily
(temperature 0) so that the model's answer is determined and a reference of the same artifact can
score it token by token. One in LONG_SHARE is a long document with a question about it, which a
server whose context was cut short cannot take. Standard library only: the referee's Python runs it.
"""

from __future__ import annotations

import random
import secrets
from dataclasses import dataclass
from typing import Any

# How many tokens a challenge asks for, drawn each time: enough to tell models apart, few enough to
# cost the node little, and no fixed number for a node to know challenges by.
MAX_TOKENS = (24, 48)
LONG_SHARE = 4  # one challenge in this many is a long one
LONG_TOKENS = 600  # about how long a long challenge's prompt is, in tokens: well past a cut context
CHARS_PER_TOKEN = 4  # English prose, for sizing the long document

_rng = random.SystemRandom()  # not seedable: nothing about the next challenge can be predicted

NAMES = [
    "Amira",
    "Ben",
    "Chen",
    "Dana",
    "Emeka",
    "Farah",
    "Goran",
    "Hana",
    "Ivan",
    "Julia",
    "Kofi",
    "Lena",
    "Mateo",
    "Nadia",
    "Omar",
    "Priya",
    "Quinn",
    "Rosa",
    "Sami",
    "Tomas",
    "Uma",
    "Viktor",
]
PRODUCTS = [
    "wireless headphones",
    "standing desk",
    "coffee grinder",
    "hiking backpack",
    "e-reader",
    "air purifier",
    "mechanical keyboard",
    "yoga mat",
    "rice cooker",
    "bike helmet",
]
PROBLEMS = [
    "arrived with a cracked case",
    "was charged twice",
    "has not shipped after ten days",
    "stopped working after a week",
    "came in the wrong color",
    "is missing its power cable",
]
CITIES = ["Lisbon", "Nairobi", "Osaka", "Toronto", "Lyon", "Pune", "Bogota", "Tallinn", "Perth"]
TOPICS = [
    "a hash table",
    "photosynthesis",
    "compound interest",
    "a load balancer",
    "inflation",
    "a vaccine",
    "plate tectonics",
    "a database index",
    "the water cycle",
    "a binary search",
]
SYSTEMS = [
    "You are a helpful assistant.",
    "You are a concise support agent for an online store.",
    "You are a helpful assistant. Answer briefly.",
    "You help customers of a small shop.",
]


@dataclass(frozen=True)
class Challenge:
    """What a node is asked, and how."""

    messages: list[dict[str, str]]
    max_tokens: int
    long: bool

    def body(self, model: str, logprobs: int = 0) -> dict[str, Any]:
        """The request as it goes to the node: an ordinary chat completion, asked greedily (with
        `logprobs` candidates a token, for a cross-check)."""
        body = {"model": model, "messages": self.messages, "max_tokens": self.max_tokens, "temperature": 0}
        if logprobs:
            body |= {"logprobs": True, "top_logprobs": logprobs}
        return body


def nonce() -> str:
    return str(secrets.randbelow(900_000) + 100_000)


def _short(rng: random.Random) -> str:
    name, product, problem = rng.choice(NAMES), rng.choice(PRODUCTS), rng.choice(PROBLEMS)
    number = nonce()
    tasks = [
        f"Write a short, polite reply to {name}, whose order #{number} ({product}) {problem}.",
        f"Summarize in one sentence: customer {name} says order {number}, a {product}, {problem}.",
        f"Extract the order number and the product from this message: \"Hi, it's {name}. My {product}"
        f' (order {number}) {problem}." Answer as JSON.',
        f"Explain {rng.choice(TOPICS)} in two sentences for a beginner. (ticket {number})",
        f"Write a subject line for an email to {name} in {rng.choice(CITIES)} about order {number}.",
        f'Translate into French: "Your order {number} will arrive in {rng.choice(CITIES)} on Friday."',
    ]
    return rng.choice(tasks)


def _long(rng: random.Random, tokens: int) -> str:
    """A support log of many made-up tickets, and one question about it."""
    lines: list[str] = []
    asked = None
    while sum(len(line) + 1 for line in lines) < tokens * CHARS_PER_TOKEN:
        name, number = rng.choice(NAMES), nonce()
        line = (
            f"Ticket {number}: {name} from {rng.choice(CITIES)} wrote that the {rng.choice(PRODUCTS)}"
            f" {rng.choice(PROBLEMS)}; status {rng.choice(['open', 'waiting', 'solved'])}."
        )
        lines.append(line)
        if asked is None or rng.random() < 0.1:
            asked = (number, name)
    number, _ = asked if asked is not None else (nonce(), "")
    return (
        "Here is today's support log.\n\n"
        + "\n".join(lines)
        + (f"\n\nWho wrote ticket {number}, from which city, and what is its status?")
    )


def make(context_length: int, rng: random.Random = _rng) -> Challenge:
    """A fresh challenge for a model of `context_length` tokens: long now and then where it fits."""
    long = context_length >= 2 * LONG_TOKENS and rng.randrange(LONG_SHARE) == 0
    user = _long(rng, LONG_TOKENS) if long else _short(rng)
    messages = [{"role": "system", "content": rng.choice(SYSTEMS)}, {"role": "user", "content": user}]
    return Challenge(messages, rng.randint(*MAX_TOKENS), long)


# What a client's request may say and still be scored as a challenge is: a greedy chat of plain text
# messages. Anything else changes the answer (stop strings, penalties, tools, formats, a seed that
# samples, more choices), so such a request is not audited.
AUDITABLE_FIELDS = frozenset(
    {
        "model",
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "stream",
        "stream_options",  # asks for usage: the answer is the same
        "user",
        "cache_salt",
        "cache_prompt",
        "n",
        "store",
        "metadata",
    }
)


# The longest answer audited: the verdict's rule was calibrated on challenges' short answers.
AUDIT_MAX_TOKENS = 64


def answer_limit(body: dict[str, Any]) -> int | None:
    """The most tokens a chat request asks for, if it says."""
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    return limit if type(limit) is int else None


def auditable(body: dict[str, Any]) -> list[dict[str, str]] | None:
    """The messages of a client's chat request that the reference can score as it scores a
    challenge (asked greedily for a short answer to a user's message, nothing else that changes the
    answer), or None."""
    if set(body) - AUDITABLE_FIELDS or body.get("temperature") != 0 or body.get("n", 1) != 1:
        return None
    limit = answer_limit(body)
    if limit is None or not 0 < limit <= AUDIT_MAX_TOKENS:
        return None
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    plain: list[dict[str, str]] = []
    for message in messages:
        if not isinstance(message, dict) or set(message) - {"role", "content"}:
            return None
        role, content = message.get("role"), message.get("content")
        if role not in ("system", "user", "assistant") or not isinstance(content, str):
            return None
        plain.append({"role": role, "content": content})
    # An open assistant message is continued by servers that can (the reference would answer anew).
    return plain if plain[-1]["role"] == "user" else None
