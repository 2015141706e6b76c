"""`ggufpy chat`: the KV cache kept across turns, cut replies not kept, input that is not UTF-8."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

from ggufpy.cli import chat as cli_chat
from ggufpy.cli import main


@pytest.fixture()
def chat(monkeypatch, capsys):
    """Run `ggufpy chat ARGS` in-process on a loaded model with `lines` as stdin; return (stdout, stderr, fed)
    where `fed` lists (pos, n_tokens) of every prefill call (one per turn)."""

    def run(model, lines: list[str], *args: str):
        monkeypatch.setattr(cli_chat, "load_model", lambda a: (model, 0.0))
        monkeypatch.setattr(cli_chat, "prepare_kernels", lambda model: 0.0)  # its scratch forwards are not turns
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("".join(f"{x}\n" for x in lines).encode())))
        fed = []
        forward = model.forward

        def spy(x, pos, cache, *a, **k):
            if len(x) > 1 or pos == 0:
                fed.append((pos, len(x)))
            return forward(x, pos, cache, *a, **k)

        monkeypatch.setattr(model, "forward", spy)
        assert main(["chat", *args]) == 0
        out, err = capsys.readouterr()
        monkeypatch.setattr(model, "forward", forward)
        return out, err, fed

    return run


def test_turns_feed_only_their_new_tokens_and_answer_as_a_recomputed_chat(smollm2, chat):
    """Before: every turn recomputed the whole conversation (prompt 37 -> 59 -> ... tokens)."""
    lines = ["What is the capital of France?", "And of Italy?"]
    out, err, fed = chat(smollm2, lines, "-n", "16")
    again, _, refed = chat(smollm2, lines, "-n", "16", "--no-cache-reuse")
    assert "Paris" in out and "Rome" in out and out == again
    (p1, n1), (p2, n2) = fed
    assert p1 == 0 and p2 > n1  # the second turn starts after the first turn's prompt and reply
    assert refed[1][0] == 0 and refed[1][1] == p2 + n2  # recomputing feeds the whole conversation
    assert f"({p2} cached)" in err


def test_a_cut_reply_is_not_kept_and_the_user_is_told(tiny_llama, chat, monkeypatch):
    from ggufpy.cli import run as cli_run

    prompts = []
    real = cli_run.chat_prompt_ids
    monkeypatch.setattr(cli_chat, "chat_prompt_ids", lambda tok, m, *a: prompts.append(m) or real(tok, m, *a))
    _, err, _ = chat(tiny_llama, ["the cat", "the dog"], "-n", "2")
    assert err.count("it and its question are not kept in the conversation") == 2
    assert [m["content"] for m in prompts[1]] == ["the dog"]  # the first, cut, turn is gone


def test_reset_and_template_errors_keep_the_chat_going(tiny_llama, chat, monkeypatch):
    monkeypatch.setattr(tiny_llama.tokenizer, "chat_template", "{{ raise_exception('bad turn') }}")
    _, err, fed = chat(tiny_llama, ["hi", "/reset", "again"], "-n", "1")
    assert err.count("ggufpy: error: chat template: bad turn (the message was not added") == 2
    assert fed == []


def test_invalid_utf8_on_stdin_is_replaced(tiny_llama_path):
    """Before: a UnicodeDecodeError (or the tokenizer's TypeError) traceback."""
    proc = subprocess.run(
        [sys.executable, "-m", "ggufpy", "chat", "-m", str(tiny_llama_path), "-n", "2"],
        input=b"ab\xff\n",
        capture_output=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    assert b"the input line is not valid UTF-8; the invalid bytes were replaced with U+FFFD" in proc.stderr
