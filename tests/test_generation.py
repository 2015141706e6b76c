"""Streaming generation against a fake model whose tokens are byte pieces.

Multi-byte UTF-8 characters ("é", "中", emoji) are split across tokens, so these tests show that no broken
character is ever emitted, that stop strings are cut even when split across tokens, and that the chunks add
up to the final text.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ggufpy.generation import (
    GenerationChunk,
    IncrementalDecoder,
    LanguageModel,
    TokenizerLike,
    generate,
    generate_text,
    reuse_cache,
    split_at_stop,
)
from ggufpy.sampling import Sampler, SamplingParams

GREEDY = SamplingParams.greedy()
EOS = 256


class ByteTokenizer:
    """Token i < 256 is the single byte i; then a few multi-byte pieces; EOS decodes to nothing."""

    pieces = (b"", b"hello", b" wor", b"ld", b"ST", b"OP", b"\xe4\xb8", b"\xad\xe6")  # 256..263

    def __init__(self, strip_leading_space: bool = False):
        self.eog_ids = frozenset({EOS})
        self.strip_leading_space = strip_leading_space  # SentencePiece-like decode of the first piece
        self.decode_lengths: list[int] = []

    @property
    def vocab_size(self) -> int:
        return 256 + len(self.pieces)

    def piece(self, i: int) -> bytes:
        return bytes([i]) if i < 256 else self.pieces[i - 256]

    def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        self.decode_lengths.append(len(ids))
        text = b"".join(self.piece(i) for i in ids).decode("utf-8", errors="replace")
        return text[1:] if self.strip_leading_space and text.startswith(" ") else text


class ScriptedModel:
    """Greedy-decodes a fixed continuation: after n tokens of context it predicts ``script[n - n_prompt]``.

    It checks the calling convention (positions follow the cache, one prefill then one token per call)
    and records every call.
    """

    def __init__(self, n_prompt: int, script: Sequence[int], vocab: int, eos: int = EOS):
        self.n_prompt, self.script, self.vocab, self.eos = n_prompt, list(script), vocab, eos
        self.calls: list[tuple[int, int, bool]] = []  # (pos, T, last_only)

    def new_cache(self) -> list[int]:
        return []

    def forward(self, x, pos, cache, layers=None, last_only=False):
        x = np.asarray(x)
        assert x.ndim == 1 and np.issubdtype(x.dtype, np.integer)
        assert pos == len(cache), "position must continue the cache"
        self.calls.append((pos, x.shape[0], last_only))
        cache.extend(int(t) for t in x)
        rows = []
        for p in range(pos, pos + x.shape[0]):
            i = p + 1 - self.n_prompt
            target = self.script[i] if 0 <= i < len(self.script) else self.eos
            row = np.zeros(self.vocab, dtype=np.float32)
            row[target] = 10.0
            rows.append(row)
        logits = np.stack(rows)
        return logits[-1:] if last_only else logits


def byte_ids(text: str) -> list[int]:
    return list(text.encode("utf-8"))


DEFAULT_PROMPT = (ord("P"), ord(">"))


def run(script, stop=(), max_tokens=256, prompt=DEFAULT_PROMPT, tok=None, sampling=GREEDY):
    tok = tok or ByteTokenizer()
    model = ScriptedModel(len(prompt), script, tok.vocab_size)
    gen = generate(model, tok, list(prompt), max_tokens=max_tokens, sampling=sampling, stop=stop)
    chunks = list(gen)
    return chunks, gen.result, model


def test_fakes_satisfy_the_protocols():
    assert isinstance(ScriptedModel(1, [], 10), LanguageModel)
    assert isinstance(ByteTokenizer(), TokenizerLike)


MULTIBYTE = "héllo 中文 🙂 naïve — ok"


def test_multibyte_characters_split_across_tokens_are_never_broken():
    chunks, result, _ = run([*byte_ids(MULTIBYTE), EOS])
    assert all("\ufffd" not in c.text for c in chunks)
    assert all(c.text for c in chunks)
    assert "".join(c.text for c in chunks) == result.text == MULTIBYTE
    # Each chunk is released by the token that completes it: the last byte of a multi-byte character.
    assert [c.text for c in chunks if not c.text.isascii()] == ["é", "中", "文", "🙂", "ï", "—"]
    emoji = next(c for c in chunks if c.text == "🙂")
    assert emoji.token_id == "🙂".encode()[-1]


def test_multi_byte_pieces_that_straddle_characters():
    # 263 ends in the first byte of "文" (e6 96 87), 262 is the first two bytes of "中" (e4 b8 ad).
    script = [ord("a"), 262, 263, 0x96, 0x87, ord("b"), EOS]
    chunks, result, _ = run(script)
    assert [c.text for c in chunks] == ["a", "中", "文", "b"]
    assert result.text == "a中文b"


def test_eog_ends_generation_and_is_not_emitted():
    _, result, model = run([*byte_ids("hi"), EOS, *byte_ids("never")])
    assert result.finish_reason == "eog"
    assert result.text == "hi"
    assert result.token_ids == (ord("h"), ord("i"), EOS)
    assert result.completion_tokens == 3 and result.prompt_tokens == 2
    # one prefill with last_only, then one call per sampled token except the last
    assert model.calls == [(0, 2, True), (2, 1, True), (3, 1, True)]


def test_max_tokens_gives_length():
    _, result, model = run(byte_ids("abcdefgh"), max_tokens=5)
    assert result.finish_reason == "length"
    assert result.text == "abcde"
    assert result.completion_tokens == 5 == len(result.token_ids)
    assert len(model.calls) == 5
    assert model.calls[0] == (0, 2, True)


def test_max_tokens_zero_runs_nothing():
    chunks, result, model = run(byte_ids("abc"), max_tokens=0)
    assert chunks == [] and model.calls == []
    assert (result.text, result.finish_reason, result.completion_tokens) == ("", "length", 0)


def test_length_cut_inside_a_character_flushes_a_replacement_char():
    # The budget ends after the first byte of "中": the final text says so rather than dropping it.
    _, result, _ = run(byte_ids("a中"), max_tokens=2)
    assert result.text == "a\ufffd"


@pytest.mark.parametrize(
    "script, stop, text",
    [
        (byte_ids("Hello, world! STOP here"), ["STOP"], "Hello, world! "),
        ([*byte_ids("Hello"), 258, 259, 260, 261, *byte_ids(" more")], ["STOP"], "Hello world"),
        ([*byte_ids("xx"), 260, 261], ["TO"], "xxS"),  # the stop string straddles two pieces
        (byte_ids("ab 中文 cd"), ["文 c"], "ab 中"),  # ... and the bytes of a character
        (byte_ids("one\ntwo\n\nthree"), ["\n\n", "\nt"], "one"),  # the first to complete wins
        (byte_ids("xaab"), ["ab", "aab"], "x"),  # same end: the earlier start wins
        (byte_ids("_abcd"), ["abcd", "bc"], "_a"),  # "bc" completes before "abcd"
        (byte_ids("aaab"), ["aab"], "a"),  # overlapping partial matches
    ],
)
def test_stop_strings_are_cut_even_when_split_across_tokens(script, stop, text):
    chunks, result, _ = run([*script, EOS], stop=stop)
    assert result.finish_reason == "stop"
    assert result.text == text == "".join(c.text for c in chunks)


def test_stop_ends_generation_at_the_token_completing_it():
    script = byte_ids("ab<END>cd")
    _, result, model = run([*script, EOS], stop=["<END>"])
    assert result.token_ids == tuple(byte_ids("ab<END>"))
    assert len(model.calls) == len(result.token_ids)


def test_text_that_might_start_a_stop_string_is_held_back():
    tok = ByteTokenizer()
    model = ScriptedModel(1, [*byte_ids("ab\ncd\n\nef"), EOS], tok.vocab_size)
    seen = ""
    for chunk in generate(model, tok, [ord(">")], sampling=GREEDY, stop=["\n\n"]):
        seen += chunk.text
        # Whenever text comes out, the model has produced more than that: never a trailing "\n".
        assert not seen.endswith("\n")
    assert seen == "ab\ncd"


def test_held_back_text_is_released_when_the_stream_ends():
    chunks, result, _ = run([*byte_ids("go ST"), EOS], stop=["STOP"])
    assert result.finish_reason == "eog"
    assert result.text == "go ST" == "".join(c.text for c in chunks)


def test_stop_accepts_a_plain_string():
    _, result, _ = run([*byte_ids("yes. no"), EOS], stop=".")
    assert (result.text, result.finish_reason) == ("yes", "stop")


def test_first_token_is_rendered_in_context():
    """A SentencePiece-like decoder drops the leading space of a decode; the prompt tail gives context."""
    tok = ByteTokenizer(strip_leading_space=True)
    _, result, _ = run([258, 259, EOS], prompt=byte_ids("Hello"), tok=tok)
    assert result.text == " world"


def test_decode_window_stays_bounded():
    """Each step decodes a short window, so the cost per token does not grow with the text (O(n) total)."""
    tok = ByteTokenizer()
    text = "abc 中文 🙂 " * 200
    _, result, _ = run([*byte_ids(text), EOS], tok=tok, max_tokens=10_000)
    assert result.text == text
    assert max(tok.decode_lengths) <= 16


def test_genuine_replacement_characters_are_released():
    text = "a\ufffdb\ufffd" + "c" * 20
    chunks, result, _ = run([*byte_ids(text), EOS])
    assert result.text == text
    # Released once the decoder is sure it is not an incomplete character, before the stream ends.
    assert any("\ufffd" in c.text for c in chunks[:-1])


def test_result_before_exhaustion_raises():
    tok = ByteTokenizer()
    gen = generate(ScriptedModel(1, byte_ids("abc"), tok.vocab_size), tok, [1], sampling=GREEDY)
    assert not gen.done
    with pytest.raises(RuntimeError, match="not finished"):
        _ = gen.result
    assert isinstance(next(gen), GenerationChunk)
    list(gen)
    assert gen.done and gen.result.text == "abc"


def test_generate_text_and_timings():
    tok = ByteTokenizer()
    model = ScriptedModel(2, [*byte_ids("xyz"), EOS], tok.vocab_size)
    result = generate_text(model, tok, [1, 2], sampling=GREEDY)
    assert result.text == "xyz" and result.finish_reason == "eog"
    assert result.prefill_seconds >= 0 and result.decode_seconds >= 0
    assert result.prefill_tokens_per_second >= 0 and result.decode_tokens_per_second >= 0


def test_bad_arguments():
    tok = ByteTokenizer()
    model = ScriptedModel(1, [], tok.vocab_size)
    with pytest.raises(ValueError, match="empty"):
        generate(model, tok, [], sampling=GREEDY)
    with pytest.raises(ValueError, match="max_tokens"):
        generate(model, tok, [1], max_tokens=-1, sampling=GREEDY)
    with pytest.raises(TypeError, match="SamplingParams or a Sampler"):
        generate(model, tok, [1], sampling={"temperature": 0})


class PreferenceModel:
    """Always ranks token ``a`` first and ``b`` second, whatever the context."""

    def __init__(self, vocab: int, a: int, b: int):
        self.vocab, self.a, self.b = vocab, a, b

    def new_cache(self):
        return None

    def forward(self, x, pos, cache, layers=None, last_only=False):
        row = np.full(self.vocab, -100.0, dtype=np.float32)
        row[self.a], row[self.b] = 3.0, 2.0
        return np.tile(row, (1 if last_only else len(x), 1))


def test_penalties_see_the_prompt_and_the_generated_tokens():
    tok = ByteTokenizer()
    model = PreferenceModel(tok.vocab_size, ord("a"), ord("b"))
    params = SamplingParams.greedy(presence_penalty=5.0, penalty_last_n=64)
    assert generate_text(model, tok, byte_ids(">"), max_tokens=3, sampling=params).text == "aba"
    # "a" in the prompt is penalised from the first step on.
    assert generate_text(model, tok, byte_ids("a>"), max_tokens=1, sampling=params).text == "b"


def test_seeded_sampling_is_reproducible_and_a_sampler_continues_its_stream():
    tok = ByteTokenizer()

    class Uniform(PreferenceModel):
        def forward(self, x, pos, cache, layers=None, last_only=False):
            row = np.full(self.vocab, -np.inf, dtype=np.float32)
            row[ord("a") : ord("z") + 1] = 0.0
            return np.tile(row, (1 if last_only else len(x), 1))

    model = Uniform(tok.vocab_size, 0, 0)
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=3)
    a = generate_text(model, tok, [1], max_tokens=30, sampling=params).text
    assert a == generate_text(model, tok, [1], max_tokens=30, sampling=params).text
    assert len(set(a)) > 5
    sampler = Sampler(params)
    first = generate_text(model, tok, [1], max_tokens=15, sampling=sampler).text
    second = generate_text(model, tok, [1], max_tokens=15, sampling=sampler).text
    assert first + second == a


# --- the pieces on their own -----------------------------------------------------------------------


class PieceTokenizer:
    """Token i is ``pieces[i]``, an arbitrary byte string (byte-level BPE can cut characters anywhere)."""

    eog_ids = frozenset()

    def __init__(self, pieces: Sequence[bytes]):
        self.pieces = list(pieces)

    def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")


def cut(data: bytes, sizes: Sequence[int]) -> list[bytes]:
    """``data`` split into pieces of the given sizes (cycled), the last one taking the rest."""
    pieces, i, k = [], 0, 0
    while i < len(data):
        n = sizes[k % len(sizes)] if sizes else 1
        pieces.append(data[i : i + n])
        i, k = i + n, k + 1
    return pieces


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=40), sizes=st.lists(st.integers(1, 5), max_size=8))
def test_incremental_decoder_never_breaks_characters_and_adds_up(text, sizes):
    """Valid UTF-8 text cut into byte pieces at arbitrary places comes out whole and unchanged."""
    pieces = [b"ctx", *cut(text.encode("utf-8"), sizes)]
    dec = IncrementalDecoder(PieceTokenizer(pieces), [0])
    out = []
    for i in range(1, len(pieces)):
        piece = dec.push(i)
        if "\ufffd" not in text:
            assert "\ufffd" not in piece
        out.append(piece)
    out.append(dec.flush())
    assert "".join(out) == text


def test_long_run_of_tokens_that_all_straddle_characters():
    """A 1-byte token then 3-byte tokens over 3-byte CJK text: every token ends inside a character."""
    text = "中文字符串测试一二三四五六七八九十" * 3
    data = text.encode("utf-8")
    pieces = [data[:1]] + [data[i : i + 3] for i in range(1, len(data), 3)]
    dec = IncrementalDecoder(PieceTokenizer(pieces))
    outs = [dec.push(i) for i in range(len(pieces))]
    assert all("\ufffd" not in o for o in outs)
    assert outs[1:-1] == list(text[:-1])  # from the second token on, one whole character per token
    assert "".join(outs) + dec.flush() == text


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="ab\n中", max_size=30),
    stop=st.lists(st.text(alphabet="ab\n中", min_size=1, max_size=4), min_size=1, max_size=3),
    splits=st.lists(st.integers(0, 30), max_size=8),
)
def test_split_at_stop_streaming_equals_cutting_the_whole_text(text, stop, splits):
    """Feeding text in arbitrary pieces gives the same output as cutting the whole text: chunking is invisible."""
    bounds = sorted({min(s, len(text)) for s in splits} | {0, len(text)})
    pending, emitted, stopped = "", "", False
    for lo, hi in itertools.pairwise(bounds):
        out, pending, stopped = split_at_stop(pending + text[lo:hi], stop)
        emitted += out
        if stopped:
            break
    else:
        out, pending, stopped = split_at_stop(pending, stop)
        emitted += out + pending
    # The whole text cut at the stop string that completes first (earliest end, then earliest start).
    hits = [(text.find(s) + len(s), text.find(s)) for s in stop if s in text]
    expected = text[: min(hits)[1]] if hits else text
    assert emitted == expected
    assert stopped == bool(hits)


def test_time_spent_by_the_consumer_is_not_decode_time():
    tok = ByteTokenizer()
    gen = generate(ScriptedModel(1, byte_ids("abcd"), tok.vocab_size), tok, [1], max_tokens=4, sampling=GREEDY)
    for _ in gen:
        time.sleep(0.03)
    assert gen.result.text == "abcd"
    assert gen.result.decode_seconds < 0.03


class CleanSpacesTokenizer(PieceTokenizer):
    """Like llama.cpp's detokenize with clean_spaces: " ." becomes "." (not prefix-stable)."""

    def decode(self, ids: Sequence[int]) -> str:
        return super().decode(ids).replace(" .", ".")


