"""`ggufpy.hf`: the HF-style model facade and the GGUF tokenizer as a transformers fast tokenizer."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
from transformers import PreTrainedTokenizerFast

import ggufpy
from ggufpy.chat import ChatTemplate
from ggufpy.cli.run import chat_prompt_ids
from ggufpy.generation import generate_text
from ggufpy.hf import CausalLMOutput, GGUFCache, GGUFModelForCausalLM, HFStyleTokenizer, load_tokenizer
from ggufpy.sampling import SamplingParams

TEXTS = [
    "Hello world",
    " leading space and  double  spaces",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "numbers 3.14159 and 1234567, punctuation!? ¿qué? — naïve café 日本語 🙂",
    "<|im_end|><|im_end|>x<|endoftext|>",
    "",
]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "Another?"},
]


@pytest.fixture(scope="module")
def smollm2_fast(smollm2_file):
    """SmolLM2 with every dequantized weight kept (the default cache holds about half of them)."""
    return GGUFModelForCausalLM.from_pretrained(smollm2_file, backend_options={"cache_bytes": 1 << 30})


@pytest.fixture(scope="module")
def tiny_hf(tiny_llama_path):
    return GGUFModelForCausalLM.from_pretrained(tiny_llama_path)


# -- tokenizer ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["tiny", "smollm2"])
def test_hf_tokenizer_gives_ggufpy_ids(which, tiny_llama_path, smollm2_file):
    path = tiny_llama_path if which == "tiny" else smollm2_file
    hf, ours = load_tokenizer(path), ggufpy.load_tokenizer(path)
    assert isinstance(hf, PreTrainedTokenizerFast)
    assert len(hf) == ours.vocab_size
    for text in TEXTS:
        ids = ours.encode(text, add_special=True, parse_special=True)
        assert hf.encode(text) == ids, text
        assert hf(text)["input_ids"] == ids
        assert hf.decode(ids) == ours.decode(ids), text
        assert hf.decode(ids, skip_special_tokens=True) == ours.decode(ids, skip_special=True), text
    assert hf.convert_ids_to_tokens(5) == ours.piece(5)


def test_hf_tokenizer_special_tokens_and_chat_template(smollm2_file):
    hf, ours = load_tokenizer(smollm2_file), ggufpy.load_tokenizer(smollm2_file)
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id, hf.unk_token_id) == (
        ours.bos_id,
        ours.eos_id,
        ours.pad_id,
        ours.unk_id,
    )
    assert (hf.bos_token, hf.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert hf.chat_template == ours.chat_template and hf.padding_side == "left"
    assert hf.model_max_length == 8192
    rendered = ChatTemplate.from_tokenizer(ours).render(MESSAGES, add_generation_prompt=True)
    assert hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == rendered
    ids = hf.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=False)
    assert ids == chat_prompt_ids(ours, MESSAGES)


def test_hf_style_tokenizer_matches_the_fast_one(smollm2_file):
    fast, ours = load_tokenizer(smollm2_file), ggufpy.load_tokenizer(smollm2_file)
    lite = HFStyleTokenizer(ours, 8192)
    for text in TEXTS:
        ids = fast.encode(text)
        assert lite.encode(text) == ids
        assert lite.decode(ids) == fast.decode(ids)
        assert lite.decode(np.array(ids), skip_special_tokens=True) == fast.decode(ids, skip_special_tokens=True)
    assert lite.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == fast.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True
    )
    assert (lite.eos_token_id, lite.pad_token, lite.unk_token) == (fast.eos_token_id, fast.pad_token, fast.unk_token)
    assert lite.all_special_ids == sorted(fast.all_special_ids)
    assert lite.convert_tokens_to_ids(["<|im_end|>", "no such token"]) == [2, ours.unk_id]
    assert lite.batch_decode(np.array([[1, 2], [2, 1]])) == ["<|im_start|><|im_end|>", "<|im_end|><|im_start|>"]


def test_without_transformers_load_tokenizer_falls_back(tiny_llama_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    with pytest.warns(UserWarning, match=r"pip install 'ggufpy\[hf\]'"):
        tok = load_tokenizer(tiny_llama_path)
    assert isinstance(tok, HFStyleTokenizer) and tok.model_max_length == 256


@pytest.fixture()
def gemma3_file():
    from tests.models import gemma3_path

    return gemma3_path()


@pytest.mark.slow
def test_hf_tokenizer_on_gemma3_spm(gemma3_file):
    """SentencePiece vocabulary with BOS added: the post-processor and the per-fragment prefix space."""
    hf, ours = load_tokenizer(gemma3_file), ggufpy.load_tokenizer(gemma3_file)
    for text in TEXTS:
        ids = ours.encode(text, add_special=True, parse_special=True)
        assert hf.encode(text) == ids, text
        assert hf.decode(ids, skip_special_tokens=True) == ours.decode(ids, skip_special=True), text


# -- model -------------------------------------------------------------------------------------------------


def test_logits_equal_model_logits(smollm2_fast):
    ids = np.array([ggufpy.load_tokenizer(smollm2_fast.model.file.path).encode("The capital of France is")])
    out = smollm2_fast(ids)
    assert isinstance(out, CausalLMOutput) and out.past_key_values is None
    assert out.logits.shape == (1, ids.shape[1], 49152) and out.logits.dtype == np.float32
    assert np.array_equal(out.logits[0], smollm2_fast.model.logits(ids[0]))
    assert out["logits"] is out.logits and out[0] is out.logits


def test_config_carries_hf_fields(smollm2_fast):
    c = smollm2_fast.config
    assert (c.vocab_size, c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (
        49152,
        576,
        30,
        9,
        3,
    )
    assert (c.max_position_embeddings, c.bos_token_id, c.eos_token_id, c.pad_token_id) == (8192, 1, 2, 2)
    assert (c.model_type, c.intermediate_size, c.head_dim, c.tie_word_embeddings) == ("llama", 1536, 64, True)
    assert c.to_dict()["architectures"] == ["GGUFModelForCausalLM"]


def test_left_padded_batch_gives_each_prompt_alone(smollm2_fast, smollm2_file):
    tok = load_tokenizer(smollm2_file)
    prompts = ["Hi", "The capital of France is"]
    batch = tok(prompts, padding=True, return_tensors="np")
    assert batch["attention_mask"][0, 0] == 0  # left padding
    out = smollm2_fast(batch["input_ids"], attention_mask=batch["attention_mask"])
    for b, prompt in enumerate(prompts):
        real = batch["attention_mask"][b].astype(bool)
        assert np.array_equal(out.logits[b, real], smollm2_fast.model.logits(tok.encode(prompt)))
        assert not out.logits[b, ~real].any()  # padding positions get zero logits


def test_padding_either_side_and_cache_continuation(tiny_hf):
    model = tiny_hf.model
    a, b = [5, 6, 7, 8, 9], [40, 41, 42]
    ids = np.array([a, [0, 0, *b]])
    mask = np.array([[1] * 5, [0, 0, 1, 1, 1]])
    right = np.array([a, [*b, 0, 0]])
    rmask = mask[:, ::-1]
    left_out = tiny_hf(ids, attention_mask=mask, use_cache=True)
    right_out = tiny_hf(right, attention_mask=rmask)
    assert np.array_equal(left_out.logits[1, 2:], model.logits(b)) and np.array_equal(
        right_out.logits[1, :3], model.logits(b)
    )
    assert np.array_equal(left_out.logits[0], model.logits(a))

    # continue both rows with the cache; HF passes the mask of past + new columns
    cache = left_out.past_key_values
    assert isinstance(cache, GGUFCache) and cache.get_seq_length() == 5 and cache.lengths == [5, 3]
    step = tiny_hf(np.array([[10], [43]]), attention_mask=np.ones((2, 6), int), past_key_values=cache)
    assert step.past_key_values is cache and cache.lengths == [6, 4]
    expected = []
    for row in (a, b):
        kv = model.new_cache()
        model.forward(np.array(row), 0, kv)
        expected.append(model.forward(np.array([10 if row is a else 43]), len(row), kv)[0])
    assert np.array_equal(step.logits[:, 0], np.stack(expected))
    with pytest.raises(ValueError, match="only left or right padding"):
        tiny_hf(ids, attention_mask=np.array([[1, 0, 1, 1, 1], [1] * 5]))
    with pytest.raises(ValueError, match=r"expected \(2, 1\) or \(2, 7\) with 6 cached columns"):
        tiny_hf(np.array([[1], [2]]), attention_mask=np.ones((2, 3)), past_key_values=cache)


def test_generate_equals_ggufpy_greedy_generation(smollm2_fast, smollm2_file):
    ours = ggufpy.load_tokenizer(smollm2_file)
    prompt = chat_prompt_ids(ours, [{"role": "user", "content": "What is the capital of France?"}])
    out = smollm2_fast.generate(np.array([prompt]), max_new_tokens=20)
    ref = generate_text(smollm2_fast.model, ours, prompt, max_tokens=20, sampling=SamplingParams.greedy())
    assert out[0, : len(prompt)].tolist() == prompt
    assert out[0, len(prompt) :].tolist() == list(ref.token_ids)
    assert "Paris" in ref.text


def test_batched_generate_pads_finished_rows(tiny_hf):
    prompts = [[5, 6, 7, 8, 9], [40, 41, 42]]
    ids = np.array([prompts[0], [0, 0, *prompts[1]]])
    mask = np.array([[1] * 5, [0, 0, 1, 1, 1]])
    out = tiny_hf.generate(ids, attention_mask=mask, max_new_tokens=8, eos_token_id=[], pad_token_id=0)
    assert out.shape == (2, 13)
    for row, prompt in zip(out, prompts, strict=True):
        alone = tiny_hf.generate(np.array([prompt]), max_new_tokens=8, eos_token_id=[])
        assert row[5:].tolist() == alone[0, len(prompt) :].tolist()
    # a row that ends early is padded while the other goes on
    first = int(tiny_hf.generate(np.array([prompts[1]]), max_new_tokens=1)[0, -1])
    out = tiny_hf.generate(ids, attention_mask=mask, max_new_tokens=4, eos_token_id=first, pad_token_id=7)
    assert out[1, 5] == first and (out[1, 6:] == 7).all()


def test_sampling_is_seeded_and_penalties_apply(tiny_hf):
    ids = np.array([[5, 6, 7]])
    a = tiny_hf.generate(ids, max_new_tokens=6, do_sample=True, temperature=1.5, top_k=20, seed=3, eos_token_id=[])
    b = tiny_hf.generate(ids, max_new_tokens=6, do_sample=True, temperature=1.5, top_k=20, seed=3, eos_token_id=[])
    assert np.array_equal(a, b) and a.shape == (1, 9)
    greedy = tiny_hf.generate(ids, max_new_tokens=6, eos_token_id=[])
    penalized = tiny_hf.generate(ids, max_new_tokens=6, repetition_penalty=1e6, eos_token_id=[])
    generated = penalized[0, 3:].tolist()
    assert len(set([*generated, 5, 6, 7])) == 9  # a huge penalty never repeats a token
    assert greedy.shape == penalized.shape
    with pytest.raises(NotImplementedError, match="beam search"):
        tiny_hf.generate(ids, num_beams=2)
    with pytest.raises(TypeError, match="unsupported arguments"):
        tiny_hf.generate(ids, typical_p=0.5)


def test_torch_tensors_in_give_torch_tensors_out(tiny_hf, monkeypatch):
    """The torch path, with a stand-in module (torch itself is not a test dependency)."""

    class Tensor:  # what the facade uses of a torch tensor: detach().cpu().numpy(), and torch.from_numpy
        def __init__(self, array):
            self.array = np.asarray(array)

        def detach(self):
            return self

        def cpu(self):
            return self

        def numpy(self):
            return self.array

    Tensor.__module__ = "torch"
    fake_torch = types.ModuleType("torch")
    fake_torch.Tensor = Tensor
    fake_torch.from_numpy = Tensor
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    ids = [[5, 6, 7, 8]]
    out = tiny_hf(Tensor(ids), attention_mask=Tensor(np.ones((1, 4), np.int64)))
    assert isinstance(out.logits, Tensor) and np.array_equal(out.logits.array, tiny_hf(np.array(ids)).logits)
    gen = tiny_hf.generate(Tensor(ids), max_new_tokens=3, eos_token_id=[])
    assert isinstance(gen, Tensor) and gen.array.shape == (1, 7) and gen.array.dtype == np.int64


def test_from_pretrained_options_and_module_conveniences(tiny_llama_path):
    model = GGUFModelForCausalLM.from_pretrained(
        tiny_llama_path.parent, gguf_file=tiny_llama_path.name, torch_dtype="float32", device_map="cpu"
    )
    assert model.eval() is model and model.to("cpu") is model and model.device == "cpu"
    with pytest.raises(ValueError, match="CPU only"):
        model.to("cuda:0")
    with pytest.raises(TypeError, match=r"unsupported options \['quantization_config'\]"):
        GGUFModelForCausalLM.from_pretrained(tiny_llama_path, quantization_config={})
    with pytest.raises(ValueError, match="needs the whole model"):
        GGUFModelForCausalLM(ggufpy.load(tiny_llama_path, layers=range(0, 2)))
    with pytest.raises(NotImplementedError, match="output_hidden_states"):
        model(np.array([[1, 2]]), output_hidden_states=True)
