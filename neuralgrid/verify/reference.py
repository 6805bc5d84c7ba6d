"""The trusted reference: the model file a node claims to serve, run here by llama-cpp-python and
teacher-forced over the node's answer, so that each answer token gets a gap (how far it was from the
reference's own greedy choice).

A node asked at temperature 0 should pick, at every position, the token of highest logit. The
reference evaluates the prompt and the node's answer in one pass and reads, for each answer token t,
gap_t = max logit - logit of t: 0 where the node picked the reference's argmax, small where two tokens
were nearly tied (arithmetic differs a little between machines and batch shapes), large where the node
runs another model, another quantization, or sampled.

This module runs in the referee's Python (the venv of llama-cpp-python that scripts/backends.sh
builds), which has numpy and llama_cpp but none of the project's other dependencies: it imports only
the standard library, numpy and llama_cpp (when a Reference is made).
"""

from __future__ import annotations

import codecs
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from neuralgrid.verify.artifacts import file_sha256

# Enough for a long challenge (about 1000 prompt tokens) and its answer, with room to spare.
DEFAULT_CTX = 2048
# At most this many re-splits of an answer's text (see Reference._align): each evaluates the answer's
# rest again, and an honest answer needs one or two.
MAX_SPLITS = 8
# How far down the reference's ranking a token that spells the text may be to split it there: a node
# took it at a near tie, so it ranks near the top.
SPELLING_RANKS = 16


class ScoreError(ValueError):
    """Input the reference cannot score (a message a caller can read); one line."""


class PromptTooLong(ScoreError):
    """The prompt and the answer do not fit the reference's context."""


@dataclass(frozen=True)
class Scored:
    gaps: list[float]  # one per answer token, then one for the end of generation where it stopped
    prompt_tokens: int
    answer_tokens: int
    cpu_s: float  # the process's CPU time (all of llama.cpp's threads) spent scoring


