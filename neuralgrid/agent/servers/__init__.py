"""The kinds of inference server the agent knows, a module each (base.py: what a kind is).

To add a kind: write its module (a ServerKind subclass and its KIND), then put its KIND in KINDS
below, where its identifying GET is tried.
"""

from __future__ import annotations

from neuralgrid.agent.servers import (
    llama_cpp_python,
    llama_router,
    llama_server,
    ollama,
    openai,
    sglang,
    tgi,
    vllm,
)
from neuralgrid.agent.servers.base import ServerKind

# In the order tried: each identifying path is one the others answer 404 (or without the field).
KINDS: tuple[ServerKind, ...] = (
    llama_server.KIND,
    llama_router.KIND,
    llama_cpp_python.KIND,
    sglang.KIND,
    tgi.KIND,
    ollama.KIND,
    vllm.KIND,
)
# A server that matches none: a plain OpenAI-compatible server (the owner says the rest).
GENERIC: ServerKind = openai.KIND
