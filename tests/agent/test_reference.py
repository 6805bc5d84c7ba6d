"""The trusted reference of model verification by challenge (neuralgrid/verify/reference.py) and its
referee process, against the real llama-server and SmolLM2 that scripts/backends.sh builds.

The referee runs as it will in production: the Python of llama-cpp-python's venv, with the repository
on PYTHONPATH and none of the project's dependencies. A greedy answer of the real llama-server scores
gaps near 0; a made-up one scores large gaps.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.agent.servers import RealServer, built, real_server
from tests.conftest import free_port, wait_for

REPO = Path(__file__).resolve().parents[2]
VERIFY = REPO / "neuralgrid" / "verify"
# Above any gap an honest greedy answer showed on this CPU: the reference evaluates the answer in one
# batch and a server one token at a time, and a near-tie can flip on the last bits (measured: 0.48 at
# most over 15,000 tokens of 470 challenges, 96% of gaps exactly 0). A cheat's gaps run to 5-20.
HONEST_GAP = 1.0
CONVERSATIONS: list[list[dict[str, str]]] = [
    [
        {"role": "system", "content": "You are a concise assistant for a logistics company."},
        {"role": "user", "content": "Write a note to Aiko Tanaka: order #482113 has shipped."},
    ],
    [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
    [
        {"role": "system", "content": "You are a friendly assistant."},
        {"role": "user", "content": "Name a fruit."},
        {"role": "assistant", "content": "An apple."},
        {"role": "user", "content": "And a vegetable, for invoice QX-1234?"},
    ],
]

# A prompt whose greedy answer, cut at 32 tokens, ends with two "\n" tokens (measured on this build).
TWO_NEWLINES_AT_THE_CUT = [
    {"role": "system", "content": "You are a concise assistant for a logistics company. Keep answers short."},
    {"role": "user", "content": "Write a short email to Aiko Kim confirming that order #705043 has shipped."},
]

# A prompt whose greedy answer, cut at 27 tokens, ends in the first byte of "¥" (after "Rupee:", the
# model's last token is a space and that byte): llama-server sends the space alone (measured on this build).
CUT_INSIDE_A_CHARACTER = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "List currency symbols: euro, pound, yen, rupee."},
]

# Greedy answers that tokenize back otherwise, each scored 11 to 12 logits off before the reference
# split them again (measured on this build, from honest challenges that failed):
# - "l'arr" "iv" "ation": the model nearly chose "ê" over "iv" (0.3 apart in llama-server's logits);
#   the text comes back as "ivation", which it ranks 11 logits below, and "ê" spells none of the text;
# - "A" "mar" "i": comes back as "Am" "ari"; split after "A", the rest comes back as "mari", ranked
#   lower still, so the split must go on to "mar" before it is judged.
TOKENIZED_BACK_OTHERWISE = [
    (
        [
            {"role": "system", "content": "You are a helpful assistant."},
            {
                "role": "user",
                "content": 'Translate into French: "Your order 393656 will arrive in Lisbon on Friday."',
            },
        ],
        "l'arrivation",
    ),
    (
        [
            {"role": "system", "content": "You are a concise support agent for an online store."},
            {
                "role": "user",
                "content": "Summarize in one sentence: customer Amira says order 962874, a hiking backpack,"
                " arrived with a cracked case.",
            },
        ],
        "Amari,",
    ),
]


def referee_python() -> Path:
    return built() / "venv" / "bin" / "python"


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealServer]:
    log = tmp_path_factory.mktemp("reference") / "llama-server.log"
    server = real_server("llama.cpp", free_port(), log, parallel=2).start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture(scope="module")
def referee(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log = tmp_path_factory.mktemp("referee") / "referee.log"
    args = [str(referee_python()), "-m", "neuralgrid.verify.referee", "--model", str(built() / "model.gguf")]
    args += ["--port", str(port), "--threads", "2"]
    with log.open("wb") as out:
        process = subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO)}
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: ready(process, url, log), timeout=60)  # it hashes and loads the model first
        yield url
    finally:
        process.kill()
        process.wait(timeout=10)


def ready(process: subprocess.Popen[bytes], url: str, log: Path) -> bool:
    if process.poll() is not None:
        raise RuntimeError(f"the referee exited: {log.read_text()[-2000:]}")
    try:
        return httpx.get(f"{url}/v1/artifacts", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@functools.cache
def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def greedy(server: RealServer, messages: list[dict[str, str]], max_tokens: int = 32) -> dict[str, Any]:
    """llama-server's greedy answer, with its tokens' ids (its logprobs list them)."""
    body = {"messages": messages, "temperature": 0, "max_tokens": max_tokens, "logprobs": True}
    answer: dict[str, Any] = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()
    return answer


def score(
    referee: str, messages: list[dict[str, str]], answer: str | list[int], finish_reason: str
) -> dict[str, Any]:
    """The referee's scores of an answer: its text, or its token ids."""
    body: dict[str, Any] = {"sha256": sha256(built() / "model.gguf"), "messages": messages}
    body["answer" if isinstance(answer, str) else "answer_ids"] = answer
    resp = httpx.post(f"{referee}/v1/score", json={**body, "finish_reason": finish_reason}, timeout=60)
    assert resp.status_code == 200, resp.text
    scored: dict[str, Any] = resp.json()
    return scored


