"""OpenAI's request schema for chat, completions and embeddings: types and ranges, checked before any
node sees a request.

A malformed request is the client's 400 here, never a node's failure: servers answer bad input in
their own ways (llama-cpp-python with HTTP 500 for `"temperature": "hot"`), and a 5xx would cool the
node down for every other client. Types are strict, as OpenAI's are: "0.5" is not a number and 1 is
not a boolean. Fields this schema does not name pass through to the node untouched (servers add
their own: `top_k`, `min_p`, `continue_final_message`, guided decoding).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

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


class EmbeddingRequest(_Strict):
    model: ModelId
    input: str | list[str] | Tokens | list[Tokens]
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: Count | None = None
    user: EndUser | None = None


SCHEMAS: dict[str, type[BaseModel]] = {
    "chat": ChatRequest,
    "completion": CompletionRequest,
    "embedding": EmbeddingRequest,
}
