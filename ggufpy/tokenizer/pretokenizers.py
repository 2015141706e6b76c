"""The `tokenizer.ggml.pre` table: which regex splits a byte-level BPE vocabulary runs before its merges.

Everything here follows llama.cpp `src/llama-vocab.cpp`: the `LLAMA_VOCAB_PRE_TYPE_*` switch in the
`llm_tokenizer_bpe` constructor (the regex lists, kept as written there) and `llama_vocab::impl::load`
(which `tokenizer.ggml.pre` names map to which type, and the flags each name sets).

llama.cpp applies the regexes of a list one after the other, each to every piece the previous one left,
and keeps both the matches and the text between them ("isolated" splits in HF `tokenizers` terms).
It runs them through `std::regex` on a "collapsed" text where every non-ASCII code point is replaced by
one byte standing for its category (`unicode.cpp: unicode_regex_split`), so inside llama.cpp:

- `\\p{Lu}`, `\\p{Ll}`, `\\p{Lt}`, `\\p{Lm}` and `\\p{Lo}` all mean any letter (`\\p{L}`);
- `$` is the end of the piece, not of a line;
- a few lists start with a pseudo-regex that names a hand-written splitter (`\\p{AFMoE_digits}`).

Most types split GPT-2 byte-level text. The SPM-style BPE types (gemma4, sarvam-moe) instead replace each space
by "▁", split the text into newline runs and the text between them, and merge raw UTF-8 characters, spelling a
piece that is not a token as `<0xXX>` byte tokens (`byte_encode = false`, `escape_whitespaces = true`).

`onig_pattern` rewrites a llama.cpp regex into an Oniguruma pattern (the engine of HF `tokenizers`)
with the same meaning.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass

__all__ = [
    "PRE_TOKENIZERS",
    "PRE_TYPES",
    "UNSUPPORTED_PRE",
    "PreTokenizer",
    "onig_pattern",
    "resolve_pre",
]

# Contractions spelled without `(?i:)`, as llama.cpp rewrites them for std::regex.
_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"

GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN35 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
JAIS2 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)|\s{8}(?!\S)"
    r"|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}"
)
# llama.cpp's std::regex spelling of "[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
_UPPER_LOWER = r"((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
_UPPER_LOWER2 = r"((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?"
    + _UPPER_LOWER
    + r"|[^\r\n\p{L}\p{N}]?"
    + _UPPER_LOWER2
    + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GPT4O = (
    r"[^\r\n\p{L}\p{N}]?"
    + _UPPER_LOWER
    + _CONTRACTIONS
    + r"?|[^\r\n\p{L}\p{N}]?"
    + _UPPER_LOWER2
    + _CONTRACTIONS
    + r"?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GRANITE_EMB_MULTI = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))*((?=[\p{L}\p{M}])([^A-Z]))+"
    + _CONTRACTIONS
    + r"?|[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))+((?=[\p{L}\p{M}])([^A-Z]))*"
    + _CONTRACTIONS
    + r"?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CASED_WORDS = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    + _CONTRACTIONS
    + r"?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    + _CONTRACTIONS
    + "?"
)
_ASCII_PUNCT_WORD = "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+"
# llama.cpp writes "\r\n" unescaped in some of these C++ literals: the regex sees the characters themselves
DEEPSEEK3 = (
    _ASCII_PUNCT_WORD
    + "|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"
)
AFMOE = _ASCII_PUNCT_WORD + r"|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_NEWLINE_RUNS = r"[^\n]+|[\n]+"
_DIGITS_BY_THREE = r"\d{1,3}(?=(?:\d{3})*\b)"

# type name -> regex list, in llama.cpp order (`llm_tokenizer_bpe::llm_tokenizer_bpe`)
PRE_TYPES: dict[str, tuple[str, ...]] = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
    "llama3": (LLAMA3,),
    "jais2": (JAIS2,),
    "dbrx": (LLAMA3,),
    "smaug": (LLAMA3,),
    "deepseek-llm": (
        "[\r\n]",
        "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
        "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5"
        "\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba"
        "\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45"
        "\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe"
        "\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102"
        "\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
        "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3"
        "\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06"
        "\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
        "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df"
        "\U0001e900-\U0001e943]+",
        r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
        r"\s+$",
        r"[一-龥ࠀ-一가-퟿]+",
        r"\p{N}+",
    ),
    "deepseek-v3": (r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+", DEEPSEEK3),
    "hunyuan-dense": (r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+", DEEPSEEK3),
    "joyai-llm": (r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+", DEEPSEEK3),
    "hy-v4": (r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+", DEEPSEEK3),
    "spark2.5": (
        r"\p{N}{1,3}",
        r"[一-龥぀-ゟ゠-ヿ]+",
        _ASCII_PUNCT_WORD + "|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+|[\r\n]|\\s+(?!\\S)|\\s+",
        r"\p{N}",
    ),
    "youtu": (
        r"[가-힣ㄱ-ㆎ]+|[！…“”‘’—：；，、-〿︰-﹏]+|[ㄅ-ㄯ]+|[一-龥぀-ゟ゠-ヿ]+",
        _CASED_WORDS + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "deepseek-coder": ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}"),
    "falcon": (
        r"[\p{P}\$\+<=>\^~\|`]+",
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
        r"[0-9][0-9][0-9]",
    ),
    **{
        name: (r"\p{N}", GPT2)
        for name in ("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva", "mellum2")
    },
    **{name: (GPT2,) for name in ("gpt2", "mpt", "olmo", "jais", "trillion", "granite-docling")},
    **{name: (QWEN2,) for name in ("stablelm2", "qwen2", "hunyuan", "solar-open", "grok-2")},
    "qwen35": (QWEN35,),
    "gemma4": (_NEWLINE_RUNS,),
    "sarvam-moe": (_NEWLINE_RUNS,),
    **{name: (r" ?[^(\s|.,!?…。，、।۔،)]+",) for name in ("poro", "bloom", "gpt3-finnish")},
    "chatglm4": (LLAMA3,),
    "viking": (r" ?[^(\s|.,!?…。，、।۔،)]+", r"\p{N}"),
    "tekken": (TEKKEN,),
    "chameleon": (
        r"<sentinel:[0-9]+>",
        r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
        r"([\t\n]|    |  )",
        r"\p{N}",
        r"[\p{P}!-/:-@\[-`{-~]",
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    ),
    "gpt-4o": (GPT4O,),
    "minimax-m2": (GPT4O,),
    "granite-emb-multi": (GRANITE_EMB_MULTI,),
    "tiny-aya": (_DIGITS_BY_THREE, _CASED_WORDS + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
    "superbpe": (r"\p{N}+", r"(?=(\d{3})+(?!\d))"),
    "bailingmoe": (
        r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]|\s+(?!\S)|\s+",
    ),
    "seed-coder": (
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "ufakzeka": (r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",),
    "afmoe": (
        r"\p{AFMoE_digits}",
        r"[一-鿿㐀-䶿豈-﫿぀-ゟ゠-ヿ･-ﾟ⼀-⿟เ-๿຀-໿ក-៿က-႟ꩠ-ꩿꧠ-꧿가-힯ᄀ-ᇿ]+",
        AFMOE,
    ),
    "laguna": (_NEWLINE_RUNS, QWEN2),
    "exaone-moe": (
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?"
        r"|\s*[\r\n]|\s+(?!\S)|\s+",
    ),
    "minicpm5": (
        r"\p{N}{1,3}",
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
}


@dataclass(frozen=True)
class PreTokenizer:
    """What one `tokenizer.ggml.pre` name selects (llama.cpp `llama_vocab::impl::load`)."""

    type: str  # key of PRE_TYPES
    clean_spaces: bool = True  # detokenize drops " ?", " !", " '" ... (clean_up_tokenization_spaces)
    ignore_merges: bool = False  # a pre-token found whole in the vocabulary skips the merges
    add_bos: bool = False  # default of tokenizer.ggml.add_bos_token for this vocabulary
    no_bos: bool = False  # the default BOS id (11) is dropped (chatglm)
    force_bos: bool = False  # add_bos even when tokenizer.ggml.add_bos_token says false (gemma4: llama.cpp PR 21500)
    spm_style: bool = False  # " " -> "▁", raw UTF-8 symbols, <0xXX> byte fallback, ▁ pieces rendered as spaces
    whole_newline_runs: bool = False  # a newline run that is a token skips the merges (gemma4: llama.cpp PR 21343)

    @property
    def regexes(self) -> tuple[str, ...]:
        return PRE_TYPES[self.type]


def _pre(type_: str, names: tuple[str, ...] = (), **flags) -> dict[str, PreTokenizer]:
    spec = PreTokenizer(type_, **flags)
    return {name: spec for name in names or (type_,)}


_KEEP = {"clean_spaces": False}
_GPT2_NAMES = (
    "gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum", "modern-bert",
    "jina-v1-en", "jina-v2-code", "roberta-bpe", "exaone4",
)  # fmt: skip

# tokenizer.ggml.pre value -> settings, in the order of llama.cpp's if/else chain
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    **_pre("default"),
    **_pre("minicpm5", ignore_merges=True),
    **_pre(
        "llama3",
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano"),
        ignore_merges=True,
        add_bos=True,
    ),
    **_pre("deepseek-llm", **_KEEP),
    **_pre("deepseek-coder", **_KEEP),
    **_pre("deepseek-v3", **_KEEP),
    **_pre("spark2.5", ("spark2_5",), **_KEEP),
    **_pre("youtu", **_KEEP, ignore_merges=True),
    **_pre("falcon"),
    **_pre("mpt"),
    **_pre("starcoder"),
    **_pre("gpt2", _GPT2_NAMES),
    **_pre("jais2", ("jais-2",)),
    **_pre("gemma4", ("gemma4", "granite-embed-multi-311m"), spm_style=True, whole_newline_runs=True, force_bos=True),
    **_pre("sarvam-moe", **_KEEP, spm_style=True),
    **_pre("refact"),
    **_pre("command-r", **_KEEP),
    **_pre("qwen2", ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2"), **_KEEP),
    **_pre("qwen35", **_KEEP),
    **_pre("stablelm2"),
    **_pre("olmo"),
    **_pre("dbrx"),
    **_pre("smaug", ("smaug-bpe",)),
    **_pre("poro", ("poro-chat",), **_KEEP),
    **_pre("chatglm4", ("chatglm-bpe",), no_bos=True),
    **_pre("chatglm4", ("glm4", "glm5"), no_bos=True, ignore_merges=True),
    **_pre("viking", **_KEEP),
    **_pre("jais"),
    **_pre("tekken", **_KEEP, ignore_merges=True, add_bos=True),
    **_pre("smollm", **_KEEP),
    **_pre("codeshell"),
    **_pre("bloom"),
    **_pre("gpt3-finnish"),
    **_pre("exaone"),
    **_pre("exaone-moe"),
    **_pre("chameleon", add_bos=True, **_KEEP),
    **_pre("minerva", ("minerva-7b",)),
    **_pre("qwen2", ("megrez",)),
    **_pre("gpt-4o", ("gpt-4o", "llama4", "kanana2", "talkie"), **_KEEP),
    **_pre("granite-emb-multi", ("granite-embed-multi-97m",), **_KEEP, ignore_merges=True),
    **_pre("tiny-aya", ("tiny_aya", "cohere2moe"), **_KEEP),
    **_pre("superbpe", **_KEEP),
    **_pre("trillion", **_KEEP),
    **_pre("granite-docling", **_KEEP),
    **_pre("bailingmoe", ("bailingmoe", "bailingmoe2", "llada-moe"), **_KEEP),
    **_pre("seed-coder", **_KEEP),
    **_pre("hunyuan", **_KEEP),
    **_pre("hunyuan-dense", **_KEEP),
    **_pre("hy-v4", ("hy_v4",), **_KEEP),
    **_pre("joyai-llm", **_KEEP),
    **_pre("ufakzeka", **_KEEP),
    **_pre("grok-2", **_KEEP),
    **_pre("afmoe", **_KEEP),
    **_pre("laguna", **_KEEP),
    **_pre("minimax-m2", **_KEEP),
    **_pre("solar-open", **_KEEP),
    **_pre("mellum2"),
}

# Names llama.cpp knows but that need more than regex splits (hand-written splitters, other models).
UNSUPPORTED_PRE: dict[str, str] = {
    "kimi-k2": "a hand-written splitter without merges (unicode.cpp unicode_regex_split_custom_kimi_k2)",
    "whitespace": "a whitespace splitter without byte-level encoding",
}

# llama.cpp hand-written splitters that a regex can stand in for. The AFMoE digit splitter keeps the text
# before a digit run glued to its first group ("ab1234" -> "ab1" "234"); the pattern below does the same.
_CUSTOM_SPLITTERS = {
    r"\p{AFMoE_digits}": r"[^\p{N}]*\p{N}{1,3}(?=(?:\p{N}{3})*(?!\p{N}))",
    _DIGITS_BY_THREE: r"[^\p{N}]*\p{N}{1,3}(?=(?:\p{N}{3})*(?!\p{N}))",
    # zero-width splits before every group of three ASCII digits counted from the right
    r"(?=(\d{3})+(?!\d))": r"[0-9]{1,3}(?=(?:[0-9]{3})*(?![0-9]))",
}

_LETTER_CLASSES = re.compile(r"\\p\{L[ultmo]\}")


def onig_pattern(regex: str) -> str:
    """The Oniguruma pattern that splits like llama.cpp's `regex` does (see the module docstring)."""
    regex = _CUSTOM_SPLITTERS.get(regex, regex)
    regex = _LETTER_CLASSES.sub(r"\\p{L}", regex)
    if regex.endswith("$") and not regex.endswith("\\$"):
        regex = regex[:-1] + r"\z"
    return regex


def resolve_pre(pre: str | None) -> PreTokenizer:
    """Settings for a `tokenizer.ggml.pre` value; an unknown or unsupported one falls back to "default"."""
    if not pre:
        warnings.warn(
            "tokenizer.ggml.pre is missing: using the 'default' pre-tokenizer as llama.cpp does "
            "(generation quality may be degraded)",
            stacklevel=3,
        )
        return PRE_TOKENIZERS["default"]
    spec = PRE_TOKENIZERS.get(pre)
    if spec is not None:
        return spec
    why = UNSUPPORTED_PRE.get(pre, "not a name llama.cpp's llama-vocab.cpp knows")
    warnings.warn(
        f"tokenizer.ggml.pre = {pre!r} is not supported ({why}): falling back to the 'default' pre-tokenizer, "
        f"token ids may differ from llama.cpp. Supported: {', '.join(sorted(PRE_TOKENIZERS))}",
        stacklevel=3,
    )
    return PRE_TOKENIZERS["default"]
