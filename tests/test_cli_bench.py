"""`ggufpy bench` on a tiny model: it runs each engine in a fresh process and reports speeds and memory."""

from __future__ import annotations

import json

from ggufpy.cli import main


def test_bench_reports_speed_load_time_and_rss(tiny_llama_path, capsys):
    argv = ["bench", "-m", str(tiny_llama_path), "--backend", "numpy", "--prompt-tokens", "8", "--gen-tokens", "3"]
    assert main([*argv, "--threads", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["prompt_tokens"] == 8 and report["gen_tokens"] == 3
    numpy = report["engines"]["numpy"]
    assert numpy["prefill"] > 0 and numpy["decode"] > 0 and numpy["load_s"] > 0
    assert numpy["peak_rss"] > tiny_llama_path.stat().st_size  # the process holds at least the mapped file
    assert "prefill_ratio" not in numpy  # no llama.cpp asked for, so no ratio


def test_bench_table(tiny_llama_path, capsys):
    argv = ["bench", "-m", str(tiny_llama_path), "--backend", "numpy", "--prompt-tokens", "4", "--gen-tokens", "2"]
    assert main([*argv, "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "| numpy |" in out and "decode tok/s" in out
