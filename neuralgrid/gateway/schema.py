"""OpenAI's request schema (chat, completions, embeddings, responses, audio) and vLLM's and
llama.cpp's (rerank, score): types and ranges, checked before any node sees a request.

A malformed request is the client's 400 here, never a node's failure: servers answer bad input in
their own ways (llama-cpp-python with HTTP 500 for `"temperature": "hot"`), and a 5xx would cool the
node down for every other client. Types are strict, as OpenAI's are: "0.5" is not a number and 1 is
not a boolean. Fields this schema does not name pass through to the node untouched (servers add
their own: `top_k`, `min_p`, `continue_final_message`, guided decoding), but for those
check_passthrough() refuses or bounds: what a node would generate unbilled, or what breaks it.
"""

from __future__ import annotations

from email.message import EmailMessage
from email.parser import BytesParser
from email.policy import HTTP
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from neuralgrid.protocol.tunnel import MAX_TYPE, is_content_type

Temperature = Annotated[float, Field(ge=0, le=2)]
Probability = Annotated[float, Field(ge=0, le=1)]
Penalty = Annotated[float, Field(ge=-2, le=2)]
Count = Annotated[int, Field(ge=1, le=2**31 - 1)]
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
# A model id is a name: no control characters (Postgres text cannot even hold NUL).
ModelId = Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[^\x00-\x1f\x7f]+$")]
# The developer's own name for their end user: recorded on the job, so one line of text (the same
# rule for the field and for GET /v1/usage?user=).
END_USER: dict[str, Any] = {"max_length": 256, "pattern": r"^[^\x00-\x1f\x7f]*$"}
EndUser = Annotated[str, Field(**END_USER)]
Tokens = list[Annotated[int, Field(ge=0)]]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Generation(_Strict):
    model: ModelId
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Count | None = None
    temperature: Temperature | None = None
    top_p: Probability | None = None
    n: Annotated[int, Field(ge=1, le=128)] | None = None
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    seed: Int64 | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    user: EndUser | None = None


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class FunctionDef(_Strict):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class ChatRequest(_Generation):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Count | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