def test_decoder_loses_nothing_when_decoding_is_not_prefix_stable():
    dec = IncrementalDecoder(CleanSpacesTokenizer([b"Hello", b" ", b".", b" ok"]))
    out = [dec.push(i) for i in range(4)] + [dec.flush()]
    assert "".join(out) == "Hello . ok"  # what piece-by-piece rendering gives


# --- continuing a sequence, the context limit, non-finite logits -------------------------------------------


def test_generation_continues_from_a_cache_like_a_fresh_run(tiny_llama):
    """A second turn fed only its new tokens gives the tokens a fresh run of the whole sequence gives."""
    tok = tiny_llama.tokenizer
    first = tok.encode("the cat sat on the mat")
    gen = generate(tiny_llama, tok, first, max_tokens=6, sampling=GREEDY, cache=tiny_llama.new_cache(capacity=64))
    for _ in gen:
        pass
    assert gen.cache.length == len(first) + gen.result.completion_tokens - 1 == len(gen.cache_ids)
    assert gen.cache_ids == first + list(gen.result.token_ids[:-1])
    second = [*gen.cache_ids, gen.result.token_ids[-1], *tok.encode(" and then")]
    kept = reuse_cache(gen.cache, gen.cache_ids, second)
    assert kept == len(gen.cache_ids)
    continued = generate_text(tiny_llama, tok, second, max_tokens=6, sampling=GREEDY, cache=gen.cache)
    fresh = generate_text(tiny_llama, tok, second, max_tokens=6, sampling=GREEDY)
    assert continued.token_ids == fresh.token_ids
    assert continued.cached_tokens == kept and fresh.cached_tokens == 0


