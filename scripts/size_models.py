"""Synthetic llama models at real sizes for the speed tables (issue 16): Llama-3.2-1B, Llama-3.2-3B and
Llama-3.1-8B dimensions with a 269-token vocabulary (so the head is negligible), random weights.

    python scripts/size_models.py [--sizes 1B 3B 8B] [--types Q8_0 Q4_0 Q4_K_M]

The Q8_0 file is written block by block from random bytes (an int8 quant uniform in [-127, 127] and one fp16
scale per 32 weights, so each row has std ~1/sqrt(cols)), streamed tensor by tensor: an 8B file needs ~60 MB of
memory and a few seconds per GB. The other types are llama.cpp's own requantizations of it
(`ggufpy.kernels.bench.requantized`, llama-cpp-python). Files go to ~/.cache/ggufpy/bench and are reused.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path.home() / ".cache" / "ggufpy" / "bench"
Q8_0_BLOCK, Q8_0_BYTES = 32, 34


@dataclass(frozen=True)
class Dims:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    hidden_dim: int
    rope_theta: float = 500000.0

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


# the published configs of the models named (config.json), vocabulary aside
SIZES = {
    "1B": Dims(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, hidden_dim=8192),  # Llama-3.2-1B
    "3B": Dims(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, hidden_dim=8192),  # Llama-3.2-3B
    "8B": Dims(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, hidden_dim=14336),  # Llama-3.1-8B
}


def _q8_0_blocks(rng: np.random.Generator, rows: int, cols: int, std: float) -> np.ndarray:
    """Random Q8_0 bytes (rows, cols / 32 * 34): uniform quants in [-127, 127] times d = std * sqrt(3) / 127."""
    nb = rows * cols // Q8_0_BLOCK
    blocks = np.empty((nb, Q8_0_BYTES), np.uint8)
    blocks[:, :2] = np.frombuffer(np.float16(std * np.sqrt(3) / 127).tobytes() * nb, np.uint8).reshape(nb, 2)
    blocks[:, 2:] = rng.integers(-127, 128, (nb, Q8_0_BLOCK), dtype=np.int8).view(np.uint8)
    return blocks.reshape(rows, -1)


def _tensors(d: Dims, vocab: int):
    """(name, shape (rows, cols) or (cols,), std or None for a norm) in llama.cpp's order."""
    q, kv = d.n_heads * d.head_dim, d.n_kv_heads * d.head_dim
    yield "token_embd.weight", (vocab, d.dim), 1.0
    for i in range(d.n_layers):
        p = f"blk.{i}."
        yield p + "attn_norm.weight", (d.dim,), None
        for name, rows, cols in (("attn_q", q, d.dim), ("attn_k", kv, d.dim), ("attn_v", kv, d.dim),
                                 ("attn_output", d.dim, q)):  # fmt: skip
            yield p + name + ".weight", (rows, cols), cols**-0.5
        yield p + "ffn_norm.weight", (d.dim,), None
        for name, rows, cols in (("ffn_gate", d.hidden_dim, d.dim), ("ffn_up", d.hidden_dim, d.dim),
                                 ("ffn_down", d.dim, d.hidden_dim)):  # fmt: skip
            yield p + name + ".weight", (rows, cols), cols**-0.5
    yield "output_norm.weight", (d.dim,), None
    yield "output.weight", (vocab, d.dim), d.dim**-0.5


def write_q8_0(path: Path, d: Dims, seed: int = 0) -> Path:
    """The model in Q8_0 (norms F32), written tensor by tensor."""
    sys.path.insert(0, str(ROOT))
    from conformance.fixtures import CHAT_TEMPLATE, MERGES, _tokens

    tokens, token_types = _tokens()
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(f"synthetic-llama-{path.stem}")
    w.add_context_length(131072)
    w.add_embedding_length(d.dim)
    w.add_block_count(d.n_layers)
    w.add_feed_forward_length(d.hidden_dim)
    w.add_head_count(d.n_heads)
    w.add_head_count_kv(d.n_kv_heads)
    w.add_rope_dimension_count(d.head_dim)
    w.add_rope_freq_base(d.rope_theta)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    specs = list(_tensors(d, len(tokens)))
    for name, shape, std in specs:
        if std is None:
            w.add_tensor_info(name, shape, np.dtype(np.float32), 4 * shape[0])
        else:
            rows, cols = shape
            nbytes = rows * cols // Q8_0_BLOCK * Q8_0_BYTES
            w.add_tensor_info(name, (rows, nbytes // rows), np.dtype(np.uint8), nbytes, gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for _name, shape, std in specs:
        if std is None:  # norm weights around 1
            w.write_tensor_data((1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
        else:
            w.write_tensor_data(_q8_0_blocks(rng, *shape, std))
    w.close()
    return path


def model(size: str, ftype: str = "Q8_0") -> Path:
    """~/.cache/ggufpy/bench/synthetic-llama-{size}.Q8_0[.{ftype}].gguf, written on first use."""
    CACHE.mkdir(parents=True, exist_ok=True)
    base = CACHE / f"synthetic-llama-{size}.Q8_0.gguf"
    if not base.exists():
        tmp = write_q8_0(base.with_suffix(".tmp"), SIZES[size])
        tmp.replace(base)
    if ftype == "Q8_0":
        return base
    from ggufpy.kernels.bench import requantized

    return requantized(base, ftype)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--types", nargs="+", default=["Q8_0", "Q4_0", "Q4_K_M"])
    args = ap.parse_args(argv)
    for size in args.sizes:
        for ftype in args.types:
            path = model(size, ftype)
            print(f"{path}  {path.stat().st_size / 1e9:.2f} GB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
