"""Hermes / Qwen and Llama 3 tool calls read as they stream: a first delta with the call's name as soon as it is
certain to be a call, then the arguments in pieces, as OpenAI (and llama.cpp's server, `common_chat_msg_diff`)
stream them.

    r = ToolCallReader(FORMATS["hermes"])
    pieces = r.feed(text) + ... + r.close()   # content (str) and harmony.CallDelta pieces, in order

A call's arguments are sent as `json.dumps(arguments, ensure_ascii=False)` of the object the model wrote (what
the whole reply always gave): `JsonValue` re-writes the JSON text as it comes in that form (`, ` and `: ` between
items, no other whitespace, strings and numbers as Python's json writes them back), releasing only what can no
longer change: a number when it ends, a string's text up to an unfinished escape. So the pieces of a call,
concatenated, are its final arguments, and the non-streamed reply (`tools.reply`, the same reader fed the whole
text) is that concatenation by construction.

A call is sent from the moment its object has given a string `name` and the first `{` of its arguments
(`arguments`, or `parameters` for Llama 3); until then it is held, and one that turns out not to be a call is
released as the text it was (as before streaming). A sent call stays a call: JSON that breaks off inside its
arguments (a model writing freely; with `tool_choice: "auto"` Hermes calls are constrained, constrain.py's
`LazyConstraint`) ends its arguments there, and the rest of that call's text is dropped. Only text that cannot
become the call's closing tag (`</tool_call>`) is parsed; the call object's own `}` and any keys after the
arguments are structure, never argument text.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from .harmony import CallDelta, partial_suffix

_WS = frozenset(" \t\n\r")  # JSON's whitespace (what Python's json.loads skips)
_SCALAR = frozenset("0123456789+-.eEtrufalsnNIiy")  # characters of numbers and true/false/null/NaN/Infinity
_ESCAPES = frozenset('"\\/bfnrtu')
_HEX = frozenset("0123456789abcdefABCDEF")


class JsonValue:
    """One JSON value read character by character: `feed(text)` takes what belongs to it (stopping after its
    end) and `take()` returns its canonical text released since the last call, the text `json.dumps(value,
    ensure_ascii=False)` of the whole value begins with. `failed`: the text is not JSON (Python's `json.loads`,
    strict strings, NaN and Infinity allowed); `done`: the value is complete."""

    def __init__(self):
        self.stack: list[str] = []  # open containers: "{" or "["
        self.expect = "value"  # value | first_value | key | first_key | colon | after
        self.kind = ""  # the token being read: '"' a string, "s" a number or literal, "" none
        self.raw = ""  # its text so far (a string's without the opening quote)
        self.is_key = False
        self.esc = -1  # where an unfinished escape starts in `raw`
        self.high = -1  # where a finished \\uD8xx escape, which the next escape may pair with, starts
        self.sent = 0  # characters of the string's canonical text released
        self.done = self.failed = False
        self._out: list[str] = []

    def take(self) -> str:
        if self.kind == '"' and not self.failed:
            self._string_text(len(self.raw) if self.esc < 0 and self.high < 0 else min(self._held()))
        out, self._out = "".join(self._out), []
        return out

    def feed(self, text: str) -> int:
        """Read `text` up to this value's end; the number of characters that belong to it."""
        for i, ch in enumerate(text):
            if self.done or self.failed or not self._char(ch):
                return i
        return len(text)

    def _held(self) -> list[int]:
        return [i for i in (self.esc, self.high) if i >= 0]

    def _char(self, ch: str) -> bool:
        if self.kind == '"':
            return self._string_char(ch)
        if self.kind == "s":
            if ch in _SCALAR:
                self.raw += ch
                return True
            if not self._end_scalar() or self.done:
                return False  # not JSON, or a top-level number ended before `ch`
        if ch in _WS:
            return True
        e = self.expect
        if e in ("value", "first_value"):
            if ch == "]" and e == "first_value":
                return self._close("[")
            if ch in "{[":
                self._out.append(ch)
                self.stack.append(ch)
                self.expect = "first_key" if ch == "{" else "first_value"
                return True
            if ch == '"':
                return self._open_string(key=False)
            if ch in _SCALAR:
                self.kind, self.raw = "s", ch
                return True
        elif e in ("key", "first_key"):
            if ch == "}" and e == "first_key":
                return self._close("{")
            if ch == '"':
                return self._open_string(key=True)
        elif e == "colon" and ch == ":":
            self._out.append(": ")
            self.expect = "value"
            return True
        elif e == "after":
            if ch == ",":
                self._out.append(", ")
                self.expect = "key" if self.stack[-1] == "{" else "value"
                return True
            if ch in "}]" and self.stack[-1] == {"}": "{", "]": "["}[ch]:
                return self._close(self.stack[-1])
        return self._fail()

    def _fail(self) -> bool:
        self.failed = True
        return False

    def _close(self, container: str) -> bool:
        self.stack.pop()
        self._out.append("}" if container == "{" else "]")
        self._value_end()
        return True

    def _value_end(self) -> None:
        if self.is_key:
            self.is_key, self.expect = False, "colon"
        elif not self.stack:
            self.done = True
        else:
            self.expect = "after"

    def _end_scalar(self) -> bool:
        try:
            value = json.loads(self.raw)
        except ValueError:
            return self._fail()
        self._out.append(json.dumps(value))
        self.kind, self.raw = "", ""
        self._value_end()
        return True

    def _open_string(self, key: bool) -> bool:
        self.kind, self.raw, self.is_key, self.sent, self.esc, self.high = '"', "", key, 0, -1, -1
        self._out.append('"')
        return True

    def _string_char(self, ch: str) -> bool:
        if self.esc >= 0:  # inside \\X or \\uXXXX
            n = len(self.raw) - self.esc
            if ch not in (_ESCAPES if n == 1 else _HEX):
                return self._fail()
            self.raw += ch
            if (n == 1 and ch != "u") or n == 5:
                self._escape_end()
            return True
        if ch == '"':
            self._string_text(len(self.raw))
            if self.failed:
                return False
            self._out.append('"')
            self.kind, self.raw = "", ""
            self._value_end()
            return True
        if ord(ch) < 0x20:  # a raw control character: json.loads (strict) refuses it
            return self._fail()
        if ch == "\\":
            self.esc = len(self.raw)
        else:
            self.high = -1  # a pending high surrogate stays alone
        self.raw += ch
        return True

    def _escape_end(self) -> None:
        start, self.esc = self.esc, -1
        code = int(self.raw[start + 2 :], 16) if self.raw[start + 1] == "u" else -1
        if 0xD800 <= code < 0xDC00:
            self.high = start  # json.loads pairs it with a low surrogate written next: wait for that
        else:
            self.high = -1

    def _string_text(self, upto: int) -> None:
        """Release the canonical text of the string's first `upto` raw characters (whole escapes only)."""
        try:
            text = json.dumps(json.loads('"' + self.raw[:upto] + '"'), ensure_ascii=False)[1:-1]
        except ValueError:
            self._fail()
            return
        self._out.append(text[self.sent :])
        self.sent = len(text)


