"""`ggufpy run` and `ggufpy chat` on the real default model and on a tiny synthetic one."""

from __future__ import annotations

import subprocess
import sys

import numpy as np

import ggufpy
from ggufpy.cli import main
from ggufpy.cli.run import chat_prompt_ids
from ggufpy.generation import generate_text
from ggufpy.sampling import SamplingParams


def test_smollm2_greedy_chat_answer_names_paris(smollm2):
    ids = chat_prompt_ids(smollm2.tokenizer, [{"role": "user", "content": "What is the capital of France?"}])
    result = generate_text(smollm2, smollm2.tokenizer, ids, max_tokens=24, sampling=SamplingParams.greedy())
    assert "Paris" in result.text
    assert result.finish_reason in ("eog", "length")


def test_greedy_generation_follows_the_logits(smollm2):
    """Each generated token is the arg-max of the full-prefill logits of the sequence so far."""
    ids = smollm2.tokenizer.encode("The capital of Germany is")
    result = generate_text(smollm2, smollm2.tokenizer, ids, max_tokens=4, sampling=SamplingParams.greedy())
    seq = list(ids)
    for tok in result.token_ids:
        assert int(np.argmax(smollm2.logits(seq)[-1])) == tok
        seq.append(tok)


def test_run_command_streams_text_and_reports_speed(capsys):
    code = main(["run", "-p", "What is the capital of France?", "--chat", "--temp", "0", "--max-tokens", "16"])
    out, err = capsys.readouterr()
    assert code == 0
    assert "Paris" in out
    assert "tok/s" in err and "load" in err


def test_run_command_on_a_tiny_model_with_sampling_options(tiny_llama_path, capsys):
    argv = ["run", "-m", str(tiny_llama_path), "-p", "the", "--max-tokens", "5", "--temp", "0.7", "--top-k", "5"]
    assert main([*argv, "--seed", "3"]) == 0
    first = capsys.readouterr().out
    assert main([*argv, "--seed", "3"]) == 0
    assert capsys.readouterr().out == first  # the seed makes a run reproducible


def test_chat_command_holds_a_multi_turn_conversation():
    proc = subprocess.run(
        [sys.executable, "-m", "ggufpy", "chat", "--temp", "0", "--max-tokens", "24"],
        input="What is the capital of France?\nAnd of Italy?\n",
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "Rome" in proc.stdout
    assert proc.stderr.count("finish:") == 2  # one report per turn


def test_load_default_model_is_smollm2():
    model = ggufpy.load()
    assert model.config.arch.name == "llama" and model.config.n_layers == 30
    assert model.tokenizer is not None and model.tokenizer.vocab_size == 49152
