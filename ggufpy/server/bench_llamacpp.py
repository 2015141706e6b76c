"""llama.cpp's own continuous batching as a `bench --server` engine: B sequences decoded together, one token each
per `llama_decode` call, as llama-server's slots are each step (without its HTTP), through llama-cpp-python's
low-level API (the `conformance` extra).

    python -m ggufpy.server.bench_llamacpp MODEL --threads 2 --streams 8 --gen-tokens 32 --eog 2   # one JSON row

llama-cpp-python's own server runs one request at a time, so it cannot show what batching gives on a machine;
llama-server can, but pip does not build it. This runs the same engine underneath: one context with a KV cache
shared by B sequences (`n_seq_max = B`), the B prompts prefilled in one batch, then one `llama_decode` of B tokens
per step, the next token of each sequence its greedy pick with the end-of-generation tokens banned (as the
server bench's requests are). Throughput = B * gen_tokens / the wall time from the prefill to the last step, the
figure `bench.measure` reports for a server (less the HTTP). The model is loaded and its pages touched by an
untimed first pass, as a server is warmed up.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time

import numpy as np

from .bench import PROMPT

CTX_PER_SEQUENCE = 256  # KV positions per sequence: the bench's prompts and completions are a few dozen tokens


def _tokens(llama, vocab, text: str) -> list[int]:
    """`text`'s token ids as llama.cpp tokenizes a completion prompt (with the vocabulary's BOS)."""
    raw = text.encode()
    buf = (ctypes.c_int * (len(raw) + 8))()
    n = llama.llama_tokenize(vocab, raw, len(raw), buf, len(buf), True, False)
    if n < 0:
        raise RuntimeError(f"llama_tokenize needs {-n} slots for {text!r}")
    return list(buf[:n])


class _Batch:
    """A `llama_batch` filled with (token, position, sequence, wants logits) rows."""

    def __init__(self, llama, capacity: int, sequences: int):
        self.llama = llama
        self.batch = llama.llama_batch_init(capacity, 0, sequences)

    def fill(self, rows) -> object:
        b = self.batch
        b.n_tokens = len(rows)
        for i, (token, pos, seq, logits) in enumerate(rows):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
            b.seq_id[i][0] = seq
        return b

    def free(self) -> None:
        self.llama.llama_batch_free(self.batch)


def measure(path, streams: int, gen_tokens: int, threads: int, eog: list[int]) -> dict:
    """B = `streams` sequences of `gen_tokens` greedy tokens each, decoded together: the `bench.measure` row,
    with each sequence's generated token ids (`ids`)."""
    import llama_cpp as llama

    llama.llama_backend_init()
    model = llama.llama_model_load_from_file(str(path).encode(), llama.llama_model_default_params())
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path}")
    vocab = llama.llama_model_get_vocab(model)
    n_vocab = llama.llama_vocab_n_tokens(vocab)
    prompts = [_tokens(llama, vocab, PROMPT.format(i)) for i in range(streams)]
    params = llama.llama_context_default_params()
    params.n_ctx = CTX_PER_SEQUENCE * streams
    params.n_batch = params.n_ubatch = max(512, sum(map(len, prompts)))
    params.n_seq_max = streams
    params.n_threads = params.n_threads_batch = threads
    params.kv_unified = True  # one cache for all sequences, as llama-server's default
    ctx = llama.llama_init_from_model(model, params)
    if not ctx:
        llama.llama_model_free(model)
        raise RuntimeError(f"llama.cpp could not create a context of {params.n_ctx} positions for {path}")
    batch = _Batch(llama, params.n_batch, streams)
    banned = np.asarray(eog, dtype=np.int64)

    def decode(rows) -> list[int]:
        """One llama_decode of `rows`; the greedy next token of each row that asked for logits."""
        if llama.llama_decode(ctx, batch.fill(rows)) != 0:
            raise RuntimeError("llama_decode failed")
        picks = []
        for i, row in enumerate(rows):
            if row[3]:
                logits = np.ctypeslib.as_array(llama.llama_get_logits_ith(ctx, i), shape=(n_vocab,))
                logits[banned] = -np.inf
                picks.append(int(np.argmax(logits)))
        return picks

    def generate() -> list[list[int]]:
        prefill = [(t, p, s, p == len(ids) - 1) for s, ids in enumerate(prompts) for p, t in enumerate(ids)]
        nexts = decode(prefill)  # each sequence's first completion token
        out = [[t] for t in nexts]
        positions = [len(ids) for ids in prompts]
        for _ in range(gen_tokens - 1):
            nexts = decode([(t, positions[s], s, True) for s, t in enumerate(nexts)])
            positions = [p + 1 for p in positions]
            for seq, t in zip(out, nexts, strict=True):
                seq.append(t)
        return out

    try:
        generate()  # warm-up: pages the weights in, sizes llama.cpp's buffers
        llama.llama_memory_clear(llama.llama_get_memory(ctx), True)
        t0 = time.perf_counter()
        ids = generate()
        seconds = time.perf_counter() - t0
    finally:
        batch.free()
        llama.llama_free(ctx)
        llama.llama_model_free(model)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    tokens = sum(map(len, ids))
    return {
        "streams": streams,
        "tokens": tokens,
        "seconds": seconds,
        "tok_s": tokens / seconds,
        "load": load,
        "ids": ids,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ggufpy.server.bench_llamacpp", description=__doc__.split("\n")[0])
    p.add_argument("model")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--gen-tokens", type=int, default=32)
    p.add_argument("--eog", type=int, nargs="*", default=[], help="token ids to ban (end of generation)")
    args = p.parse_args(argv)
    if args.streams < 1 or args.gen_tokens < 1:
        p.error(f"--streams and --gen-tokens must be >= 1, got {args.streams} and {args.gen_tokens}")
    print(json.dumps(measure(args.model, args.streams, args.gen_tokens, args.threads, args.eog)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
