"""Record llama.cpp's tokenizations for the newer families' vocabularies (issue 13): tests/data/tokenizer/families.json.

    python scripts/record_tokenizer_families.py

The variants are `tests.tokenizer_families.FAMILY_VARIANTS` (Gemma 4's SPM-style BPE, sarvam-moe,
granite-embed-multi-311m, llama4, gpt-oss's o200k_harmony tokens, qwen35), written as vocabulary-only GGUF files
and read by llama-cpp-python (the oracle). As in variants.json (scripts/record_tokenizer_goldens.py), each keeps
sha256 digests, one per group of GROUP strings of the corpus followed by `EXTRA_CORPUS`, of the ids (add_special
and parse_special both off, both on) and of the detokenized add+parse ids, plus the vocabulary facts llama.cpp
derives (special ids, EOG set, attributes and pieces digests).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from record_tokenizer_goldens import DATA, Oracle, digest, dump_lines, group_digests, text_or_hex  # noqa: E402

from tests.tokenizer_families import (  # noqa: E402
    DERIVATIONS,
    EXTRA_CORPUS,
    FAMILY_VARIANTS,
    variant_metadata,
    write_tokenizer_gguf,
)


def record(paths: dict[str, Path], corpus: list[str]) -> dict:
    import ggufpy

    metadata = {}
    for name, path in paths.items():
        with ggufpy.open(path) as f:
            metadata[name] = dict(f.metadata)
    texts = corpus + EXTRA_CORPUS
    out, derived = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, setting in FAMILY_VARIANTS.items():
            base, derive = setting["base"], setting["derive"]
            if derive and (base, derive) not in derived:  # Gemma's merges take seconds: once per base
                derived[base, derive] = DERIVATIONS[derive](metadata[base])
            path = Path(tmp) / "variant.gguf"
            write_tokenizer_gguf(path, variant_metadata(metadata[base], setting, derived.get((base, derive), {})))
            oracle = Oracle(path)
            ids = [[oracle.tokenize(t, a, p) for t in texts] for a, p in ((False, False), (True, True))]
            detok = [text_or_hex(oracle.detokenize(x, False, True)) for x in ids[1]]
            facts = oracle.facts()
            out[label] = {
                **setting,
                "add_bos": bool(oracle.lib.llama_vocab_get_add_bos(oracle.vocab)),
                "facts": {k: facts[k] for k in ("n_tokens", "special", "eog", "add_bos", "add_eos", "attrs_sha256")}
                | {"pieces_sha256": facts["pieces_sha256"]},
                "ids_plain": group_digests(ids[0]),
                "ids_special": group_digests(ids[1]),
                "detok": group_digests(detok),
            }
            oracle.llm.close()
            del oracle
            print(f"  {label}", flush=True)
    return out


def main() -> None:
    import llama_cpp

    from tests.models import gemma3_path, smollm2_path

    corpus = json.loads((DATA / "corpus.json").read_text(encoding="utf-8"))
    paths = {"smollm2": Path(smollm2_path()), "gemma3": Path(gemma3_path())}
    variants = record(paths, corpus)
    head = {
        "llama_cpp_version": llama_cpp.__version__,
        "corpus_sha256": digest(corpus),
        "extra_corpus_sha256": digest(EXTRA_CORPUS),
    }
    (DATA / "families.json").write_text(dump_lines(head | {"variants": variants}, "variants"), encoding="utf-8")
    print(f"families: {len(variants)}")


if __name__ == "__main__":
    main()