class CompletionRequest(_Generation):
    prompt: str | list[str] | Tokens | list[Tokens]
    echo: bool | None = None
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    best_of: Annotated[int, Field(ge=1, le=20)] | None = None
    suffix: str | None = None

    @field_validator("best_of")
    @classmethod
    def _no_unbilled_candidates(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        # The candidates past n are generated and never reported in the usage: not billed.
        if best_of is not None and best_of > (info.data.get("n") or 1):
            raise ValueError("best_of above n is not served: the extra candidates would not be billed")
        return best_of


# What OpenAI embeds: no empty input, string or list (a node answers an empty one with nothing, billed).
Text = Annotated[str, Field(min_length=1)]
SomeTokens = Annotated[Tokens, Field(min_length=1)]


class EmbeddingRequest(_Strict):
    model: ModelId
    input: (
        Text
        | Annotated[list[Text], Field(min_length=1)]
        | SomeTokens
        | Annotated[list[SomeTokens], Field(min_length=1)]
    )
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: Count | None = None
    user: EndUser | None = None


class ResponsesRequest(_Strict):
    """OpenAI's Responses API. Stateless here: a response is not kept where the next request may
    run (any node), so continuing one (previous_response_id, conversation) is refused."""

    model: ModelId
    input: str | Annotated[list[str | dict[str, Any]], Field(min_length=1)]
    instructions: str | None = None
    stream: bool = False
    max_output_tokens: Count | None = None
    temperature: Temperature | None = None
    top_p: Probability | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    user: EndUser | None = None
    previous_response_id: Any = None
    conversation: Any = None

    @field_validator("previous_response_id", "conversation", mode="before")
    @classmethod
    def _not_kept(cls, value: Any) -> None:
        if value is not None:
            raise ValueError(
                "continuing a stored response is not supported: the next request may run on another node;"
                " send the conversation as input"
            )


# A text to rank or score: a string, or (vLLM) a content part such as an image.
Document = str | dict[str, Any]
Documents = Annotated[list[Document], Field(min_length=1, max_length=10_000)]


class RerankRequest(_Strict):
    """vLLM's and llama.cpp's rerank (Jina's and Cohere's shape): the documents by relevance to the query."""

    model: ModelId
    query: str | dict[str, Any]
    documents: Documents
    top_n: Annotated[int, Field(ge=0, le=2**31 - 1)] | None = None
    return_documents: bool | None = None


# vLLM's score: pairs of texts, named in one of its four ways.
SCORE_PAIRS = (("text_1", "text_2"), ("queries", "documents"), ("queries", "items"), ("data_1", "data_2"))


class ScoreRequest(_Strict):
    """vLLM's score: a relevance score for each pair of texts (one against many, or pairwise)."""

    model: ModelId
    text_1: Document | Documents | None = None
    text_2: Document | Documents | None = None
    queries: Document | Documents | None = None
    documents: Document | Documents | None = None
    items: Document | Documents | None = None
    data_1: Document | Documents | None = None
    data_2: Document | Documents | None = None

    @model_validator(mode="after")
    def _one_pair(self) -> ScoreRequest:
        if not any(getattr(self, a) is not None and getattr(self, b) is not None for a, b in SCORE_PAIRS):
            raise ValueError("give the texts to score as text_1 and text_2 (or queries and documents)")
        return self


class SpeechRequest(_Strict):
    """OpenAI's text to speech. The audio comes back whole (stream_format "sse" is not relayed)."""

    model: ModelId
    input: Annotated[str, Field(min_length=1, max_length=100_000)]
    voice: str | dict[str, Any] | None = None
    instructions: str | None = None
    response_format: Literal["mp3", "opus", "aac", "flac", "wav", "pcm"] | None = None
    speed: Annotated[float, Field(ge=0.25, le=4)] | None = None
    stream_format: Literal["audio"] | None = None


SCHEMAS: dict[str, type[BaseModel]] = {
    "chat": ChatRequest,
    "completion": CompletionRequest,
    "embedding": EmbeddingRequest,
    "responses": ResponsesRequest,
    "rerank": RerankRequest,
    "score": ScoreRequest,
    "speech": SpeechRequest,
}


# Audio uploads (transcriptions and translations): multipart/form-data ------------------------------


class AudioForm(_Strict):
    """The text fields of an audio upload, as OpenAI's and vLLM's servers read them (forms carry
    text only: numbers and booleans arrive as strings). The file is checked on its own."""

    model: ModelId
    language: Annotated[str, Field(max_length=32)] | None = None
    prompt: str | None = None
    response_format: Literal["json", "text", "srt", "verbose_json", "vtt"] | None = None
    temperature: Annotated[str, Field(pattern=r"^\s*(0(\.\d+)?|1(\.0+)?)\s*$")] | None = None
    stream: Literal["false", "False", "0"] | None = Field(
        None, description="Streamed transcripts are not relayed: leave stream out or false."
    )


class FormError(ValueError):
    """An upload that is not the multipart form its route takes; the message says what is wrong."""


def read_audio_form(body: bytes, content_type: str) -> dict[str, str]:
    """The text fields of a multipart/form-data audio upload, once it is known to carry a non-empty
    `file` part; FormError otherwise. The body itself is passed to the node unchanged."""
    if content_type.split(";", 1)[0].strip().lower() != "multipart/form-data":
        raise FormError("send the audio as multipart/form-data, with `file` and `model` fields")
    if not is_content_type(content_type):  # passed on to the node: over a tunnel, in a frame
        raise FormError(f"the Content-Type header must be 1 to {MAX_TYPE} printable ASCII characters, no tab")
    message = BytesParser(policy=HTTP).parsebytes(
        b"Content-Type: " + content_type.encode() + b"\r\n\r\n" + body
    )
    if not isinstance(message, EmailMessage) or not message.is_multipart() or message.defects:
        raise FormError("the multipart/form-data body is malformed (no boundary, or parts that do not end)")
    fields: dict[str, str] = {}
    audio: bytes | None = None
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if not isinstance(name, str):
            raise FormError("every part of the form must be named (Content-Disposition: form-data; name=...)")
        payload = part.get_payload(decode=True)
        data = payload if isinstance(payload, bytes) else b""
        if name == "file":
            audio = data
        else:
            try:
                fields[name] = data.decode()
            except UnicodeDecodeError:
                raise FormError(f"the form field {name!r} is not UTF-8 text") from None
    if audio is None:
        raise FormError("the form has no `file`: attach the audio as a file part named file")
    if not audio:
        raise FormError("the audio file is empty")
    return fields


# What passes to a node beyond OpenAI's fields ------------------------------------------------------

# Servers' own names for what is billed: llama.cpp's n_predict, n_cmpl and n_probs, Ollama's
# num_predict, TGI's and SGLang's max_new_tokens. Where a server reads them they win over OpenAI's
# fields, so a node would generate what they ask while the key is held and billed within max_tokens
# times n (a review got 400 tokens from a real llama-server billed as 5, and 4.7 MB of
# probabilities a token).
IN_OPENAI_TERMS = {
    "n_predict": "max_tokens",
    "n_cmpl": "n",
    "num_predict": "max_tokens",
    "max_new_tokens": "max_tokens",
    "n_probs": "logprobs and top_logprobs",
}
# What a server sets for itself, which llama-server's /v1/completions lets a request set, and the
# slot a request runs in: a review crashed a real llama-server with a chat_parser that refers to
# itself (every request on the node failed, and the node was blamed), and aimed a request at the
# slot holding another client's prompt.
SERVER_ONLY = frozenset(
    {
        "chat_parser",
        "chat_format",
        "generation_prompt",
        "grammar_lazy",
        "grammar_triggers",
        "grammar_type",
        "id_slot",
        "message_delimiters",
        "preserved_tokens",
        "reasoning_budget_end_tag",
        "reasoning_budget_end_tags",
        "reasoning_budget_message",
        "reasoning_budget_start_tag",
        "reasoning_control",
    }
)
# Bounds on what guided decoding may ask: llama.cpp parses a grammar recursively, a level per
# group (150,000 nested groups crashed it), and runs each sampler named for every token on the
# loop all its requests share (200,000 of them slowed another client's request 48-fold).
GRAMMAR_BYTES = 64 << 10
GRAMMAR_DEPTH = 64
SAMPLERS = 16


class PassthroughRefused(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def check_passthrough(body: dict[str, Any]) -> None:
    """PassthroughRefused for a field no node is sent: one that asks in a server's own terms for what
    is billed, a server's own setting, or guided decoding past the bounds above."""
    for name, instead in IN_OPENAI_TERMS.items():
        if body.get(name) is not None:
            raise PassthroughRefused(
                name, f"{name} is not accepted here: ask with {instead}, which is what is billed"
            )
    for name in SERVER_ONLY.intersection(body):
        raise PassthroughRefused(name, f"{name} is a server's own setting, not a request's")
    samplers = body.get("samplers")
    if samplers is not None and not (isinstance(samplers, str | list) and len(samplers) <= SAMPLERS):
        raise PassthroughRefused("samplers", f"samplers names at most {SAMPLERS} samplers")
    grammar = body.get("grammar")
    if grammar is not None and not (
        isinstance(grammar, str)
        and len(grammar.encode()) <= GRAMMAR_BYTES
        and nesting(grammar) <= GRAMMAR_DEPTH
    ):
        raise PassthroughRefused(
            "grammar",
            f"a grammar is a string of at most {GRAMMAR_BYTES >> 10} KiB, its groups nested at most"
            f" {GRAMMAR_DEPTH} deep",
        )


def nesting(grammar: str) -> int:
    """How deep a GBNF grammar's groups nest: parentheses outside its strings and character classes."""
    depth = deepest = 0
    quote: str | None = None  # inside "..." or [...]
    escaped = False
    for char in grammar:
        if escaped:
            escaped = False
        elif quote is not None:
            if char == "\\":
                escaped = True
            elif char == quote:
                quote = None
        elif char == '"':
            quote = '"'
        elif char == "[":
            quote = "]"
        elif char == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif char == ")":
            depth -= 1
    return deepest
