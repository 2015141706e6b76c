"""Structured output: a request's grammar as a token mask applied to its logits before each sampling step.

    table = token_table(model.tokenizer)                    # once per model (~0.6 s for a 49k vocabulary)
    grammar = compile_grammar("json_schema", schema, table)  # GrammarError (a 400) when it is not valid
    constraint = Constraint(table, grammar)                  # one per choice
    logits = constraint.apply(logits); token = sample(logits); constraint.advance(token)

The grammars are llguidance's (JSON schema, Lark; GBNF through its `gbnf_to_lark`, as llama.cpp's server
accepts). The mask is a pure function of the request's own tokens, so a constrained row stays batch-invariant.
llguidance needs the vocabulary as token bytes: built here from the GGUF vocabulary (`Vocab.pieces`), control
tokens and the user-defined ones spelled like chat tags (`Tokenizer.control_like`) prefixed with 0xFF, the mark
of llguidance's llama.cpp adapter (`llguidance/llamacpp.py`, which marks every `<...>` user-defined token: Gemma's
HTML-tag tokens stay text here), so grammar text never matches a control token's spelling.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..tokenizer.vocab import TokenAttr

# JSON without optional whitespace: a free `[ \n\t]*` between tokens lets a small model pad forever
JSON_DEFAULTS = {"whitespace_flexible": False}
SPECIAL_PREFIX = b"\xff"  # llguidance's marker of a special token's bytes


class GrammarError(ValueError):
    """A response_format, grammar or tool schema that cannot be compiled (shown to the client as a 400)."""


def _llguidance():
    try:
        import llguidance
    except ImportError as e:  # the `server` extra installs it
        raise GrammarError(f"structured output needs llguidance (pip install 'ggufpy[server]'): {e}") from None
    return llguidance


@functools.lru_cache(maxsize=4)
def token_table(tokenizer):
    """llguidance's `LLTokenizer` for a ggufpy `Tokenizer`: every id's bytes, the end-of-generation ids as EOS."""
    llg = _llguidance()
    vocab = tokenizer.vocab
    # llguidance's special tokens: grammar text never produces them, a grammar names them (`<|end|>` in Lark).
    # Control and unknown tokens and the tag-like user-defined ones (gpt-oss's <|end|>), marked in their bytes
    # too; plain user-defined tokens (gemma's "<table>", whitespace runs) are text like any other.
    special = special_ids(tokenizer)
    pieces = [SPECIAL_PREFIX + p if i in special else p for i, p in enumerate(vocab.pieces)]

    class _Vocabulary:  # what `llguidance.TokenizerWrapper` reads
        eos_token_id = tokenizer.eos_id
        bos_token_id = tokenizer.bos_id
        tokens = pieces
        special_token_ids = tuple(sorted(special))

        def __call__(self, text: str) -> list[int]:
            # content=True: a tag-like user-defined token, which llama.cpp matches in any text, is spelled out
            # here, so the tokens llguidance forces for grammar text are never special (a forced one is refused)
            return tokenizer.encode(text, add_special=False, content=True)

    eog = sorted(tokenizer.eog_ids) or [tokenizer.eos_id]
    return llg.LLTokenizer(llg.TokenizerWrapper(_Vocabulary()), eos_token=eog)


def special_ids(tokenizer) -> set[int]:
    """The ids llguidance takes as special tokens (see `token_table`)."""
    unparsed = int(TokenAttr.CONTROL | TokenAttr.UNKNOWN)
    return {i for i, a in enumerate(tokenizer.vocab.attrs.tolist()) if a & unparsed} | tokenizer.control_like


def _json_schema(schema: Any) -> str:
    if not isinstance(schema, dict):
        raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}: {schema!r:.80}")
    return _llguidance().LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_DEFAULTS)


def _gbnf(text: str) -> str:
    from llguidance.gbnf_to_lark import gbnf_to_lark

    try:
        lark = gbnf_to_lark(text)
    except Exception as e:  # the converter raises bare Exceptions for unknown rules
        raise GrammarError(f"grammar: not valid GBNF: {e}") from None
    return _llguidance().LLMatcher.grammar_from_lark(lark)


# grammar kind -> its source to llguidance's grammar string (not yet checked against the vocabulary)
GRAMMARS: dict[str, Callable[[Any], str]] = {
    "json_object": lambda _: _json_schema({"type": "object"}),
    "json_schema": _json_schema,
    "gbnf": _gbnf,
    "lark": lambda text: _llguidance().LLMatcher.grammar_from_lark(text),
}


def compile_grammar(kind: str, source: Any, table) -> str:
    """llguidance's grammar for `source` of `kind` (a key of `GRAMMARS`), checked against the vocabulary."""
    if kind not in GRAMMARS:
        raise GrammarError(f"grammar kind {kind!r}: expected one of {sorted(GRAMMARS)}")
    grammar = GRAMMARS[kind](source)
    is_error, messages = _llguidance().LLMatcher.validate_grammar_with_warnings(grammar, table)
    if is_error:
        raise GrammarError(f"{kind}: {messages[0] if messages else 'invalid'}")
    return grammar