class Reference:
    """One GGUF file, loaded once; not thread-safe (llama_cpp is not): callers hold a lock."""

    def __init__(self, path: Path, *, n_ctx: int = DEFAULT_CTX, n_threads: int | None = None) -> None:
        # Imported here: the project's own venv has no llama_cpp, and imports this module for its types.
        from llama_cpp import Llama, llama_vocab_is_eog
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        self.path = path
        self.sha256 = file_sha256(path)
        self.n_ctx = n_ctx
        threads = n_threads or max(1, len(os.sched_getaffinity(0)))
        # logits_all: the logits of every position, the answer's included, from one evaluation.
        # Flash attention as llama-server uses it on a CPU (its default "auto" turns it on there); off,
        # an honest node's gaps were no smaller (the batch shape, not the attention, makes them).
        self._llm: Any = Llama(
            model_path=str(path),
            n_ctx=n_ctx,
            n_threads=threads,
            n_threads_batch=threads,
            logits_all=True,
            flash_attn=True,
            seed=0,
            verbose=False,
        )
        metadata: Mapping[str, str] = self._llm.metadata
        template = metadata.get("tokenizer.chat_template")
        if not template:
            raise ScoreError(f"{path} has no chat template (tokenizer.chat_template)")
        model = self._llm._model  # the model's own token texts, as llama-cpp-python's server uses them
        bos, eos = self._llm.token_bos(), self._llm.token_eos()
        self._formatter = Jinja2ChatFormatter(
            template=template,
            eos_token=model.token_get_text(eos) if eos != -1 else "",
            bos_token=model.token_get_text(bos) if bos != -1 else "",
            add_generation_prompt=True,
        )
        # Every token that ends a generation (EOS, EOT, <|im_end|>...): a node that stopped emitted one.
        vocab = model.vocab
        self._eog = frozenset(t for t in range(self._llm.n_vocab()) if llama_vocab_is_eog(vocab, t))
        self._eog_ids = np.array(sorted(self._eog))
        self._pieces: dict[int, bytes] = {}

    def render(self, messages: Sequence[Mapping[str, Any]]) -> str:
        """The chat prompt's text, as llama-server renders it for this file (its chat template)."""
        return str(self._formatter(messages=list(messages)).prompt)

    def tokenize_prompt(self, prompt_text: str) -> list[int]:
        # As llama-server does: special tokens parsed (<|im_start|>...), BOS where the model wants one.
        return list(self._llm.tokenize(prompt_text.encode(), add_bos=True, special=True))

    def tokenize_answer(self, answer_text: str) -> list[int]:
        # Plain text: an answer that spells out "<|im_end|>" did not emit the token.
        if not answer_text:
            return []
        return list(self._llm.tokenize(answer_text.encode(), add_bos=False, special=False))

    def score(self, prompt_text: str, answer_text: str, stopped: bool) -> Scored:
        """Gaps of the node's answer (its text, tokenized here) to the rendered prompt; `stopped`: it
        ended on its own (finish_reason "stop"), so an end-of-generation token follows the answer."""
        started = time.process_time()
        prompt = self.tokenize_prompt(prompt_text)
        answer = self.tokenize_answer(answer_text)
        self._evaluate(prompt, answer)
        answer = self._align(prompt, answer, answer_text.encode(), stopped)
        if not stopped:
            answer = self._held_back(prompt, answer)
        return self._scored(prompt, answer, stopped, started)

    def score_ids(self, prompt_text: str, answer_ids: Sequence[int], stopped: bool) -> Scored:
        """As score(), with the answer as the node's own token ids (no retokenizing of its text). Where
        it stopped, a last end-of-generation id may be given or not (llama-server's logprobs list it):
        that position is scored either way."""
        started = time.process_time()
        n_vocab = self._llm.n_vocab()
        if any(not 0 <= t < n_vocab for t in answer_ids):
            raise ScoreError(f"answer token ids must lie in [0, {n_vocab})")
        answer = list(answer_ids)
        if stopped and answer and answer[-1] in self._eog:
            answer.pop()
        prompt = self.tokenize_prompt(prompt_text)
        self._evaluate(prompt, answer)
        return self._scored(prompt, answer, stopped, started)

    def _evaluate(self, prompt: list[int], answer: list[int]) -> None:
        if len(prompt) + len(answer) > self.n_ctx:
            raise PromptTooLong(
                f"{len(prompt)} prompt and {len(answer)} answer tokens exceed the reference's {self.n_ctx}"
            )
        if not prompt:
            raise ScoreError("the prompt renders to no tokens")
        self._llm.reset()  # no state carried from the last evaluation: each score is the same alone
        self._llm.eval(prompt + answer)

    def _align(self, prompt: list[int], answer: list[int], text: bytes, stopped: bool) -> list[int]:
        """The answer's tokens, split again where a token the reference ranks higher spells the text's
        next bytes.

        Tokenizing a text gives one of its tokenizations, not always the one the node's model emitted:
        two "\n" tokens come back as one "\n\n", and an answer cut by max_tokens between them scores a
        gap that no honest node deserves; a node that took "iv" at a near tie with "ê" after "arr" wrote
        "arrivation", which comes back as "arr" "ivation", a token its model ranks far lower; one that
        wrote "A" "mar" "i" comes back as "Am" "ari". Where a token ranked above the text's own spells
        the text's next bytes, the text is split after the highest-ranked such token and the rest
        tokenized again, and so on at the next token while one ranked above spells the text (`_split`);
        the split is kept where it lowers the largest gap from there on (a near-tie the node took the
        other way is no reason to leave its path). Only tokenizations of the same text are tried, so a
        wrong answer stays wrong.
        """
        n, i, offset, tries = len(prompt), 0, 0, 0
        while i < len(answer) and tries < MAX_SPLITS:
            if self._best_spelling(self._llm.scores[n + i - 1], answer[i], text, offset) != answer[i]:
                before = self._largest_gap(prompt, answer, i, stopped)
                kept = np.array(self._llm.scores[n + i : n + len(answer)])
                split, tried = self._split(n, answer, i, text, offset, MAX_SPLITS - tries)
                tries += max(tried, 1)
                if tried and self._largest_gap(prompt, split, i, stopped) < before:
                    answer = split
                elif tried:  # back as it was: the cache evaluated again, the logits as first read
                    self._evaluate_from(n + i, answer[i:])
                    self._llm.scores[n + i : n + len(answer)] = kept
            offset += len(self._piece(answer[i]))
            i += 1
        return answer

    def _split(
        self, n: int, answer: list[int], i: int, text: bytes, offset: int, most: int
    ) -> tuple[list[int], int]:
        """The answer split from token i on, at most `most` times, each where a token ranked above the
        tokenization's own spells the text's next bytes, and evaluated; and how many splits it took."""
        split, splits = answer, 0
        while i < len(split) and splits < most:
            best = self._best_spelling(self._llm.scores[n + i - 1], split[i], text, offset)
            if best == split[i]:
                break
            offset += len(self._piece(best))
            try:
                tail = self.tokenize_answer(text[offset:].decode())
            except UnicodeDecodeError:  # the split falls inside a character: not one to try
                break
            # The same text or nothing: a tokenizer that puts a space before what it is given (a
            # SentencePiece vocabulary's prefix) would score another text.
            if n + i + 1 + len(tail) > self.n_ctx or b"".join(map(self._piece, tail)) != text[offset:]:
                break
            split = [*split[:i], best, *tail]
            self._evaluate_from(n + i, split[i:])
            splits += 1
            i += 1
        return split, splits

    def _best_spelling(self, row: Any, token: int, text: bytes, offset: int) -> int:
        """Of the tokens the row ranks above `token` (which spells the text's next bytes), the
        highest-ranked that spells them too, among the top SPELLING_RANKS; else `token`."""
        best = int(np.argmax(row))
        if best == token:
            return token
        row = np.asarray(row)
        top = np.argpartition(row, -SPELLING_RANKS)[-SPELLING_RANKS:]
        for candidate in top[np.argsort(-row[top])]:
            if row[candidate] <= row[token]:
                break
            piece = self._piece(int(candidate))
            if piece and text.startswith(piece, offset):
                return int(candidate)
        return token

    def _held_back(self, prompt: list[int], answer: list[int]) -> list[int]:
        """The answer with its last token taken as the reference's own choice where that choice
        spells the last token's text and then only the start of a character.

        An answer cut by max_tokens can end on a token that spells a character's first bytes (" " and
        the first byte of "¥", say): the server holds those bytes back, since they are no text yet,
        and sends the rest (" "). Tokenized back, the text ends on a token the node did not emit.
        Only bytes that cannot be text are filled in, so a wrong answer stays wrong."""
        if not answer:
            return answer
        best = int(np.argmax(self._llm.scores[len(prompt) + len(answer) - 2]))
        sent, spelled = self._piece(answer[-1]), self._piece(best)
        if best != answer[-1] and spelled.startswith(sent) and _a_character_begun(spelled[len(sent) :]):
            return [*answer[:-1], best]
        return answer

    def _evaluate_from(self, position: int, tokens: list[int]) -> None:
        self._llm.n_tokens = position  # what comes before stays evaluated; the rest is forgotten
        self._llm.eval(tokens)

    def _largest_gap(self, prompt: list[int], answer: list[int], start: int, stopped: bool) -> float:
        return max(self._gaps(prompt, answer, stopped, start=start), default=0.0)

    def _piece(self, token: int) -> bytes:
        # A control token (EOS, <|im_start|>) spells nothing in plain text: b"".
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = bytes(self._llm._model.detokenize([token]))
        return piece

    def _gaps(self, prompt: list[int], answer: list[int], stopped: bool, start: int = 0) -> list[float]:
        """The answer's gaps from its token `start` on, and the end of generation's where it stopped."""
        total = len(prompt) + len(answer)
        # Row i of the logits predicts token i + 1: the answer's tokens are predicted by the rows from
        # the prompt's last on, and the end of generation by the answer's last row.
        end = total if stopped else total - 1
        rows = np.asarray(self._llm.scores[len(prompt) - 1 + start : end], dtype=np.float32)
        best = rows.max(axis=1)
        taken = answer[start:]
        gaps = best[: len(taken)] - rows[np.arange(len(taken)), taken]
        if stopped:
            gaps = np.append(gaps, best[-1] - rows[-1, self._eog_ids].max())
        return [float(g) for g in gaps]

    def _scored(self, prompt: list[int], answer: list[int], stopped: bool, started: float) -> Scored:
        return Scored(
            gaps=self._gaps(prompt, answer, stopped),
            prompt_tokens=len(prompt),
            answer_tokens=len(answer),
            cpu_s=time.process_time() - started,
        )


def _a_character_begun(data: bytes) -> bool:
    """Whether the bytes are the start of one UTF-8 character and no more (not yet text)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        return bool(data) and decoder.decode(data, final=False) == ""
    except UnicodeDecodeError:
        return False