class CallObject:
    """A call's JSON object (`{"name": ..., "arguments": {...}}`) read as it streams: `feed(text)` returns how
    many characters belong to it; `name` once its string value is read, `arguments` (canonical argument text
    not taken yet) and `started` once the arguments object has begun; `ended` after its `}`; `failed` when it
    is not JSON or not a call (a name that is not a string, arguments that are not an object)."""

    def __init__(self, arguments_keys: tuple[str, ...]):
        self.keys = arguments_keys
        self.state = "open"  # open | key | colon | value | after | end
        self.value: JsonValue | None = None  # the key or value being read
        self.key = ""
        self.role = ""  # what the value being read is: name, arguments, other
        self.name: str | None = None
        self.arguments = ""
        self.started = self.ended = self.failed = False
        self._name_text = ""

    def feed(self, text: str) -> int:
        i = 0
        while i < len(text) and not (self.ended or self.failed):
            if self.value is not None:
                i += self.value.feed(text[i:])
                self._value_text(self.value.take())
                if self.value.failed:
                    self.failed = True
                elif self.value.done:
                    self._value_done()
                continue
            ch = text[i]
            i += 1
            if ch in _WS:
                continue
            if (self.state == "open" and ch == "{") or (self.state == "after" and ch == ","):
                self.state = "key"
            elif (self.state == "key" and ch == '"') or self.state == "value":
                self.value = JsonValue()
                i -= 1  # the value reads its own first character
            elif self.state == "colon" and ch == ":":
                self.state = "value"
                self.role = "name" if self.key == "name" else "other"
                if self.key in self.keys and not self.started:
                    self.role = "arguments"
            elif self.state == "after" and ch == "}":
                self.ended = True
            else:
                self.failed = True
        return i

    def _value_text(self, text: str) -> None:
        if self.state == "key":
            self._name_text += text  # the key's canonical text (a JSON string)
        elif self.role == "name":
            self._name_text += text
        elif self.role == "arguments":
            if not self.started and text and text[0] != "{":
                self.failed = True  # arguments that are not an object: not a call (as `tools._to_call`)
                return
            self.started = self.started or bool(text)
            self.arguments += text

    def _value_done(self) -> None:
        text, self._name_text, self.value = self._name_text, "", None
        if self.state == "key":
            self.key, self.state = json.loads(text), "colon"
            return
        if self.role == "name":
            if not text.startswith('"'):
                self.failed = True  # a name that is not a string: not a call
                return
            self.name = json.loads(text)
        self.state = "after"