def test_the_reference_renders_chats_as_llama_server_does(llama_server: RealServer) -> None:
    """The prompt text of the GGUF's chat template, jinja2 in Python, equals llama-server's own."""
    program = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from neuralgrid.verify.reference import Reference\n"
        "reference = Reference(Path(sys.argv[1]), n_ctx=256, n_threads=1)\n"
        "print(json.dumps([reference.render(m) for m in json.loads(sys.stdin.read())]))\n"
    )
    done = subprocess.run(
        [str(referee_python()), "-c", program, str(built() / "model.gguf")],
        input=json.dumps(CONVERSATIONS),
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
        check=True,
    )
    ours = json.loads(done.stdout)
    for messages, rendered in zip(CONVERSATIONS, ours, strict=True):
        theirs = httpx.post(f"{llama_server.url}/apply-template", json={"messages": messages}, timeout=30)
        assert rendered == theirs.json()["prompt"]
    assert ours[1].startswith(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM"
    )  # the default
    assert ours[2].endswith("<|im_start|>assistant\n")  # the generation prompt


def test_the_referee_lists_its_models_by_their_files_sha256(referee: str) -> None:
    artifacts = httpx.get(f"{referee}/v1/artifacts", timeout=10).json()
    model = built() / "model.gguf"
    assert artifacts == {"artifacts": [{"sha256": sha256(model), "path": str(model)}]}


@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_a_greedy_answer_of_llama_server_scores_gaps_near_zero(
    llama_server: RealServer, referee: str, conversation: int
) -> None:
    messages = CONVERSATIONS[conversation]
    answer = greedy(llama_server, messages)
    choice, usage = answer["choices"][0], answer["usage"]
    scored = score(referee, messages, choice["message"]["content"], choice["finish_reason"])
    # The same prompt, token for token, as the server read it; the answer's text retokenized to the
    # server's own count (which counts the end-of-generation token where it stopped).
    assert scored["prompt_tokens"] == usage["prompt_tokens"]
    stopped = choice["finish_reason"] == "stop"
    assert scored["answer_tokens"] + stopped == usage["completion_tokens"]
    assert len(scored["gaps"]) == usage["completion_tokens"]
    assert max(scored["gaps"]) < HONEST_GAP, scored["gaps"]
    assert min(scored["gaps"]) == 0
    assert 0 < scored["cpu_s"] < 60
    # The server's own tokens score the same (its ids end with the end of generation where it stopped).
    ids = [token["id"] for token in choice["logprobs"]["content"]]
    by_ids = score(referee, messages, ids, choice["finish_reason"])
    assert len(by_ids["gaps"]) == len(scored["gaps"])
    assert max(by_ids["gaps"]) < HONEST_GAP


def test_an_answer_cut_between_two_newlines_scores_as_the_server_emitted_it(
    llama_server: RealServer, referee: str
) -> None:
    """The text "\n\n" tokenizes as one token; the model emitted two "\n", and max_tokens cut the
    answer after them. The reference splits the text as its own greedy choice does, and finds no gap."""
    answer = greedy(llama_server, TWO_NEWLINES_AT_THE_CUT)
    choice = answer["choices"][0]
    ids = [token["id"] for token in choice["logprobs"]["content"]]
    if not (choice["finish_reason"] == "length" and choice["message"]["content"].endswith("\n\n")):
        pytest.skip(f"SmolLM2 answered otherwise on this CPU: {choice['message']['content']!r}")
    scored = score(referee, TWO_NEWLINES_AT_THE_CUT, choice["message"]["content"], "length")
    assert scored["answer_tokens"] == len(ids) == answer["usage"]["completion_tokens"]
    assert max(scored["gaps"]) < HONEST_GAP, scored["gaps"]


def test_an_answer_cut_inside_a_character_scores_as_the_server_emitted_it(
    llama_server: RealServer, referee: str
) -> None:
    """max_tokens cut the answer after a token that spells a space and the first byte of a character:
    the server holds that byte back (it is no text yet) and sends the space. Tokenized back, the
    text ends in a lone space, which the model ranked far below the token it did emit. The reference
    takes its own greedy token where it spells the text's end and then only part of a character."""
    answer = greedy(llama_server, CUT_INSIDE_A_CHARACTER, max_tokens=27)
    choice = answer["choices"][0]
    text = choice["message"]["content"]
    if not (choice["finish_reason"] == "length" and text.endswith("Rupee: ")):
        pytest.skip(f"SmolLM2 answered otherwise on this CPU: {text!r}")
    scored = score(referee, CUT_INSIDE_A_CHARACTER, text, "length")
    assert scored["answer_tokens"] == answer["usage"]["completion_tokens"]
    assert max(scored["gaps"]) < HONEST_GAP, scored["gaps"]