class Constraint:
    """One sequence's grammar state: which tokens may come next (`apply`), and the token that came (`advance`)."""

    def __init__(self, table, grammar: str):
        llg = _llguidance()
        self.matcher = llg.LLMatcher(table, grammar, log_level=0)
        if self.matcher.is_error():
            raise GrammarError(self.matcher.get_error())
        self.n_vocab = table.vocab_size
        self._bits = np.zeros((self.n_vocab + 31) // 32, np.int32)

    def apply(self, logits: np.ndarray) -> np.ndarray:
        """A copy of `logits` (V,) with every token the grammar forbids here at -inf."""
        self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        allowed = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self.n_vocab].astype(bool)
        out = np.full(logits.shape, -np.inf, dtype=logits.dtype)
        n = min(self.n_vocab, logits.shape[0])  # ids past the vocabulary (padding rows) stay forbidden
        out[:n] = np.where(allowed[:n], logits[:n], -np.inf)
        return out

    def advance(self, token: int) -> None:
        """Move past `token` (one `apply` allowed); a token the grammar refuses is a bug, reported as ValueError."""
        if not self.matcher.consume_token(int(token)):
            raise ValueError(f"structured output: token {token} does not fit the grammar: {self.matcher.get_error()}")

    @property
    def finished(self) -> bool:
        """The grammar is complete and admits nothing more: the response ends here."""
        return self.matcher.is_stopped()


def lazy_grammar(call, tokenizer) -> str:
    """Lark (llguidance) for what follows a `tools.LazyCall`'s trigger: a little whitespace, the call's JSON, a
    little whitespace and its closing tag, written out or as the one special token some vocabularies have for
    it (Qwen's `</tool_call>`, a tag-like user-defined token llguidance marks special); the JSON alone for a
    call without a closing tag (Llama 3's)."""
    if not call.close:
        return f"start: {call.body}\n{call.rules}"
    close = json.dumps(call.close)
    token = tokenizer.vocab.token_to_id.get(call.close)
    if token is not None and token in special_ids(tokenizer):
        close = f"({close} | <[{token}]>)"
    return f"start: WS? {call.body} WS? {close}\nWS: /[ \\t\\r\\n]{{1,4}}/\n"


class LazyConstraint:
    """llama.cpp's lazy grammar (`grammar_lazy` with a word trigger, common/sampling.cpp) on llguidance: no mask
    until the reply's text contains one of `call.triggers`, then `grammar` (`lazy_grammar`: the rest of one call)
    until it is complete; then free again when `call.repeat` (parallel tool calls), else the reply is over
    (`finished`). A trigger `at_start` (Llama 3's `{`) is looked for in the reply's first text only, and fed
    to the grammar with what follows it. The same interface as `Constraint` (what the scheduler calls), so a
    row stays batch-invariant.

    The trigger is found in the tokens' bytes (`Vocab.pieces`), so it may be spelled out over several tokens or
    be one special token (Qwen's `<tool_call>`), and it may begin in the `prompt`'s last bytes, which the reply
    continues (gpt-oss's recipient right after the prompt's `<|start|>assistant`). Text after the trigger in the
    same token is fed to the grammar first (its tokens by llguidance's tokenizer); if the grammar refuses it,
    that call stays free."""

    def __init__(self, table, tokenizer, grammar: str, call, prompt: Sequence[int] = ()):
        self.pieces = tokenizer.vocab.pieces
        self.tokenize = table.tokenize_bytes
        self.triggers = [t.encode() for t in call.triggers]
        self.keep = max(map(len, self.triggers)) - 1  # bytes of free text that may hold a trigger's beginning
        self.repeat = call.repeat
        self.at_start = call.at_start
        self.opened = False  # at_start: the reply's first text has come
        self.call = Constraint(table, grammar)  # built before the job runs, reset after each call
        self.active = False  # inside a call: its grammar masks the logits
        self.tail = b""  # the end of the free text, which may hold the trigger's beginning
        if not self.at_start:  # the reply continues the prompt's text: a trigger may begin there (gpt-oss's
            # recipient right after the prompt's `<|start|>assistant`: llama.cpp's "assistant to=functions.")
            end = b"".join(self.pieces[int(t)] for t in prompt[max(len(prompt) - self.keep, 0) :])
            self.tail = end[len(end) - min(len(end), self.keep) :]
        self.done = False

    def apply(self, logits: np.ndarray) -> np.ndarray:
        return self.call.apply(logits) if self.active else logits

    def advance(self, token: int) -> None:
        if self.active:
            self.call.advance(token)
            if self.call.finished:  # the call is complete: free text again, or the end
                self.active, self.done = False, not self.repeat
                self.call.matcher.reset()
            return
        text = self.tail + self.pieces[int(token)]
        if self.at_start:
            if self.opened:  # the reply opened with other text: free to its end
                return
            if not text.strip():  # whitespace so far: the reply has not opened yet
                self.tail = text
                return
            self.tail, self.opened, rest = b"", True, text.lstrip()
            if rest.startswith(self.triggers[0]) and self.call.matcher.consume_tokens(self.tokenize(rest)):
                self.active = True
            else:
                self.call.matcher.reset()
            return
        found = [(at, -len(t)) for t in self.triggers if (at := text.find(t)) >= 0]
        if not found:
            self.tail = text[len(text) - min(len(text), self.keep) :]
            return
        at, minus = min(found)  # the first trigger, the longest of those starting there
        self.tail, rest = b"", text[at - minus :]
        if self.call.matcher.consume_tokens(self.tokenize(rest)) if rest else True:
            self.active = True
        else:
            self.call.matcher.reset()

    @property
    def finished(self) -> bool:
        return self.done
