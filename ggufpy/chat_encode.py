"""Tokenizing a rendered conversation so that control tokens come only from the template, never from messages.

`encode_chat` is what `ggufpy run --chat`, `ggufpy chat` and the server use (docs/chat.md, "Prompt injection").
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
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
    reasoning) without, so a user who types ``<|im_end|>`` gets the characters, never the control token that
    would close their turn and forge another (prompt injection). ``special_in_content=True`` parses specials
    everywhere, as HF's ``apply_chat_template`` + tokenizer and llama.cpp's server do.

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
        ids.extend([f] if isinstance(f, int) else tokenizer.encode(f, add_special=False, parse_special=False))
    if add_bos and tokenizer.add_eos and tokenizer.eos_id is not None:
        ids.append(tokenizer.eos_id)
    return ids


def _special_ids(tokenizer, text: str) -> set[int]:
    """Control tokens ``text`` would produce if specials were parsed in it."""
    always = {f for f in tokenizer.partition(text, parse_special=False) if isinstance(f, int)}
    return {f for f in tokenizer.partition(text, parse_special=True) if isinstance(f, int)} - always


def _message_texts(messages: Sequence[Message]) -> list[str]:
    texts = []
    for m in messages:
        for key in ("content", *REASONING_FIELDS):
            value = m.get(key) if isinstance(m, Mapping) else None
            if isinstance(value, str):
                texts.append(value)
            elif key == "content" and isinstance(value, list):
                texts += [p["text"] for p in value if isinstance(p, Mapping) and isinstance(p.get("text"), str)]
    return texts


def _mark(value: str, open_: str, close: str) -> str:
    """``value`` with markers around its text; surrounding whitespace stays outside, so ``|trim`` still works."""
    core = value.strip()
    if not core:
        return value
    lead = value[: len(value) - len(value.lstrip())]
    return f"{lead}{open_}{core}{close}{value[len(lead) + len(core) :]}"


def _marked_messages(messages: Sequence[Message], open_: str, close: str) -> list[Any]:
    out = []
    for m in messages:
        if not isinstance(m, Mapping):
            out.append(m)
            continue
        m = dict(m)
        for key in ("content", *REASONING_FIELDS):
            value = m.get(key)
            if isinstance(value, str):
                m[key] = _mark(value, open_, close)
            elif key == "content" and isinstance(value, list):
                m[key] = [
                    {**p, "text": _mark(p["text"], open_, close)}
                    if isinstance(p, Mapping) and isinstance(p.get("text"), str)
                    else p
                    for p in value
                ]
        out.append(m)
    return out


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