@pytest.mark.parametrize(("messages", "spelled"), TOKENIZED_BACK_OTHERWISE, ids=["a near tie", "two splits"])
def test_a_greedy_answer_that_tokenizes_back_otherwise_scores_as_the_server_emitted_it(
    llama_server: RealServer, referee: str, messages: list[dict[str, str]], spelled: str
) -> None:
    """The text of a greedy answer tokenizes back as tokens the model ranks far lower than those the
    node emitted. The reference splits it after the highest-ranked token that spells the text, and
    on while one ranked above the text's own does, and finds no gap."""
    answer = greedy(llama_server, messages, max_tokens=64)
    choice = answer["choices"][0]
    ids = [token["id"] for token in choice["logprobs"]["content"]]
    if spelled not in choice["message"]["content"]:
        pytest.skip(f"SmolLM2 answered otherwise on this CPU: {choice['message']['content']!r}")
    scored = score(referee, messages, choice["message"]["content"], choice["finish_reason"])
    assert choice["finish_reason"] == "stop" and ids[-1] == 2  # the end of generation, listed last
    assert scored["answer_tokens"] == len(ids) - 1
    assert max(scored["gaps"]) < HONEST_GAP, scored["gaps"]


def test_a_made_up_answer_scores_large_gaps(referee: str) -> None:
    messages = CONVERSATIONS[1]
    scored = score(referee, messages, "Bananas are purple on Tuesdays, said the walrus.", "stop")
    assert scored["answer_tokens"] == len(scored["gaps"]) - 1  # the end of generation, scored too
    assert max(scored["gaps"]) > 5
    assert sum(g > HONEST_GAP for g in scored["gaps"]) >= 3


def test_an_answer_cut_by_max_tokens_scores_no_end_of_generation(referee: str) -> None:
    scored = score(referee, CONVERSATIONS[1], "The capital of France is", "length")
    assert len(scored["gaps"]) == scored["answer_tokens"] > 0


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        (b"{not json", 400, "not JSON"),
        (b"[]", 400, "JSON object"),
        (
            {"sha256": "0" * 64, "messages": CONVERSATIONS[1], "answer": "x", "finish_reason": "stop"},
            404,
            "unknown sha256",
        ),
        ({"messages": CONVERSATIONS[1], "answer": "x", "finish_reason": "stop"}, 404, "unknown sha256"),
        ({"messages": [], "answer": "x", "finish_reason": "stop"}, 400, "messages"),
        ({"messages": [{"role": "user"}], "answer": "x", "finish_reason": "stop"}, 400, "each message"),
        ({"messages": CONVERSATIONS[1], "answer": "x", "finish_reason": "eos"}, 400, "finish_reason"),
        ({"messages": CONVERSATIONS[1], "finish_reason": "stop"}, 400, "answer"),
        ({"messages": CONVERSATIONS[1], "answer": 3, "finish_reason": "stop"}, 400, "answer"),
        ({"messages": CONVERSATIONS[1], "answer_ids": [10**9], "finish_reason": "stop"}, 400, "token ids"),
        (
            {
                "messages": [{"role": "user", "content": "word " * 3000}],
                "answer": "x",
                "finish_reason": "stop",
            },
            413,
            "exceed",
        ),
    ],
)
def test_bad_input_gets_a_4xx_json_error(
    referee: str, body: bytes | dict[str, Any], status: int, says: str
) -> None:
    if isinstance(body, dict) and "sha256" not in body and says != "unknown sha256":
        body = {**body, "sha256": sha256(built() / "model.gguf")}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp = httpx.post(f"{referee}/v1/score", content=content, timeout=60)
    assert resp.status_code == status, resp.text
    assert says in resp.json()["error"]["message"]


def test_unknown_routes_get_a_404_json_error(referee: str) -> None:
    for resp in (httpx.get(f"{referee}/v1/nothing"), httpx.post(f"{referee}/v1/nothing", json={})):
        assert resp.status_code == 404
        assert "no route" in resp.json()["error"]["message"]


def test_the_referees_modules_import_nothing_the_referees_venv_lacks() -> None:
    """The referee runs in llama-cpp-python's venv: the standard library, numpy and llama_cpp (with
    its jinja2), and of the project only these modules, which keep to the same."""
    allowed = set(sys.stdlib_module_names) | {"numpy", "llama_cpp"}
    ours = {
        "neuralgrid.verify",
        "neuralgrid.verify.artifacts",
        "neuralgrid.verify.reference",
        "neuralgrid.verify.referee",
    }
    for name in ("artifacts.py", "reference.py", "referee.py"):
        for node in ast.walk(ast.parse((VERIFY / name).read_text())):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                modules = [node.module]
            else:
                continue
            for module in modules:
                assert module in ours or module.split(".")[0] in allowed, f"{name} imports {module}"
