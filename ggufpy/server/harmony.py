"""gpt-oss's harmony format, read back from a reply as it streams (`HarmonyReader`).

A gpt-oss reply, after the prompt's `<|start|>assistant`, is a sequence of messages, each a header, the body
and its end (openai-cookbook `articles/openai-harmony.md`; llama.cpp `common/parsers/gpt-oss.cpp`):

    <|channel|>analysis<|message|>The user asks for the weather.<|end|>
    <|start|>assistant<|channel|>final<|message|>It is sunny.                      (<|return|>: end of generation)
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}
                                                                                       (<|call|>: end of generation)

The recipient (` to=functions.NAME`) may also stand before the channel (`<|start|>assistant to=functions.NAME
<|channel|>commentary json<|message|>`, as the chat template writes past calls). As llama.cpp's server does, the
`analysis` channel becomes `reasoning_content`, `final` and `commentary` without a recipient (a preamble) become
content, a message to `functions.NAME` a tool call whose arguments are the body as written; a message to any
other recipient (the built-in `browser`, `python`) is dropped, as are calls when no tools were offered, and so is
what follows a <|call|> or <|return|>. Text that is not harmony (a reply a GBNF grammar forced) is content.

Only real tags are structure: the server feeds the reply as it comes from the token ids, `feed(text, special)`,
a special token's text alone (`special=True`) and the text between them (`special=False`), so a value that
spells out "<|end|>" (the characters, not the token) stays text. A reply known only as text (`feed(text)`)
is read with every tag spelled out taken for the tag, as llama.cpp's parser reads text.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass

TAGS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|constrain|>")
# Inside the reader a tag is one character, a lone surrogate: decoded text is valid Unicode and never holds one,
# so text that spells a tag out cannot be taken for it
_MARK = {tag: chr(0xD800 + i) for i, tag in enumerate(TAGS)}
_SPELL = {ord(mark): tag for tag, mark in _MARK.items()}  # str.translate: marks back to the tags' text
_NO_MARKS = dict.fromkeys(_SPELL, "\ufffd")  # (text never holds a surrogate; should one come, it is not a tag)
START, CHANNEL, MESSAGE, END, CALL, RETURN, CONSTRAIN = (_MARK[t] for t in TAGS)
ENDS = (END, CALL, RETURN)  # a body's end; <|call|> and <|return|> also end the generation
FUNCTIONS = "functions."  # the namespace the chat template declares the request's tools in
MAX_HEADER = 256  # characters a header may take before the reply is taken for plain text
_NOT_NAME = r"\s" + "".join(_MARK.values())  # what ends a role or a recipient: whitespace or a tag
# `[<|start|>ROLE][ to=RECIPIENT]<|channel|>CHANNEL[ to=RECIPIENT][ [<|constrain|>]TYPE]` before <|message|>;
# gpt-oss-20b sometimes writes a stray `<|channel|>commentary[ to=assistant]` first (llama.cpp skips it too)
_HEADER = re.compile(
    rf"\s*(?:{START}[^{_NOT_NAME}]*)?\s*(?:{CHANNEL}commentary(?:\s*to=assistant)?(?={CHANNEL}))?"
    rf"\s*(?:to=(?P<before>[^{_NOT_NAME}]+))?\s*{CHANNEL}(?P<channel>[\w-]+)"
    rf"(?:\s*to=(?P<after>[^{_NOT_NAME}]+))?(?:\s*{CONSTRAIN}?[\w-]+)?\s*",
    re.ASCII,
)


@dataclass(frozen=True)
class Reasoning:
    """A piece of the `analysis` channel: streamed as `reasoning_content`."""

    text: str


@dataclass(frozen=True)
class CallDelta:
    """A piece of tool call number `index`: the first names it (`id`, `name`), the others add `arguments` text."""

    index: int
    id: str | None
    name: str | None
    arguments: str

    def as_openai(self) -> dict:
        fn = {"arguments": self.arguments} if self.name is None else {"name": self.name, "arguments": self.arguments}
        head = {} if self.id is None else {"id": self.id, "type": "function"}
        return {"index": self.index, **head, "function": fn}


class HarmonyReader:
    """Reads a harmony reply as it streams: `feed(text, special)` and `close()` return the pieces known so far,
    each content (a `str`), `Reasoning` or a `CallDelta`. `special`: True for the text of one special token,
    False for text between them (never structure), None for text in which tags are spelled out (partial tags
    are held until they are known). `calls=False` (no tools offered) drops calls instead of reporting them."""

    def __init__(self, calls: bool = True):
        self.accept_calls = calls
        self.buffer = ""  # the reply not read yet, each tag one mark character (`_MARK`)
        self.spelled = ""  # `feed(text)` text that may still end in a tag's beginning
        self.state = "header"  # header: before a message's <|message|>; body: in it; plain: not harmony; done
        self.kind: str | None = None  # the body's destination: content, reasoning, call, drop
        self.calls = 0  # calls read so far (each streamed as it comes: CallDelta.index)

    def feed(self, text: str, special: bool | None = None) -> list[str | Reasoning | CallDelta]:
        if special is None:
            self.spelled += text
            keep = max(partial_suffix(self.spelled, tag) for tag in TAGS)
            self._spell_out(len(self.spelled) - keep)
        else:
            self._spell_out(len(self.spelled))  # a piece ends what came before: held text is text
            text = text.translate(_NO_MARKS)
            self.buffer += _MARK.get(text, text) if special else text  # another special token's text is text
        return self._release(final=False)

    def close(self) -> list[str | Reasoning | CallDelta]:
        self._spell_out(len(self.spelled))
        return self._release(final=True)

    def _spell_out(self, n: int) -> None:
        """Move the first `n` characters of spelled-out text to the buffer, each tag in them as its mark."""
        text, self.spelled = self.spelled[:n].translate(_NO_MARKS), self.spelled[n:]
        for tag, mark in _MARK.items():
            text = text.replace(tag, mark)
        self.buffer += text

    def _release(self, final: bool) -> list[str | Reasoning | CallDelta]:
        out: list[str | Reasoning | CallDelta] = []
        while self.buffer:
            if self.state in ("plain", "done"):  # the rest is content, or nothing
                out.append(self.buffer.translate(_SPELL) if self.state == "plain" else "")
                self.buffer = ""
            elif self.state == "header":
                if not self._header(final, out):
                    break
            else:
                self._body(out)
        return [p for p in out if not isinstance(p, str) or p]

    def _header(self, final: bool, out: list) -> bool:
        """Read a message header when it is complete; False when more text is needed."""
        end = self.buffer.find(MESSAGE)
        if end < 0:
            if not _may_begin_header(self.buffer):
                self.state = "plain"  # not harmony: the text as the model wrote it
                return True
            if final:
                self.buffer = ""  # a header cut off by the end of the reply: it carries no text
            return False
        match = _HEADER.fullmatch(self.buffer[:end])
        if match is None:
            self.state = "plain"
            return True
        recipient = match["before"] or match["after"]
        self.buffer = self.buffer[end + 1 :]
        self.state = "body"
        if recipient is None:
            self.kind = "reasoning" if match["channel"] == "analysis" else "content"
        elif recipient.startswith(FUNCTIONS) and self.accept_calls:
            self.kind = "call"
            call_id = f"call_{uuid.uuid4().hex[:24]}"
            out.append(CallDelta(self.calls, call_id, recipient[len(FUNCTIONS) :], ""))
            self.calls += 1
        else:
            self.kind = "drop"  # built-in tools (browser, python) and calls nobody offered
        return True

    def _body(self, out: list) -> None:
        """Release the body read so far (a tag is whole: nothing waits); at its end, go back to a header."""
        stop = min((i for i in map(self.buffer.find, ENDS) if i >= 0), default=-1)
        text, tag = (self.buffer, None) if stop < 0 else (self.buffer[:stop], self.buffer[stop])
        self.buffer = "" if tag is None else self.buffer[stop + 1 :]
        if text:
            out.append(self._piece(text.translate(_SPELL)))
        if tag is not None:  # after <|call|> or <|return|> (the end of the generation) nothing is read
            self.state, self.kind = "header" if tag == END else "done", None

    def _piece(self, text: str) -> str | Reasoning | CallDelta:
        if self.kind == "reasoning":
            return Reasoning(text)
        if self.kind == "call":
            return CallDelta(self.calls - 1, None, None, text)
        return text if self.kind == "content" else ""


def _may_begin_header(text: str) -> bool:
    """Whether `text` (no <|message|> yet) can still grow into a header: it starts like one, or is short."""
    head = text.lstrip()
    if not head:
        return True
    starts = (START, CHANNEL, "to=")
    if not any(head.startswith(s) or s.startswith(head) for s in starts):
        return False
    return len(text) <= MAX_HEADER


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag` (held: it may become the tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def merge(pieces) -> tuple[str, str, list[dict]]:
    """(content, reasoning, OpenAI tool calls) of a whole reply's pieces."""
    content, reasoning, calls = [], [], {}
    for p in pieces:
        if isinstance(p, str):
            content.append(p)
        elif isinstance(p, Reasoning):
            reasoning.append(p.text)
        elif p.id is not None:
            calls[p.index] = {"id": p.id, "type": "function", "function": {"name": p.name, "arguments": p.arguments}}
        else:
            calls[p.index]["function"]["arguments"] += p.arguments
    return "".join(content), "".join(reasoning), [calls[i] for i in sorted(calls)]
