"""Three ways: ggufpy, llama.cpp and transformers on the same weights (issue 13).

The llama.cpp goldens check ggufpy against llama.cpp, reading the same GGUF file: a misreading the two share
(a converter-side permutation, a metadata key both interpret alike, a wrong YaRN ramp) passes them. Here the
weights start as a Hugging Face model, so transformers, the architecture's reference implementation, is a
second oracle that never sees the GGUF file:

    HF config (tiny, seeded random weights) -> save_pretrained -> llama.cpp's convert_hf_to_gguf.py -> GGUF
        transformers (f32, eager attention) on the token ids      -> logits  (the second oracle)
        ggufpy (exact numerics) on the GGUF                      -> logits
        llama.cpp on the GGUF                                     -> logits  (when llama_cpp imports)

`CASES` (conformance/threeway_cases.py) holds one function per architecture returning its transformers config.
The converter is the `convert_hf_to_gguf.py` of the llama-cpp-python sdist matching the installed
llama-cpp-python (`converter_dir` fetches it with pip). Building needs the `threeway` extra (torch, transformers,
sentencepiece); the recorded goldens (`tests/data/threeway/NAME.gguf` + `NAME.npz`) let tests compare ggufpy
with transformers without torch.

    python -m conformance.threeway [NAMES] [--record]   # live comparison; --record rewrites the goldens
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from conformance.fixtures import MERGES, SPECIALS, byte_level_tokens
from conformance.threeway_cases import CASES, SEED, VOCAB

GOLDEN_DIR = Path(__file__).resolve().parent.parent / "tests" / "data" / "threeway"
CONVERTER_CACHE = Path.home() / ".cache" / "ggufpy" / "llama.cpp-src"
LLAMA_CPP_PYTHON = "0.3.36"  # the sdist whose vendor/llama.cpp/convert_hf_to_gguf.py converts (the goldens' version)
N_TOKENS = 48  # longer than gpt-oss's window (16) and phi3's original context (32)
# transformers also runs the first N_SHORT tokens alone: where it picks RoPE factors by the sequence's length
# (LongRoPE) that prompt is below phi3's original context, elsewhere its logits are the first rows of the long one
N_SHORT = 24

# Tolerances from measurement (f32 against f32 with different summation orders; docs/conformance.md "Three
# ways" has the measured values): logit NMSE sum((a-b)^2)/sum(b^2) and the largest absolute difference.
MAX_NMSE = 1e-10
MAX_ABS = 1e-4


# -- building: random weights, a tokenizer, save ------------------------------------------------------------
def _randomize(model, seed: int) -> None:
    """Every parameter from one NumPy generator (not torch's RNG: the same values on every torch version).
    Matrices N(0, 1/dim) so activations keep their scale; norms 1 + N(0, 0.1) and biases, sinks N(0, 0.1) so
    that a misread norm, bias or sink shows; the embedding N(0, 1)."""
    import torch

    rng = np.random.default_rng(seed)
    dim = model.config.hidden_size
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            shape = tuple(p.shape)
            if "norm" in name:
                value = 1 + 0.1 * rng.standard_normal(shape)
            elif p.ndim == 1 or name.endswith("_bias") or "sinks" in name:
                value = 0.1 * rng.standard_normal(shape)
            elif "embed_tokens" in name:
                value = rng.standard_normal(shape)
            else:
                value = rng.standard_normal(shape) / np.sqrt(dim)
            p.copy_(torch.from_numpy(value.astype(np.float32)))


def write_tokenizer(directory: Path) -> None:
    """conformance.fixtures' byte-level BPE (specials, the 256 bytes, 10 merges) as a tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    pieces = SPECIALS + byte_level_tokens() + [m.replace(" ", "") for m in MERGES]
    vocab = {p: i for i, p in enumerate(pieces)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in MERGES]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(directory / "tokenizer.json"))
    # GPT2Tokenizer: the class the converter reads as a byte-level BPE for every case (phi3's asks for it by name)
    config = {"tokenizer_class": "GPT2Tokenizer", "bos_token": SPECIALS[0], "eos_token": SPECIALS[0]}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def build_hf(name: str, directory: Path):
    """The case's transformers model in f32 with eager attention and seeded weights, saved to `directory`."""
    import torch
    from transformers import AutoModelForCausalLM

    config = CASES[name]()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    _randomize(model, SEED)
    model.eval()
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    write_tokenizer(directory)
    return model


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    """transformers' logits (T, V) f32 at every position of one sequence."""
    import torch

    with torch.no_grad():
        out = model(torch.from_numpy(tokens[None].astype(np.int64)), use_cache=False)
    return out.logits[0].float().numpy()