class ToolCallReader:
    """Reads a Hermes (`<tool_call>{...}</tool_call>` anywhere in the reply) or Llama 3 (the reply is JSON call
    objects, `;` or whitespace between, after an optional `<|python_tag|>`) reply as it streams: `feed(text)`
    and `close()` return content (`str`) and `CallDelta` pieces. Text that may begin a call is held until it
    is known."""

    def __init__(self, fmt):
        self.fmt = fmt
        self.keys = tuple(dict.fromkeys((fmt.arguments_key, "arguments", "parameters")))
        self.buffer = ""  # text not read yet
        self.calls = 0  # calls sent so far (the index of the next one)
        self.call: CallObject | None = None  # the call being read
        self.raw = ""  # its text so far (released as text if it is no call)
        self.sent = False  # whether it is being sent
        self.state = "text" if fmt.open is not None else "start"  # Llama 3: start | between | text
        self.held = ""  # Llama 3: text since the last sent call (released as content if the reply is not calls)

    def feed(self, text: str, special: bool | None = None) -> list:
        """The pieces `text` completes (`special` is HarmonyReader's; these formats are read from the text)."""
        self.buffer += text
        return self._release(final=False)

    def close(self) -> list:
        return self._release(final=True)

    def _release(self, final: bool) -> list:
        out: list = []
        if self.fmt.open is not None:
            self._tagged(final, out)
        else:
            self._bare(final, out)
        return [p for p in out if not isinstance(p, str) or p]

    # -- Hermes: calls between tags -------------------------------------------------------------------------
    def _tagged(self, final: bool, out: list) -> None:
        fmt = self.fmt
        while True:
            if self.call is None:
                start = self.buffer.find(fmt.open)
                if start < 0:
                    keep = 0 if final else partial_suffix(self.buffer, fmt.open)
                    out.append(self.buffer[: len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep :]
                    return
                out.append(self.buffer[:start])
                self.buffer = self.buffer[start + len(fmt.open) :]
                self._begin()
                continue
            end = self.buffer.find(fmt.close)
            if end < 0:  # the call goes on: read what cannot be the closing tag's beginning
                keep = 0 if final else partial_suffix(self.buffer, fmt.close)
                self._read(self.buffer[: len(self.buffer) - keep], out)
                self.buffer = self.buffer[len(self.buffer) - keep :]
                if final:
                    self._end(out, fmt.open)
                return
            self._read(self.buffer[:end], out)
            self.buffer = self.buffer[end + len(fmt.close) :]
            self._end(out, fmt.open, fmt.close)

    def _begin(self) -> None:
        self.call, self.raw, self.sent = CallObject(self.keys), "", False

    def _read(self, text: str, out: list, whole: bool = True) -> int:
        """Feed `text` to the call being read and send what it makes known; the characters it took (`whole`:
        all of `text` is the call's text, read or not, as between Hermes tags)."""
        call = self.call
        n = call.feed(text) if not call.failed else 0
        self.raw += text if whole else text[:n]
        if not self.sent and call.name is not None and call.started and not call.failed:
            self.sent = True
            out.append(CallDelta(self.calls, f"call_{uuid.uuid4().hex[:24]}", call.name, ""))
            self.calls += 1
        if self.sent and call.arguments:
            out.append(CallDelta(self.calls - 1, None, None, call.arguments))
            call.arguments = ""
        return n

    def _end(self, out: list, *tags: str) -> None:
        """The call's text is over: a call not sent yet is a call if its whole text is one (the arguments
        before the name, say), else it is released as the text it was, its tags included."""
        if not self.sent:
            call = _to_call(_json(self.raw), self.keys)
            if call is None:
                out.append(tags[0] + self.raw + "".join(tags[1:]))
            else:
                out.append(CallDelta(self.calls, f"call_{uuid.uuid4().hex[:24]}", call[0], call[1]))
                self.calls += 1
        self.call = None

    # -- Llama 3: the reply is call objects -------------------------------------------------------------------
    def _bare(self, final: bool, out: list) -> None:
        prefix = self.fmt.prefix
        while self.buffer or (final and self.call is not None):
            if self.state == "text":  # plain content, from here on
                out.append(self.held + self.buffer)
                self.held = self.buffer = ""
            elif self.call is not None:
                n = self._read(self.buffer, out, whole=False)
                self.buffer = self.buffer[n:]
                if self.call.ended or self.call.failed or final:
                    self._end_object(final, out)
            elif self.state == "start":
                head = self.buffer.lstrip()
                if prefix and head.startswith(prefix):
                    self.held += self.buffer[: len(self.buffer) - len(head) + len(prefix)]
                    self.buffer = head[len(prefix) :]
                    self.state = "between"
                elif head.startswith("{"):
                    self.state = "between"
                elif not final and (not head or (prefix and prefix.startswith(head))):
                    return  # too short to tell yet
                else:
                    self.state = "text"
            else:  # between calls: whitespace and `;` are held, `{` begins a call, anything else is text
                ch = self.buffer[0]
                if ch == "{":
                    self._begin()
                elif ch in _WS or ch == ";":
                    self.held += ch
                    self.buffer = self.buffer[1:]
                else:
                    self.state = "text"
        if final and self.call is None and self.calls == 0 and self.held:
            out.append(self.held)  # (a lone `<|python_tag|>`, whitespace): the text it was
            self.held = ""

    def _end_object(self, final: bool, out: list) -> None:
        """A call object ended (or broke off, or the reply did): after a sent one, what is held is separators;
        an object that is no call makes the rest of the reply text (all of it when no call was sent)."""
        call, raw = self.call, self.raw
        if self.sent:
            self.call, self.held = None, ""
            return
        if call.ended or (final and not call.failed):
            whole = _to_call(_json(raw), self.keys)
            if whole is not None:  # a call after all (its arguments came before its name)
                out.append(CallDelta(self.calls, f"call_{uuid.uuid4().hex[:24]}", *whole))
                self.calls += 1
                self.call, self.held = None, ""
                return
        # not a call: its text and everything after it (the buffer: what it did not read) are content
        self.call, self.state, self.held = None, "text", self.held + raw


def _json(text: str) -> Any:
    try:
        return json.loads(text.strip())
    except ValueError:
        return None


def _to_call(obj: Any, keys: tuple[str, ...]) -> tuple[str, str] | None:
    """(name, arguments as `json.dumps` writes them) of a whole call object, or None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in keys if k in obj), None)
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)
