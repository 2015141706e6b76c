"""Synthetic llama models at real sizes for the speed tables (issue 16): Llama-3.2-1B, Llama-3.2-3B and
Llama-3.1-8B dimensions with a 269-token vocabulary (so the head is negligible), random weights.

    python scripts/size_models.py [--sizes 1B 3B 8B] [--types Q8_0 Q4_0 Q4_K_M]

Each file is written block by block from random bytes, tensor by tensor (an 8B file needs ~60 MB of memory and
a few seconds per GB): random quants and fixed fp16 scales chosen so that each row has a std of about
1/sqrt(cols). The tensor types are llama.cpp's mixes (llama-quant.cpp): Q8_0 and Q4_0 everywhere but the
head (Q6_K for Q4_0), Q4_K_M with Q6_K for the head and for attn_v / ffn_down in the layers `use_more_bits`
picks. Requantizing with llama.cpp gives the same types but takes ~10 minutes per GB for Q4_K_M on these 2
cores; the speed of a product does not depend on the values. Files go to ~/.cache/ggufpy/bench and are reused.
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


def _f16_bytes(v: float, n: int) -> np.ndarray:
    return np.frombuffer(np.float16(v).tobytes() * n, np.uint8).reshape(n, 2)


def _random_blocks(rng: np.random.Generator, t: str, n: int, std: float) -> np.ndarray:
    """n random blocks of type t (uint8 (n, type size)) whose values have a std of about `std`."""
    u8 = lambda k: rng.integers(0, 256, (n, k), dtype=np.uint8)  # noqa: E731
    if t == "Q8_0":  # d, 32 x int8: uniform in [-127, 127] has std 127 / sqrt(3)
        q = rng.integers(-127, 128, (n, 32), dtype=np.int8).view(np.uint8)
        return np.hstack([_f16_bytes(std * np.sqrt(3) / 127, n), q])
    if t == "Q4_0":  # d, 16 bytes of nibbles: q - 8 has std ~4.6
        return np.hstack([_f16_bytes(std / 4.6, n), u8(16)])
    if t == "Q4_K":  # d, dmin, 12 bytes of 6-bit scales/mins (mean ~32), 128 bytes of nibbles (mean 7.5)
        d = std / (32 * 4.6)
        return np.hstack([_f16_bytes(d, n), _f16_bytes(7.5 * d, n), u8(12), u8(128)])
    if t == "Q6_K":  # ql, qh, 16 int8 scales (here 1..64), d: q - 32 has std ~18.5
        scales = rng.integers(1, 65, (n, 16), dtype=np.uint8)
        return np.hstack([u8(128), u8(64), scales, _f16_bytes(std / (32 * 18.5), n)])
    raise ValueError(f"no random block writer for {t}")


BLOCK = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_K": (256, 144), "Q6_K": (256, 210)}  # elements, bytes


def _use_more_bits(i: int, n: int) -> bool:
    """llama-quant.cpp's choice of the layers whose attn_v / ffn_down get more bits in the _M mixes."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_type(ftype: str, name: str, n_layers: int) -> str:
    """The type llama.cpp's mix `ftype` gives a 2-D tensor."""
    if name == "output.weight":
        return "Q8_0" if ftype == "Q8_0" else "Q6_K"
    if ftype != "Q4_K_M":
        return ftype
    parts = name.split(".")
    if parts[0] == "blk" and parts[2] in ("attn_v", "ffn_down") and _use_more_bits(int(parts[1]), n_layers):
        return "Q6_K"
    return "Q4_K"


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


def write_model(path: Path, d: Dims, ftype: str, seed: int = 0) -> Path:
    """The model in llama.cpp's mix `ftype` (norms F32), written tensor by tensor."""
    sys.path.insert(0, str(ROOT))
    from conformance.fixtures import _tokens, add_vocab

    tokens, token_types = _tokens()
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(path.stem)
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
    add_vocab(w, tokens, token_types)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_file_type(getattr(gguf.LlamaFileType, f"MOSTLY_{ftype}"))
    specs = []
    for name, shape, std in _tensors(d, len(tokens)):
        if std is None:
            w.add_tensor_info(name, shape, np.dtype(np.float32), 4 * shape[0])
            specs.append((name, shape, std, None))
            continue
        t = tensor_type(ftype, name, d.n_layers)
        (rows, cols), (elements, size) = shape, BLOCK[t]
        nbytes = rows * cols // elements * size
        w.add_tensor_info(name, (rows, nbytes // rows), np.dtype(np.uint8), nbytes, gguf.GGMLQuantizationType[t])
        specs.append((name, shape, std, t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for _name, shape, std, t in specs:
        if t is None:  # norm weights around 1
            w.write_tensor_data((1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
        else:
            rows, cols = shape
            w.write_tensor_data(_random_blocks(rng, t, rows * cols // BLOCK[t][0], std).reshape(rows, -1))
    w.close()
    return path


def model(size: str, ftype: str = "Q8_0") -> Path:
    """~/.cache/ggufpy/bench/synthetic-llama-{size}.{ftype}.gguf, written on first use."""
    CACHE.mkdir(parents=True, exist_ok=True)
    path = CACHE / f"synthetic-llama-{size}.{ftype}.gguf"
    if not path.exists():
        write_model(path.with_suffix(".tmp"), SIZES[size], ftype).replace(path)
    return path


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