def prompt(n: int = N_TOKENS, seed: int = SEED) -> np.ndarray:
    """`n` random token ids, the specials excluded."""
    return np.random.default_rng(seed).integers(len(SPECIALS), VOCAB, size=n).astype(np.int32)


# -- converting: llama.cpp's own convert_hf_to_gguf.py --------------------------------------------------------
# The converter names a BPE vocabulary's pre-tokenizer by hashing its encoding of a test text; this tiny
# vocabulary is none it knows, so the pre-tokenizer is named "default". The weights and hparams are untouched.
_CONVERT = """
import runpy, sys
src = sys.argv.pop(1)
sys.path.insert(0, src)
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
sys.argv[0] = src + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def converter_dir(cache: Path = CONVERTER_CACHE, fetch: bool = True, version: str = LLAMA_CPP_PYTHON) -> Path | None:
    """The llama.cpp tree holding convert_hf_to_gguf.py (with its conversion/ and gguf-py/), extracted from the
    llama-cpp-python sdist; `fetch` downloads the sdist with pip when it is not cached (None when not)."""
    root = cache / version
    if (root / "convert_hf_to_gguf.py").exists():
        return root
    if not fetch:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "-d", tmp]
        subprocess.run([*cmd, f"llama-cpp-python=={version}"], check=True, capture_output=True)
        (sdist,) = Path(tmp).glob("*.tar.gz")
        prefix = f"{sdist.name.removesuffix('.tar.gz')}/vendor/llama.cpp/"
        wanted = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if m.name.removeprefix(prefix).startswith(wanted)]
            for m in members:
                m.name = m.name.removeprefix(prefix)
            tar.extractall(root, members=members, filter="data")
    return root


def convert(model_dir: Path, out: Path, source: Path) -> Path:
    """`model_dir` converted to an F32 GGUF file at `out` by llama.cpp's converter in `source`."""
    # llama-vocab.cpp looks up "</s>", "<unk>", "<s>" in models *named* phi3 or phi-3, which this vocabulary lacks
    name = f"threeway-{model_dir.name.replace('phi3', 'phi')}"
    cmd = [sys.executable, "-c", _CONVERT, str(source), str(model_dir), "--outtype", "f32", "--outfile", str(out)]
    cmd += ["--model-name", name]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {model_dir}:\n{done.stderr[-4000:]}")
    return out


# -- running the GGUF ---------------------------------------------------------------------------------------
def ggufpy_logits(path: Path, tokens: np.ndarray, numerics: str = "exact", backend: str = "numpy") -> np.ndarray:
    import ggufpy

    model = ggufpy.load(path, backend=backend, numerics=numerics, tokenizer=False)
    return model.logits(tokens)


def llamacpp_logits(path: Path, tokens: np.ndarray) -> np.ndarray | None:
    """llama.cpp's logits (T, V), or None when llama_cpp does not import."""
    from conformance import llamacpp

    if not llamacpp.available():
        return None
    with llamacpp.LlamaCpp(path) as lc:
        logits, _ = lc.run(tokens)
    return logits


# -- comparing ----------------------------------------------------------------------------------------------
def stats(ours: np.ndarray, ref: np.ndarray) -> dict:
    """Logit NMSE, max |difference|, top-1 agreement of `ours` against `ref`."""
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return {
        "nmse": float(((ours - ref) ** 2).sum() / (ref**2).sum()),
        "max_abs": float(np.abs(ours - ref).max()),
        "top1": float((ours.argmax(-1) == ref.argmax(-1)).mean()),
    }


@dataclass
class ThreeWay:
    """One case's answers on the same token ids; `ggufpy` is None when ggufpy refused the file (`refused` says
    why), `llamacpp` when llama_cpp does not import."""

    name: str
    tokens: np.ndarray
    transformers: np.ndarray
    transformers_short: np.ndarray  # transformers on tokens[:N_SHORT] alone
    ggufpy: np.ndarray | None
    llamacpp: np.ndarray | None
    refused: str | None = None

    def table(self) -> dict[str, dict | str]:
        pairs = {
            "ggufpy vs transformers": (self.ggufpy, self.transformers),
            "llama.cpp vs transformers": (self.llamacpp, self.transformers),
            "ggufpy vs llama.cpp": (self.ggufpy, self.llamacpp),
        }
        rows: dict[str, dict | str] = {k: stats(a, b) for k, (a, b) in pairs.items() if a is not None and b is not None}
        if self.refused:
            rows["ggufpy"] = f"refused the file: {self.refused}"
        return rows


