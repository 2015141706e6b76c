"""Record llama.cpp's tokenizations of the test corpus: the goldens of tests/test_tokenizer.py.

    python scripts/record_tokenizer_goldens.py            # corpus + goldens for both models + variants
    python scripts/record_tokenizer_goldens.py --corpus   # only rewrite tests/data/tokenizer/corpus.json

Needs llama-cpp-python (the oracle) and the two model packages (see tests/models.py). Writes, under
tests/data/tokenizer/:

- corpus.json: the test strings (built by `build_corpus`, deterministic);
- <model>.json for smollm2 (gpt2 / "smollm") and gemma3 (llama / SPM, 262k tokens): for every string the ids
  of `Llama.tokenize(text, add_bos=add_special, special=parse_special)` for the four combinations, and
  `llama_detokenize` of the add+parse ids (control tokens rendered, and skipped with remove_special);
  plus the vocabulary facts llama.cpp derives (special ids, EOG set, attributes, piece digests);
- variants.json: the same vocabularies rewritten with other settings (every `tokenizer.ggml.pre` setting on the
  SmolLM2 vocabulary, add_space_prefix / add_eos / add_bos on Gemma's), kept small as sha256 digests, one per
  group of GROUP strings, of the ids (add_special and parse_special both off, both on) and of the detokenized
  add+parse ids.

In <model>.json a case's four id lists are in COMBOS order; a list equal to an earlier one is stored as its index.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "tokenizer"
sys.path.insert(0, str(ROOT))

COMBOS = [(False, False), (False, True), (True, False), (True, True)]  # (add_special, parse_special)


# -- corpus ------------------------------------------------------------------------------------------------

PROSE = [
    "Hello world",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "THE QUICK BROWN FOX JUMPS OVER THE LAZY DOG",
    "It was the best of times, it was the worst of times.",
    "Once upon a time, there was a little girl named Lily.",
    "What is the capital of France? The capital of France is Paris.",
    "I can't believe it's not butter!",
    "She said: \"Don't go there.\" He replied, 'Why not?'",
    "Mr. Smith went to Washington D.C. on Jan. 5th, 2021.",
    "e.g. i.e. etc. vs. a.k.a.",
    "Hello , world . How are you ? Fine !",
    "a ' b",
    "rock 'n' roll",
    "tokenization, detokenization; and (parentheses) [brackets] {braces}",
    "Email me at someone@example.com or visit https://example.org/path?q=1&r=2#frag",
    "C:\\Users\\name\\Documents\\file.txt",
    "/usr/local/bin/python3 -m pip install --upgrade pip",
    "user_name_with_underscores and camelCaseIdentifier and PascalCase and SCREAMING_SNAKE",
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor incididunt ut labore.",
    "A sentence with a trailing space ",
    " A sentence with a leading space",
    "multiple   spaces   between   words",
    "ALLCAPS lowercase MiXeD cAsE",
    "hyphen-ated words and em—dashes and en–dashes",
    "...and then... nothing?!",
    "!!!???...,,,;;;:::",
    "#hashtag @mention $dollar %percent ^caret &ampersand *star",
    "~tilde `backtick` |pipe| \\backslash/ <angle> =equals+ plus-",
    "Why? Because! Yes. No, maybe.",
]

CONTRACTIONS = [
    "don't",
    "DON'T",
    "Don'T",
    "it's",
    "IT'S",
    "I'm you're we've they'll he'd",
    "I'M YOU'RE WE'VE THEY'LL HE'D",
    "y'all",
    "'s",
    "' s",
    "''",
    "'''",
    "the dog 's bone",
    "the dog 're there",
]

WHITESPACE = [
    "",
    " ",
    "  ",
    "   ",
    "    ",
    "        ",
    " " * 33,
    "\t",
    "\t\t",
    "\n",
    "\n\n",
    "\n\n\n",
    "\r",
    "\r\n",
    "\r\n\r\n",
    " \n",
    "\n ",
    " \n ",
    "\t\n",
    "a\tb",
    "a\t\tb",
    "a \tb",
    "a\t b",
    "a  b",
    "a   b",
    "a\nb",
    "a\n\nb",
    "a \nb",
    "a\n b",
    "a \n b",
    "a\r\nb",
    " a",
    "  a",
    "   a",
    "a ",
    "a  ",
    "a   ",
    "  a  ",
    "\ta\t",
    "\na\n",
    "word\n\n\n\nword",
    "line one\nline two\nline three",
    "  indented\n    more indented\n\tand tabbed",
    "trailing newline\n",
    "\u00a0nbsp\u00a0between\u00a0",
    "ideographic\u3000space",
    "thin\u2009space and\u200bzero width",
    "next\u0085line",
    "line\u2028separator\u2029paragraph",
    "\x0bvertical\x0ctab and form feed",
]

NUMBERS = [
    "0",
    "1",
    "12",
    "123",
    "1234",
    "12345",
    "123456",
    "1234567",
    "12345678901234567890",
    "3.14159265358979",
    "1,000,000",
    "-42",
    "+7",
    "1e10 2.5E-3",
    "0x1F 0b1010 0o17",
    "2024-01-15T10:30:00Z",
    "(555) 123-4567",
    "$1,234.56 and €99,99 and ¥1000",
    "100%",
    "v1.2.3-rc.4",
    "a1b2c3",
    "abc123def456",
    "1st 2nd 3rd 4th",
    "٠١٢٣٤٥٦٧٨٩",
    "०१२३",
    "①②③ Ⅻ ½ ¾ ²³",
    "１２３",
]

CODE = [
    'def hello(name):\n    print(f"Hello, {name}!")\n    return None\n',
    "for i in range(10):\n\tif i % 2 == 0:\n\t\tcontinue\n",
    "class Foo(Bar):\n    def __init__(self, *args, **kwargs):\n        super().__init__(*args, **kwargs)",
    "import numpy as np\nx = np.zeros((3, 4), dtype=np.float32)  # comment",
    "lambda x: x**2 if x >= 0 else -x",
    '#include <stdio.h>\n\nint main(int argc, char **argv) {\n    printf("%d\\n", argc);\n    return 0;\n}\n',
    "for (int i = 0; i < n; ++i) { a[i] += b[i] * c; }",
    'std::vector<std::string> v{"a", "b"};',
    "x->y = &z; *p++ = q--; a <<= 2; b >>= 1; c != d && e || !f;",
    "/* block comment */ // line comment",
    '{"name": "ggufpy", "version": "0.1.0", "tags": ["gguf", "numpy"], "ok": true, "n": null}',
    '[1, 2, 3, {"a": {"b": [4.5, -6e7]}}]',
    '{\n  "key": "value",\n  "nested": {\n    "list": [1, 2]\n  }\n}',
    "<html><head><title>Test</title></head><body><h1>Title</h1><p>Para</p></body></html>",
    "<table><tr><td>1</td></tr></table>",
    "SELECT id, name FROM users WHERE age > 21 ORDER BY name DESC;",
    "$ ls -la | grep '^d' && echo \"done\" > /dev/null 2>&1",
    'if [[ -z "$VAR" ]]; then exit 1; fi',
    "const f = async (x) => { await g(x); return x ?? 0; };",
    'fn main() -> Result<(), Box<dyn Error>> { println!("{:?}", v); Ok(()) }',
    "regex: ^[a-zA-Z0-9_.+-]+@[a-zA-Z0-9-]+\\.[a-zA-Z0-9-.]+$",
    "# Heading\n\n* item 1\n* item 2\n\n```python\nprint(1)\n```\n",
    "| col1 | col2 |\n|------|------|\n| a    | b    |",
    "key1=value1;key2=value2",
    "    four spaces indent",
    "\t\ttwo tabs indent",
    "x=1;y=2;z=x+y",
    "____init____",
    "====----++++****",
]

ACCENTS = [
    "café",
    "naïve résumé",
    "Ångström",
    "e\u0301 (decomposed é)",
    "straße Größe",
    "Tiếng Việt có dấu",
    "Zażółć gęślą jaźń",
    "İstanbul ıi",
    "Ærøskøbing",
    "São Paulo, Señor, Niño",
    "Crème brûlée à la française",
    "Ελληνικά γράμματα",
    "Русский текст, привет мир!",
    "Українська мова",
    "ǅemal ǈ ǋ",
]

CJK = [
    "你好，世界！",
    "我爱自然语言处理。",
    "今天天气很好，我们去公园吧。",
    "日本語のテキストです。",
    "ひらがな カタカナ 漢字",
    "東京は日本の首都です",
    "한국어 텍스트입니다.",
    "안녕하세요 세계",
    "Mixed English and 中文 text",
    "ＡＢＣ　ｆｕｌｌｗｉｄｔｈ",
    "「引用」と『二重引用』",
    "中文123数字",
    "𠀀𠀁 rare CJK extension B",
    "ｶﾀｶﾅ half-width",
    "漢",
]

OTHER_SCRIPTS = [
    "مرحبا بالعالم",
    "اللغة العربية جميلة.",
    "שלום עולם",
    "नमस्ते दुनिया",
    "हिन्दी में पाठ",
    "สวัสดีชาวโลก",
    "ভাষা বাংলা",
    "தமிழ் மொழி",
    "ქართული ენა",
    "Հայերեն",
    "አማርኛ",
    "Mixed: Hello مرحبا 你好 שלום",
    "ܐܒܓ syriac",
    "ᚠᚢᚦ runes",
    "∀x∈ℝ: x² ≥ 0 ∧ ∑ᵢ aᵢ ≠ ∞",
]

EMOJI = [
    "😀",
    "Hello 😀 world",
    "👍🏽",
    "👨‍👩‍👧‍👦",
    "👩‍💻 coding",
    "🏳️‍🌈",
    "🇫🇷🇯🇵🇺🇸",
    "1️⃣ 2️⃣ #️⃣",
    "❤️ ♥ ❤",
    "🎉🎉🎉",
    "emoji:🔥fire",
    "☃ ★ ☆ ✓ ✗",
    "🤖🧠💡",
    "😀😃😄😁😆😅🤣😂",
    "ok👌",
]

SPECIAL_STRINGS = [
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>",
    "<|im_start|><|im_end|>",
    "<|im_start|> <|im_end|>",
    "text<|endoftext|>more text",
    "<|im_start",
    "im_start|>",
    "<|im_start|im_end|>",
    "<repo_name>repo<file_sep>file.py",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    "<start_of_turn>model\nIt is 4.<end_of_turn>",
    "<bos>",
    "<eos>",
    "<bos>Hello<eos>",
    "<bos><bos>",
    "<pad><pad>",
    "<unk>",
    "<mask>",
    "<s>",
    "</s>",
    "<s>[INST] hi [/INST]</s>",
    "[multimodal]",
    "<start_of_image>",
    "<end_of_image>",
    "<unused0>",
    "<unused99>",
    "abc<eos>def",
    " <eos> ",
    "<end_of_turn",
    "end_of_turn>",
    "<<end_of_turn>>",
    "<h1>Heading</h1>",
    "<strong>bold</strong> and <code>code</code>",
    "<0x41>",
    "<|eot_id|>",
    "<|begin_of_text|>",
]

SINGLES = [chr(c) for c in range(0x21, 0x7F)] + [
    "\x00",
    "\x01",
    "\x1b",
    "\x1c",
    "\x1f",
    "\x7f",
    "é",
    "ß",
    "€",
    "漢",
    "😀",
    "▁",
    "Ġ",
    "\ufffd",
    "\ufeff",
]

CONTROL = [
    "\x1b[31mred\x1b[0m",
    "null\x00byte",
    "bell\x07char",
    "del\x7fchar",
    "sep\x1c\x1d\x1e\x1fchars",
    "BOM\ufefftext",
    "replacement \ufffd char",
    "private use \ue000\uf8ff",
    "▁already▁escaped▁",
    "ĠGPT2ĠcharsĊ",
]

LONG = [
    " ".join(PROSE),
    "\n".join(CODE[:6]),
    "word " * 200,
    "a" * 300,
    "🙂" * 40,
    "1234567890" * 20,
    "\n" * 40,
    " " * 100 + "x",
    ("Hello world! " * 30).strip(),
    "".join(CJK) + "".join(OTHER_SCRIPTS),
]


def build_corpus() -> list[str]:
    """The test strings: hand-written groups, then programmatic variants of the short ones. Deterministic."""
    base = [
        *PROSE, *CONTRACTIONS, *WHITESPACE, *NUMBERS, *CODE, *ACCENTS, *CJK, *OTHER_SCRIPTS, *EMOJI,
        *SPECIAL_STRINGS, *SINGLES, *CONTROL, *LONG,
    ]  # fmt: skip
    variants = []
    for group in (PROSE[:12], CONTRACTIONS[:6], NUMBERS[:10], ACCENTS[:6], CJK[:6], EMOJI[:6], SPECIAL_STRINGS[:20]):
        for s in group:
            variants += [" " + s, s + " ", "\n" + s, s + "\n", "  " + s + "  "]
    for s in PROSE[:10]:
        variants += [s.upper(), s.lower(), s.replace(" ", "\t"), s.replace(" ", "  ")]
    out, seen = [], set()
    for s in [*base, *variants]:
        if s not in seen:
            seen.add(s)
            out.append(s)
    return out


def write_corpus() -> list[str]:
    corpus = build_corpus()
    DATA.mkdir(parents=True, exist_ok=True)
    (DATA / "corpus.json").write_text(json.dumps(corpus, ensure_ascii=False, indent=0) + "\n", encoding="utf-8")
    return corpus


# -- llama.cpp ---------------------------------------------------------------------------------------------


def text_or_hex(b: bytes) -> str | dict[str, str]:
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return {"hex": b.hex()}


GROUP = 25  # variants.json keeps one digest per group of this many corpus strings


def digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()).hexdigest()[:12]


def group_digests(values: list) -> list[str]:
    return [digest(values[i : i + GROUP]) for i in range(0, len(values), GROUP)]


def compact(ids: list[list[int]]) -> list:
    """The four id lists of a case, a repeat of an earlier one written as that one's index."""
    return [next((j for j in range(k) if ids[j] == x), x) for k, x in enumerate(ids)]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


