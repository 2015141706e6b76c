"""Structured output whose grammar spells a special token's text (issue 14: "a client error is never a 500").

On gpt-oss, `<|end|>`, `<|start|>`... are user-defined tokens, which the tokenizer matches in any text: the
grammar text "<|end|>" was tokenized to that token, llguidance forced it, then refused it as special (HTTP 500
"token N does not fit the grammar"). The tiny harmony fixture of tests/test_server_harmony.py is the model.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from ggufpy.server.constrain import Constraint, compile_grammar, token_table
from tests.test_server_harmony import chat, gpt_oss, script, server  # noqa: F401  (fixtures)

pytest.importorskip("llguidance")

TAG_TEXT = "<|start|>x<|message|>y<|end|><|channel|>z<|constrain|>"
TAG_SCHEMA = {
    "type": "object",
    "properties": {"tag": {"enum": ["<|end|>", "<|start|>assistant<|channel|>final"]}},
    "required": ["tag"],
    "additionalProperties": False,
}


def forced(tokenizer, kind, source) -> list[int]:
    """The tokens a grammar gives when each step takes the lowest allowed id (flat logits)."""
    table = token_table(tokenizer)
    constraint = Constraint(table, compile_grammar(kind, source, table))
    ids = []
    while not constraint.finished and len(ids) < 200:
        allowed = np.isfinite(constraint.apply(np.zeros(tokenizer.vocab_size, np.float32)))
        token = int(np.flatnonzero(allowed)[0])
        if tokenizer.is_eog(token):
            break
        constraint.advance(token)  # raised ValueError (the 500) before the fix
        ids.append(token)
    return ids


@pytest.mark.parametrize(
    "kind, source, text",
    [
        ("gbnf", f'root ::= "{TAG_TEXT}"', TAG_TEXT),
        ("json_schema", {"const": "<|end|>"}, '"<|end|>"'),
    ],
)
def test_grammar_text_spells_tags_as_text(gpt_oss, kind, source, text):  # noqa: F811
    tok = gpt_oss.tokenizer
    ids = forced(tok, kind, source)
    assert tok.decode(ids) == text
    assert not set(ids) & tok.control_like  # the characters, never the tag tokens


def test_special_ids_are_the_marked_ones(gpt_oss):  # noqa: F811
    """llguidance's special tokens are exactly those whose bytes carry the 0xFF mark: control tokens and the
    tag-like user-defined ones; the tokenize callback never returns one."""
    tok = gpt_oss.tokenizer
    table = token_table(tok)
    end = tok.encode("<|end|>", add_special=False)[0]
    assert end in tok.control_like and table.is_special_token(end)
    assert table.is_special_token(tok.encode("<|im_end|>", add_special=False, parse_special=True)[0])
    assert not table.is_special_token(tok.encode("a", add_special=False)[0])
    assert not set(table.tokenize_str(TAG_TEXT)) & tok.control_like


def test_server_json_schema_with_tag_text(server, gpt_oss):  # noqa: F811
    """response_format naming "<|end|>" as a value: a 200 whose JSON validates, not a 500."""
    script(gpt_oss, "")
    response_format = {"type": "json_schema", "json_schema": {"name": "tag", "schema": TAG_SCHEMA}}
    choice = chat(server, response_format=response_format).choices[0]
    assert json.loads(choice.message.content)["tag"] in TAG_SCHEMA["properties"]["tag"]["enum"]


def test_server_gbnf_with_tag_text(server, gpt_oss):  # noqa: F811
    """A GBNF grammar whose literal is harmony's tags: the reply is that text, read as content."""
    script(gpt_oss, "")
    choice = chat(server, extra_body={"grammar": 'root ::= "Answer: <|end|> done"'}).choices[0]
    assert choice.message.content == "Answer: <|end|> done"