def run_live(name: str, work: Path, source: Path) -> tuple[ThreeWay, Path]:
    """Build, convert and run one case in `work`: the answers and the GGUF file."""
    from ggufpy.errors import GGUFError

    tokens = prompt()
    model = build_hf(name, work / name)
    ref, short = hf_logits(model, tokens), hf_logits(model, tokens[:N_SHORT])
    gguf_path = convert(work / name, work / f"{name}.gguf", source)
    ours, refused = None, None
    try:
        ours = ggufpy_logits(gguf_path, tokens)
    except GGUFError as e:
        refused = str(e)
    return ThreeWay(name, tokens, ref, short, ours, llamacpp_logits(gguf_path, tokens), refused), gguf_path


# -- goldens ------------------------------------------------------------------------------------------------
def golden_paths(name: str, directory: Path = GOLDEN_DIR) -> tuple[Path, Path]:
    return directory / f"{name}.gguf", directory / f"{name}.npz"


def record(result: ThreeWay, gguf_path: Path, directory: Path = GOLDEN_DIR) -> None:
    """Store the GGUF file and transformers' (and llama.cpp's) logits as the case's golden."""
    import torch
    import transformers

    directory.mkdir(parents=True, exist_ok=True)
    g, npz = golden_paths(result.name, directory)
    g.write_bytes(gguf_path.read_bytes())
    versions = {"torch": torch.__version__, "transformers": transformers.__version__, "converter": LLAMA_CPP_PYTHON}
    arrays = {
        "tokens": result.tokens,
        "transformers": result.transformers,
        "transformers_short": result.transformers_short,
    }
    if result.llamacpp is not None:  # with the build it ran on: `numerics.llamacpp_mode` replays it
        from conformance import llamacpp

        versions["llamacpp"] = llamacpp.versions()
        arrays["llamacpp"] = result.llamacpp.astype(np.float32)
    np.savez_compressed(npz, versions=json.dumps(versions), **arrays)


@dataclass(frozen=True)
class Golden:
    """A recorded case: the converted GGUF file, the token ids, transformers' logits (on all of them and on the
    first N_SHORT alone), llama.cpp's (or None) and the versions that produced them."""

    path: Path
    tokens: np.ndarray
    transformers: np.ndarray
    transformers_short: np.ndarray
    llamacpp: np.ndarray | None
    versions: dict


def load_golden(name: str, directory: Path = GOLDEN_DIR) -> Golden:
    path, npz = golden_paths(name, directory)
    with np.load(npz) as z:
        lc = z["llamacpp"] if "llamacpp" in z.files else None
        versions = json.loads(str(z["versions"]))
        return Golden(path, z["tokens"], z["transformers"], z["transformers_short"], lc, versions)


def golden_names(directory: Path = GOLDEN_DIR) -> list[str]:
    """The recorded cases, in `CASES` order."""
    return [n for n in CASES if all(p.exists() for p in golden_paths(n, directory))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m conformance.threeway", description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", default=list(CASES), help=f"cases (default: all of {', '.join(CASES)})")
    ap.add_argument("--record", action="store_true", help=f"rewrite the goldens in {GOLDEN_DIR}")
    ap.add_argument("--source", type=Path, help="a llama.cpp tree with convert_hf_to_gguf.py (default: the sdist)")
    ap.add_argument("--work", type=Path, help="keep the HF models and GGUF files in this folder (default: temporary)")
    args = ap.parse_args(argv)
    source = args.source or converter_dir()
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.names:
            result, gguf_path = run_live(name, args.work or Path(tmp), source)
            for what, s in result.table().items():
                if isinstance(s, str):
                    print(f"{name:10s} {what:26s} {s}")
                    continue
                print(f"{name:10s} {what:26s} nmse {s['nmse']:.2e}  max|d| {s['max_abs']:.2e}  top-1 {s['top1']:.1%}")
            if args.record:
                record(result, gguf_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
