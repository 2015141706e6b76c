"""`ggufpy serve` from the command line: its flags and defaults, and a real process on loopback serving the
tiny synthetic model (stopped in `finally`)."""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time

import pytest

from ggufpy.cli import COMMANDS, serve

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")


def parse(argv):
    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def test_defaults_bind_loopback():
    args = parse([])
    assert (args.model, args.host, args.port, args.parallel, args.ctx_size, args.api_key) == (
        None,
        "127.0.0.1",
        8080,
        4,
        2048,
        None,
    )
    args = parse(["-m", "x.gguf", "--port", "9", "--parallel", "8", "--ctx-size", "512", "--api-key", "k"])
    assert (args.model, args.port, args.parallel, args.ctx_size, args.api_key) == ("x.gguf", 9, 8, 512, "k")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif("serve" not in COMMANDS, reason="`serve` is not in ggufpy.cli.COMMANDS yet")
def test_serve_process(tiny_llama_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "ggufpy", "serve", "-m", str(tiny_llama_path), "--port", str(port)]
    proc = subprocess.Popen([*argv, "--parallel", "2", "--ctx-size", "32"], stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "no /health answer within 120 s"
            time.sleep(0.2)
        assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == tiny_llama_path.stem
        body = {"prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0}
        r = httpx.post(url + "/v1/completions", json=body, timeout=300)  # a cold numba cache compiles first
        assert r.status_code == 200 and 1 <= r.json()["usage"]["completion_tokens"] <= 3
        long = httpx.post(url + "/v1/completions", json={"prompt": [1] * 40}, timeout=60)
        assert long.status_code == 400 and "40 tokens" in long.json()["error"]["message"]
    finally:
        proc.terminate()
        proc.wait(20)


def test_chat_template_flag(tiny_llama, tmp_path):
    """--chat-template: a built-in's name, a Jinja file, or an error naming what is wrong."""
    assert parse(["--chat-template", "chatml"]).chat_template == "chatml"
    assert serve._template(None, tiny_llama.tokenizer) is None
    assert serve._template("chatml", tiny_llama.tokenizer).name == "chatml"
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert serve._template(str(path), tiny_llama.tokenizer).render([{"role": "user", "content": "hi"}]) == "hi"
    with pytest.raises(ValueError, match="unknown chat template 'nope'"):
        serve._template("nope", tiny_llama.tokenizer)