class Oracle:
    """llama.cpp through llama-cpp-python, vocabulary only."""

    def __init__(self, path: Path):
        import llama_cpp

        self.lib = llama_cpp
        self.llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
        self.vocab = self.llm._model.vocab

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        return self.llm.tokenize(text.encode(), add_bos=add_special, special=parse_special)

    def detokenize(self, ids: list[int], remove_special: bool, unparse_special: bool) -> bytes:
        lib = self.lib
        arr = (lib.llama_token * max(1, len(ids)))(*ids)
        size = 256
        while True:
            buf = __import__("ctypes").create_string_buffer(size)
            n = lib.llama_detokenize(self.vocab, arr, len(ids), buf, size, remove_special, unparse_special)
            if n >= 0:
                return buf.raw[:n]
            size = -n + 1

    def piece(self, token_id: int, special: bool) -> bytes:
        import ctypes

        buf = ctypes.create_string_buffer(256)
        n = self.lib.llama_token_to_piece(self.vocab, token_id, buf, 256, 0, special)
        assert 0 <= n <= 256, n
        return buf.raw[:n]

    def facts(self) -> dict:
        lib, v = self.lib, self.vocab
        n = lib.llama_vocab_n_tokens(v)
        names = ["bos", "eos", "eot", "pad", "sep", "nl", "fim_pre", "fim_suf", "fim_mid", "fim_pad", "fim_rep"]
        special = {k: getattr(lib, "llama_vocab_" + k)(v) for k in [*names, "fim_sep"]}
        attrs = [lib.llama_vocab_get_attr(v, i) for i in range(n)]
        return {
            "n_tokens": n,
            "special": {k: (None if x < 0 else x) for k, x in special.items()},
            "add_bos": bool(lib.llama_vocab_get_add_bos(v)),
            "add_eos": bool(lib.llama_vocab_get_add_eos(v)),
            "eog": [i for i in range(n) if lib.llama_vocab_is_eog(v, i)],
            "attrs_sha256": hashlib.sha256(json.dumps(attrs).encode()).hexdigest(),
            "attr_counts": {str(a): attrs.count(a) for a in sorted(set(attrs))},
            "pieces_sha256": {
                "special": hashlib.sha256(b"\0".join(self.piece(i, True) for i in range(n))).hexdigest(),
                "plain": hashlib.sha256(b"\0".join(self.piece(i, False) for i in range(n))).hexdigest(),
            },
        }


