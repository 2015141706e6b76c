"""A gpt-oss (harmony) reply on the terminal: the `final` channel as the answer, `analysis` as reasoning, tool calls
as calls, read with the server's `HarmonyReader` as the reply streams.

The answer goes to stdout alone, so `ggufpy run --chat ... > answer.txt` keeps what the server returns as
`content`; reasoning goes to stderr, dimmed on a terminal and prefixed `[reasoning]` elsewhere. Models that do
not write harmony are printed as they are (`reply_view` gives None).
"""

from __future__ import annotations

import sys
from typing import TextIO

from ..server.harmony import CallDelta, HarmonyReader, Reasoning, merge

DIM, RESET = "\x1b[2m", "\x1b[0m"
REASONING_TAG = "[reasoning] "
CALL_TAG = "[tool call] "


def speaks_harmony(template) -> bool:
    """Whether the chat template is gpt-oss's (its replies are harmony messages), as the server decides it."""
    from ..server.tools import detect

    return detect(template.template)[0].name == "harmony"


def reply_view(template, out: TextIO | None = None, notes: TextIO | None = None) -> HarmonyView | None:
    """A `HarmonyView` for a chat template whose model writes harmony, else None (print the text as it is)."""
    return HarmonyView(out or sys.stdout, notes or sys.stderr) if speaks_harmony(template) else None


class HarmonyView:
    """A file-like target for a streamed reply (`write`, `flush`) that prints it by channel; `close()` at the end
    of the reply returns (the answer, the reasoning, the tool calls as OpenAI dicts)."""

    def __init__(self, out: TextIO, notes: TextIO):
        self.out, self.notes = out, notes
        self.reader = HarmonyReader(calls=True)  # no tools are offered here, but a call is shown for what it is
        self.pieces: list = []
        self.where: str | None = None  # the part being written: "answer", "reasoning", "call"
        self.dim = notes.isatty()

    def write(self, text: str) -> None:
        for piece in self.reader.feed(text):
            self._show(piece)

    def flush(self) -> None:
        self.out.flush()
        self.notes.flush()

    def close(self) -> tuple[str, str, list[dict]]:
        for piece in self.reader.close():
            self._show(piece)
        self._switch(None)
        self.flush()
        return merge(self.pieces)

    def _show(self, piece: str | Reasoning | CallDelta) -> None:
        self.pieces.append(piece)
        if isinstance(piece, Reasoning):
            self._switch("reasoning")
            self.notes.write(piece.text)
        elif isinstance(piece, CallDelta):
            self._switch("call", piece.name)
            self.out.write(piece.arguments)
        else:
            self._switch("answer")
            self.out.write(piece)

    def _switch(self, where: str | None, call_name: str | None = None) -> None:
        """End the part being written and begin `where` (a new call always begins a new part)."""
        if where == self.where and call_name is None:
            return
        if self.where == "reasoning":
            self.notes.write(RESET + "\n" if self.dim else "\n")
        elif self.where == "call" and where is not None:  # the last line is ended by the caller, as any reply
            self.out.write("\n")
        if where == "reasoning":
            self.notes.write(DIM if self.dim else REASONING_TAG)
        elif where == "call":
            self.out.write(f"{CALL_TAG}{call_name} ")
        self.where = where