def test_reuse_cache_keeps_the_common_prefix_and_one_token_to_compute(tiny_llama):
    cache = tiny_llama.new_cache(capacity=16)
    tiny_llama.forward(np.arange(1, 9), 0, cache)
    held = list(range(1, 9))
    assert reuse_cache(cache, held, [1, 2, 3, 99, 5]) == 3 and cache.length == 3  # first difference at 3
    tiny_llama.forward(np.arange(4, 9), 3, cache)
    assert reuse_cache(cache, held, held) == 7  # all shared: the last token is computed again for its logits
    with pytest.raises(ValueError, match="at least one prompt token must be new"):
        generate(tiny_llama, tiny_llama.tokenizer, held[:7], sampling=GREEDY, cache=cache)


def test_a_full_cache_ends_generation_with_length(tiny_llama):
    """Before: ContextLengthError after text had been streamed. Now an ordinary end, like llama.cpp's."""
    tok = tiny_llama.tokenizer
    prompt = tok.encode("the cat sat")
    cache = tiny_llama.new_cache(capacity=len(prompt) + 3)
    gen = generate(tiny_llama, tok, prompt, max_tokens=50, sampling=GREEDY, cache=cache)
    text = "".join(c.text for c in gen)
    assert gen.result.finish_reason == "length"
    assert gen.result.completion_tokens == 4  # 3 fed into the 3 free positions, the 4th sampled from the last
    assert gen.result.text == text and cache.length == cache.capacity


def test_nan_logits_raise_instead_of_emitting_token_zero():
    """Before: greedy took argmax(NaN) = token 0, here EOS, and the generation ended silently with no text."""

    class Broken(PreferenceModel):
        def forward(self, x, pos, cache, layers=None, last_only=False):
            return np.full((1 if last_only else len(x), self.vocab), np.nan, dtype=np.float32)

    tok = ByteTokenizer()
    tok.eog_ids = frozenset({0})
    with pytest.raises(ValueError, match="non-finite logits"):
        generate_text(Broken(tok.vocab_size, 0, 0), tok, [1], max_tokens=4, sampling=GREEDY)


def test_nan_logits_of_a_real_model_are_diagnosed(tiny_llama_path):
    import dataclasses

    import ggufpy

    model = ggufpy.load(tiny_llama_path, backend="numpy")
    nan_norm = np.full_like(np.asarray(model.weights.output_norm), np.nan)
    model.weights = dataclasses.replace(model.weights, output_norm=nan_norm)
    with pytest.raises(ValueError, match=r"non-finite|NaN"):
        generate_text(model, model.tokenizer, [1, 2, 3], max_tokens=2, sampling=GREEDY)