def record_model(name: str, path: Path, corpus: list[str]) -> dict:
    import llama_cpp

    oracle = Oracle(path)
    cases = []
    for text in corpus:
        ids = [oracle.tokenize(text, a, p) for a, p in COMBOS]
        full = ids[3]
        cases.append(
            {
                "ids": compact(ids),
                "detok": text_or_hex(oracle.detokenize(full, False, True)),
                "detok_skip": text_or_hex(oracle.detokenize(full, True, False)),
            }
        )
    return {
        "model": name,
        "file": path.name,
        "sha256": sha256_file(path),
        "llama_cpp_version": llama_cpp.__version__,
        "corpus_sha256": digest(corpus),
        "vocab": oracle.facts(),
        "cases": cases,
    }


# -- variants: the same vocabularies with other settings -----------------------------------------------------


def read_fields(path: Path) -> dict:
    """All metadata of a GGUF file with its exact types (gguf-py), for rewriting it without tensors."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    return {name: (f.types, f.contents()) for name, f in reader.fields.items() if not name.startswith("GGUF.")}


def write_vocab_only(path: Path, fields: dict, overrides: dict, drop: tuple[str, ...] = ()) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch=fields["general.architecture"][1])
    for name, (types, value) in fields.items():
        if name == "general.architecture" or name in drop:
            continue
        value = overrides.get(name, value)
        sub = types[-1] if types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, types[0], sub_type=sub)
    for name, value in overrides.items():
        if name not in fields:
            vtype = gguf.GGUFValueType.BOOL if isinstance(value, bool) else gguf.GGUFValueType.STRING
            writer.add_key_value(name, value, vtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def variant_settings() -> dict[str, dict]:
    """One SmolLM2 variant per distinct `tokenizer.ggml.pre` setting llama.cpp accepts, and Gemma variants."""
    from ggufpy.tokenizer.pretokenizers import PRE_TOKENIZERS

    out: dict[str, dict] = {}
    seen = set()
    for pre, spec in PRE_TOKENIZERS.items():
        if spec in seen or spec.spm_style:  # SPM-style (gemma4): tests/data/tokenizer/families.json
            continue
        seen.add(spec)
        # add_bos_token dropped so the per-name default is what gets tested
        out[f"smollm2/pre={pre}"] = {"base": "smollm2", "overrides": {"tokenizer.ggml.pre": pre},
                                     "drop": ["tokenizer.ggml.add_bos_token"]}  # fmt: skip
    out["smollm2/add_eos+add_space_prefix"] = {
        "base": "smollm2",
        "overrides": {"tokenizer.ggml.add_eos_token": True, "tokenizer.ggml.add_space_prefix": True},
    }
    out["gemma3/add_space_prefix"] = {"base": "gemma3", "overrides": {"tokenizer.ggml.add_space_prefix": True}}
    out["gemma3/add_eos-no_bos"] = {
        "base": "gemma3",
        "overrides": {"tokenizer.ggml.add_eos_token": True, "tokenizer.ggml.add_bos_token": False},
    }
    return out


def record_variants(paths: dict[str, Path], corpus: list[str]) -> dict:
    fields = {name: read_fields(path) for name, path in paths.items()}
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, setting in variant_settings().items():
            path = Path(tmp) / "variant.gguf"
            write_vocab_only(path, fields[setting["base"]], setting["overrides"], tuple(setting.get("drop", ())))
            oracle = Oracle(path)
            ids = [[oracle.tokenize(t, a, p) for t in corpus] for a, p in ((False, False), (True, True))]
            detok = [text_or_hex(oracle.detokenize(x, False, True)) for x in ids[1]]
            out[label] = {
                **setting,
                "add_bos": bool(oracle.lib.llama_vocab_get_add_bos(oracle.vocab)),
                "ids_plain": group_digests(ids[0]),
                "ids_special": group_digests(ids[1]),
                "detok": group_digests(detok),
            }
            del oracle
            print(f"  {label}", flush=True)
    return out


def dump_lines(obj: dict, key: str) -> str:
    """JSON with one entry of obj[key] per line, so that a re-recording diffs line by line."""

    def one(x) -> str:
        return json.dumps(x, ensure_ascii=False, separators=(",", ":"))

    head = one({k: v for k, v in obj.items() if k != key})
    items = obj[key]
    if isinstance(items, dict):
        body = ",\n".join(f"{one(k)}:{one(v)}" for k, v in items.items())
        inner = "{\n" + body + "\n}"
    else:
        inner = "[\n" + ",\n".join(one(x) for x in items) + "\n]"
    sep = "," if head != "{}" else ""
    return head[:-1] + f'{sep}"{key}":' + inner + "}\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", action="store_true", help="only write corpus.json")
    parser.add_argument("--no-variants", action="store_true", help="skip variants.json")
    args = parser.parse_args()
    corpus = write_corpus()
    print(f"corpus: {len(corpus)} strings")
    if args.corpus:
        return
    from tests.models import gemma3_path, smollm2_path

    paths = {"smollm2": Path(smollm2_path()), "gemma3": Path(gemma3_path())}
    for name, path in paths.items():
        golden = record_model(name, path, corpus)
        (DATA / f"{name}.json").write_text(dump_lines(golden, "cases"), encoding="utf-8")
        print(f"{name}: {len(golden['cases'])} cases")
    if not args.no_variants:
        variants = record_variants(paths, corpus)
        (DATA / "variants.json").write_text(dump_lines({"variants": variants}, "variants"), encoding="utf-8")
        print(f"variants: {len(variants)}")


if __name__ == "__main__":
    main()
