"""A Hugging Face-style facade: a GGUF model that takes `input_ids` and returns logits, and an HF tokenizer.

    from ggufpy.hf import GGUFModelForCausalLM, load_tokenizer

    tok = load_tokenizer("smollm2")                      # transformers.PreTrainedTokenizerFast
    model = GGUFModelForCausalLM.from_pretrained("smollm2")
    batch = tok(["Hi", "The capital of France is"], padding=True, return_tensors="np")
    out = model(batch["input_ids"], attention_mask=batch["attention_mask"])   # out.logits (B, T, vocab)
    ids = model.generate(batch["input_ids"], attention_mask=batch["attention_mask"], max_new_tokens=20)
    print(tok.batch_decode(ids, skip_special_tokens=True))

The model is ggufpy's NumPy transformer (weights memory-mapped and quantized, nothing dequantized at load):
NumPy arrays in give NumPy arrays out, torch tensors in give torch tensors out (torch is never imported
otherwise). Each row of a batch runs as its own sequence with its own KV cache, so a left-padded row gives
exactly the logits of the prompt run alone. The tokenizer is built from the GGUF metadata and gives
llama.cpp's ids (the same as `ggufpy.Tokenizer`); without transformers, `load_tokenizer` returns an
`HFStyleTokenizer` with the common subset of the HF interface.
"""

from .model import CausalLMOutput, GGUFCache, GGUFConfig, GGUFModelForCausalLM
from .tokenizer import HFStyleTokenizer, hf_tokenizer, load_tokenizer

__all__ = [
    "CausalLMOutput",
    "GGUFCache",
    "GGUFConfig",
    "GGUFModelForCausalLM",
    "HFStyleTokenizer",
    "hf_tokenizer",
    "load_tokenizer",
]
