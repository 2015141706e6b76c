"""Harmony's tags are special tokens: a reply whose text spells one out ("<|end|>" as characters) keeps it.

The reader takes the reply as (text, is a special token's) pieces (`HarmonyReader.feed(text, special)`), which the
scheduler reports per token (`Job.specials`). The tiny harmony fixture of tests/test_server_harmony.py, scripted.
"""

from __future__ import annotations

import json

from ggufpy.server import tools as toolcalls
from ggufpy.server.harmony import CallDelta, HarmonyReader, merge
from tests.test_server_harmony import chat, gpt_oss, server, streamed  # noqa: F401  (fixtures)

SPELLED = 'He wrote "<|end|>" and <|call|> then <|start|>.'  # the characters, not the tokens


def _read(pieces, calls=True):
    reader = HarmonyReader(calls)
    return merge([p for text, special in pieces for p in reader.feed(text, special)] + reader.close())


def test_pieces_tell_tags_from_text():
    pieces = [
        ("<|channel|>", True),
        ("analysis", False),
        ("<|message|>", True),
        ("Think <|end|> twice.", False),
        ("<|end|>", True),
        ("<|start|>", True),
        ("assistant", False),
        ("<|channel|>", True),
        ("final", False),
        ("<|message|>", True),
        (SPELLED, False),
    ]
    assert _read(pieces) == (SPELLED, "Think <|end|> twice.", [])
    # the same reply as text: every spelled-out tag is a tag (what the server did before)
    assert _read([("".join(t for t, _ in pieces), None)]) != (SPELLED, "Think <|end|> twice.", [])


def test_pieces_in_a_call_and_character_by_character():
    head = [("<|channel|>", True), ("commentary to=functions.f ", False), ("<|constrain|>", True)]
    head += [("json", False), ("<|message|>", True)]
    args = '{"tag":"<|call|>"}'
    body = [(c, False) for c in args]  # streamed a character at a time: no piece is held back as a maybe-tag
    reader = HarmonyReader()
    out = [p for text, special in head for p in reader.feed(text, special)]
    assert len(out) == 1 and out[0].name == "f"
    for c, _ in body:
        assert reader.feed(c, False) == [CallDelta(0, None, None, c)]
    assert reader.feed("<|call|>", True) == [] and reader.close() == []
    # a special token that is no harmony tag is text; a surrogate in text (never decoded) is not a tag
    assert _read([("<|channel|>", True), ("final", False), ("<|message|>", True), ("<|x|>", True), ("\ud803", False)])[
        0
    ] == ("<|x|>\ufffd")


def test_reply_from_pieces():
    fmt = toolcalls.FORMATS["harmony"]
    pieces = [("<|channel|>", True), ("final", False), ("<|message|>", True), (SPELLED, False)]
    message, finish = toolcalls.reply(fmt, pieces, "stop")
    assert (message["content"], finish) == (SPELLED, "stop")
    assert toolcalls.reply(fmt, "".join(t for t, _ in pieces), "stop")[0]["content"] != SPELLED


def _script(model, *parts):
    """The model's next reply: `parts` alternate tags (special tokens) and plain text (spelled tags stay text)."""
    tok = model.tokenizer
    ids = []
    for i, part in enumerate(parts):
        special = i % 2 == 0
        ids += tok.encode(part, add_special=False, parse_special=special, content=not special)
    model.script = ids


def test_spelled_tags_reach_the_client(server, gpt_oss):  # noqa: F811
    """A final message whose text spells out <|end|>, <|call|> and <|start|>: content has them, whole and
    streamed (the reader used to take them for tags: content ended at the first)."""
    _script(
        gpt_oss, "<|channel|>analysis<|message|>", "a <|end|> b", "<|end|><|start|>assistant<|channel|>final<|message|>"
    )
    gpt_oss.script += gpt_oss.tokenizer.encode(SPELLED, add_special=False, content=True)
    gpt_oss.script += gpt_oss.tokenizer.encode("<|return|>", add_special=False, parse_special=True)
    message = chat(server).choices[0].message
    assert (message.content, message.reasoning_content) == (SPELLED, "a <|end|> b")
    content, reasoning, calls, finish, _ = streamed(chat(server, stream=True))
    assert (content, reasoning, calls, finish) == (SPELLED, "a <|end|> b", [], "stop")


def test_spelled_tag_in_call_arguments(server, gpt_oss):  # noqa: F811
    tools = [{"type": "function", "function": {"name": "note", "parameters": {"type": "object"}}}]
    args = json.dumps({"text": "<|end|> and <|call|>"}, separators=(",", ":"))
    _script(gpt_oss, "<|channel|>", "commentary to=functions.note ", "<|constrain|>", "json", "<|message|>", args)
    gpt_oss.script += gpt_oss.tokenizer.encode("<|call|>", add_special=False, parse_special=True)
    choice = chat(server, tools=tools).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"text": "<|end|> and <|call|>"}
    content, _, calls, finish, _ = streamed(chat(server, tools=tools, stream=True))
    assert (content, calls, finish) == ("", [("note", args)], "tool_calls")
