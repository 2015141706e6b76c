"""`python -m conformance.record_served`: llama.cpp's token-by-token greedy decode of a few SmolLM2 prompts, the
golden of `ggufpy serve --numerics llamacpp-avx2` (tests/test_server_llamacpp_numerics.py).

In the llamacpp numerics a served request is llama.cpp's own decode of it one token at a time: every prompt
row of a batched pass is that token decoded alone (`Model.prefill_batch`), whatever else shares the pass. This
records that decode with llama.cpp itself (`LlamaCpp.greedy_token_by_token`, the goldens' settings: flash
attention off, f16 KV cache, weight repacking on) into conformance/goldens/served_smollm2.json, with the prompt
token ids llama.cpp made and the build that ran (`system_info`: record on an AVX2 CPU for `llamacpp-avx2`).
Needs ``pip install 'ggufpy[conformance]'``.
"""

from __future__ import annotations

import json
from pathlib import Path

from ggufpy.packaged import smollm2_path
from ggufpy.tokenizer import load_tokenizer

from .llamacpp import LlamaCpp, host_isa, versions

GOLDEN = Path(__file__).resolve().parent / "goldens" / "served_smollm2.json"
PROMPTS = [
    "The capital of France is",
    "Story number 3: once upon a time",
    "def fibonacci(n):",
    "Water boils at a temperature of",
]
N_TOKENS = 24


def record(path=None, prompts=PROMPTS, n: int = N_TOKENS) -> dict:
    """{"prompts": [{"text", "tokens", "completion"}], "banned", "llama_cpp"} for the packaged SmolLM2."""
    path = path or smollm2_path()
    banned = sorted(load_tokenizer(path).eog_ids)  # as the server bench bans them: every reply is n tokens
    with LlamaCpp(path) as llm:
        rows = []
        for text in prompts:
            tokens = llm.tokenize(text)
            rows.append({"text": text, "tokens": tokens, "completion": llm.greedy_token_by_token(tokens, n, banned)})
    return {"model": Path(path).name, "isa": host_isa(), "banned": banned, "prompts": rows, "llama_cpp": versions()}


def main() -> None:
    golden = record()
    GOLDEN.write_text(json.dumps(golden, indent=1) + "\n")
    print(f"wrote {GOLDEN} ({golden['isa']}: {len(golden['prompts'])} prompts x {N_TOKENS} tokens)")


if __name__ == "__main__":
    main()
