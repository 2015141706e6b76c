"""Tokenizing a rendered conversation so that control tokens come only from the template, never from messages.

`encode_chat` is what `ggufpy run --chat`, `ggufpy chat` and the server use (docs/chat.md, "Prompt injection").
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .chat_bounds import ChatTemplateError

if TYPE_CHECKING:
    from .chat import ChatTemplate

Message = Mapping[str, Any]
# Names a message's reasoning may come under; templates read "reasoning_content" (gpt-oss reads "thinking").
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def encode_chat(
    tokenizer,
    messages: Sequence[Message],
    template: ChatTemplate | None = None,
    *,
    add_generation_prompt: bool = True,
    special_in_content: bool = False,
    **kwargs: Any,
) -> list[int]:
    """Token ids of the conversation rendered with ``template`` (default: the tokenizer's), BOS added unless the
    template writes it.

    The template's own text is tokenized with special tokens parsed; message text (``content``, text parts,
    reasoning, tool calls' names and arguments, tool results) without, and without the user-defined tokens
    spelled like tags (`Tokenizer.control_like`: gpt-oss's ``<|end|>``, which llama.cpp matches anyway), so a
    user who types ``<|im_end|>`` gets the characters, never the control token that would close their turn and
    forge another (prompt injection). ``special_in_content=True`` parses specials everywhere, as HF's
    ``apply_chat_template`` + tokenizer and llama.cpp's server do.

    The content is found by rendering a second time with a random marker around each message text and checking
    that removing the markers gives the same prompt. When it does not (a template that slices or tests the
    content) the whole prompt is tokenized with specials parsed if no message contains special-token text,
    and `ChatTemplateError` is raised if one does.
    """
    if template is None:
        from .chat import ChatTemplate

        template = ChatTemplate.from_tokenizer(tokenizer)
    text = template.render(messages, add_generation_prompt=add_generation_prompt, **kwargs)
    # The template writes BOS itself when the model wants one (llama.cpp's chat path does the same check).
    add_bos = not (tokenizer.bos_id is not None and text.startswith(tokenizer.piece(tokenizer.bos_id)))
    if special_in_content:
        return tokenizer.encode(text, add_special=add_bos, parse_special=True)
    spans = _content_spans(template, messages, text, add_generation_prompt, kwargs)
    if spans is None:
        smuggled = next((t for t in _message_texts(messages) if _special_ids(tokenizer, t)), None)
        if smuggled is not None:
            raise ChatTemplateError(
                f"a message contains special-token text ({smuggled[:60]!r}) and the chat template {template.name!r} "
                "changes message text, so it cannot be kept apart from the template's control tokens: "
                "remove it, or allow it explicitly (special_in_content=True, --special-in-content)"
            )
        return tokenizer.encode(text, add_special=add_bos, parse_special=True)
    fragments: list[str | int] = []
    for start, end, is_content in spans:
        parts = [text[start:end]] if is_content else tokenizer.partition(text[start:end], parse_special=True)
        for part in parts:
            if isinstance(part, str) and fragments and isinstance(fragments[-1], str):
                fragments[-1] += part  # text meets text: one fragment, tokenized as a whole prompt would be
            elif part != "":
                fragments.append(part)
    ids = [tokenizer.bos_id] if add_bos and tokenizer.add_bos and tokenizer.bos_id is not None else []
    for f in fragments:
        ids.extend([f] if isinstance(f, int) else tokenizer.encode(f, add_special=False, content=True))
    if add_bos and tokenizer.add_eos and tokenizer.eos_id is not None:
        ids.append(tokenizer.eos_id)
    return ids


def _special_ids(tokenizer, text: str) -> set[int]:
    """Control tokens (and tag-like user-defined ones) ``text`` would produce if specials were parsed in it."""
    plain = {f for f in tokenizer.partition(text, content=True) if isinstance(f, int)}
    return {f for f in tokenizer.partition(text, parse_special=True) if isinstance(f, int)} - plain


def _map_texts(value: Any, fn: Callable[[str], str]) -> Any:
    """``value`` (a tool call's arguments: text, or JSON as objects) with ``fn`` applied to every string in it."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, Mapping):
        return {_map_texts(k, fn): _map_texts(v, fn) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_map_texts(v, fn) for v in value]
    return value


def _call_texts(call: Any, fn: Callable[[str], str]) -> Any:
    """A tool call with ``fn`` applied to its name and arguments (OpenAI's under ``function``, or flat)."""
    if not isinstance(call, Mapping):
        return call
    call = {k: _map_texts(v, fn) if k in ("name", "arguments") else v for k, v in call.items()}
    if isinstance(call.get("function"), Mapping):
        call["function"] = _call_texts(call["function"], fn)
    return call


def _message_with(m: Any, fn: Callable[[str], str]) -> Any:
    """Message ``m`` with ``fn`` applied to every text a client wrote in it: content and its text parts,
    reasoning, tool calls' names and arguments, a tool result's name (its content is content)."""
    if not isinstance(m, Mapping):
        return m
    m = dict(m)
    for key in ("content", *REASONING_FIELDS):
        value = m.get(key)
        if isinstance(value, str):
            m[key] = fn(value)
        elif key == "content" and isinstance(value, list):
            m[key] = [
                {**p, "text": fn(p["text"])} if isinstance(p, Mapping) and isinstance(p.get("text"), str) else p
                for p in value
            ]
    if isinstance(m.get("tool_calls"), list):
        m["tool_calls"] = [_call_texts(c, fn) for c in m["tool_calls"]]
    if m.get("role") == "tool" and isinstance(m.get("name"), str):
        m["name"] = fn(m["name"])
    return m


def _message_texts(messages: Sequence[Message]) -> list[str]:
    texts: list[str] = []
    for m in messages:
        _message_with(m, lambda t: texts.append(t) or t)
    return texts


def _mark(value: str, open_: str, close: str) -> str:
    """``value`` with markers around its text; surrounding whitespace stays outside, so ``|trim`` still works."""
    core = value.strip()
    if not core:
        return value
    lead = value[: len(value) - len(value.lstrip())]
    return f"{lead}{open_}{core}{close}{value[len(lead) + len(core) :]}"


def _marked_messages(messages: Sequence[Message], open_: str, close: str) -> list[Any]:
    return [_message_with(m, lambda t: _mark(t, open_, close)) for m in messages]


def _content_spans(template: ChatTemplate, messages, text: str, add_generation_prompt: bool, kwargs):
    """``[(start, end, is_content), ...]`` covering ``text``, or None when the markers do not survive."""
    nonce = secrets.token_hex(8)
    open_, close = f"\ue000{nonce}\ue001", f"\ue002{nonce}\ue003"  # private-use code points: in no real text
    marked = template.render(
        _marked_messages(messages, open_, close), add_generation_prompt=add_generation_prompt, **kwargs
    )
    spans, pos, out_len, inside = [], 0, 0, False
    while True:
        nxt = marked.find(close if inside else open_, pos)
        other = marked.find(open_ if inside else close, pos)
        if other >= 0 and (nxt < 0 or other < nxt):
            return None  # markers out of order: the template cut or reordered message text
        end = len(marked) if nxt < 0 else nxt
        if nxt < 0 and inside:
            return None
        spans.append((out_len, out_len + end - pos, inside))
        out_len += end - pos
        if nxt < 0:
            break
        pos, inside = nxt + len(open_), not inside
    if marked.replace(open_, "").replace(close, "") != text:
        return None
    return [s for s in spans if s[0] < s[1]]
