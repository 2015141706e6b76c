"""`ggufpy run --chat` and `ggufpy chat` on gpt-oss: the reply by channel (answer on stdout, reasoning marked on
stderr, calls as calls), not raw harmony; and the next turn takes the answer back (gpt-oss's template refuses
harmony tags in content). The tiny harmony fixture of tests/test_server_harmony.py, its replies scripted."""

from __future__ import annotations

import io
import sys

import pytest

from ggufpy.cli import chat as cli_chat
from ggufpy.cli import main
from ggufpy.cli import run as cli_run
from ggufpy.cli.channels import HarmonyView
from ggufpy.server.harmony import Reasoning
from tests.test_server_harmony import ANSWER, ARGS, CALL, Scripted, gpt_oss, script  # noqa: F401  (gpt_oss: fixture)


class ScriptedDecode(Scripted):
    """`Scripted` for `generate`, which decodes through `forward` one token at a time: a reply starts after a
    prompt (more than one token fed)."""

    def forward(self, x, pos, cache, **kw):
        if len(x) > 1:
            self.steps[id(cache)] = 0
        logits = self.model.forward(x, pos, cache, **kw)
        logits[-1] = self._push(logits[-1], cache)
        return logits


@pytest.fixture()
def model(gpt_oss, monkeypatch):  # noqa: F811
    scripted = ScriptedDecode(gpt_oss.model)
    for module in (cli_run, cli_chat):
        monkeypatch.setattr(module, "load_model", lambda args: (scripted, 0.0))
    monkeypatch.setattr(cli_run, "prepare_kernels", lambda m, n=None: 0.0)
    monkeypatch.setattr(cli_chat, "prepare_kernels", lambda m: 0.0)
    return scripted


def test_run_chat_prints_the_answer_and_marks_the_reasoning(model, capsys):
    """Before: stdout was `<|channel|>analysis<|message|>Sky check.<|end|><|start|>assistant<|channel|>final...`."""
    script(model, ANSWER)
    assert main(["run", "--chat", "-p", "Weather?", "-n", "200"]) == 0
    out, err = capsys.readouterr()
    assert out == "Sunny, 21 C.\n"
    assert "[reasoning] Sky check.\n" in err and "<|" not in err


def test_run_chat_shows_a_tool_call(model, capsys):
    script(model, CALL)
    assert main(["run", "--chat", "-p", "Weather?", "-n", "200"]) == 0
    out, err = capsys.readouterr()
    assert out == f"[tool call] get_weather {ARGS}\n" and "[reasoning] Use the tool.\n" in err


def test_chat_turns_keep_the_answer(model, capsys, monkeypatch):
    """The second turn renders (before: the raw reply in `content` made the template raise) with the first
    answer as the assistant's content."""
    prompts = []
    real = cli_run.chat_prompt_ids
    monkeypatch.setattr(cli_chat, "chat_prompt_ids", lambda tok, m, *a: prompts.append(m) or real(tok, m, *a))
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"Weather?\nAnd tomorrow?\n")))
    script(model, ANSWER)
    assert main(["chat", "-n", "200"]) == 0
    out, err = capsys.readouterr()
    assert out == "Sunny, 21 C.\nSunny, 21 C.\n"
    assert "error" not in err and err.count("[reasoning] Sky check.") == 2
    assert prompts[1][1] == {"role": "assistant", "content": "Sunny, 21 C."}


def test_view_dims_reasoning_on_a_terminal():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    out, notes = io.StringIO(), Tty()
    view = HarmonyView(out, notes)
    for part in ("<|channel|>analysis<|mess", "age|>Hm.<|end|><|start|>assistant<|channel|>final<|message|>Ok", "."):
        view.write(part)
    assert view.close() == ("Ok.", "Hm.", [])
    assert (out.getvalue(), notes.getvalue()) == ("Ok.", "\x1b[2mHm.\x1b[0m\n")
    assert view.pieces == [Reasoning("Hm."), "Ok", "."]
