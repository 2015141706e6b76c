"""Chat templates: render a conversation to a prompt string with the model's Jinja template.

The template comes from the GGUF metadata key ``tokenizer.chat_template``. Rendering reproduces Hugging Face
transformers' ``apply_chat_template(tokenize=False)`` (transformers 5.x, ``utils/chat_template_utils.py``:
``_compile_jinja_template``, ``render_jinja_template``, ``_normalize_chat_messages``): the same sandboxed Jinja
environment, filter and globals, the same clean-up of the inputs and the same template variables, so a prompt
rendered here is byte-for-byte the one transformers renders (``tests/test_chat.py`` checks this).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import warnings
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.exceptions import SecurityError, TemplateError

from .chat_bounds import DEFAULT_LIMITS, BoundedEnvironment, ChatTemplateError, RenderLimits, bounded_render
from .chat_encode import REASONING_FIELDS, encode_chat

__all__ = [
    "CHATML_TEMPLATE",
    "PLAIN_TEMPLATE",
    "ChatTemplate",
    "ChatTemplateError",
    "RenderLimits",
    "encode_chat",
    "render_chat",
]

Message = Mapping[str, Any]


# --- the Jinja environment ---------------------------------------------------------------------------


def _raise_exception(message: str) -> None:
    """Template global used by chat templates to reject a conversation (e.g. roles out of order)."""
    raise TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    """``tojson`` filter: plain ``json.dumps``.

    Jinja's built-in ``tojson`` HTML-escapes ``<>&'`` and sorts keys, which would change tool schemas in the
    prompt; transformers overrides it with this, so we do too.
    """
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    """Template global giving today's date (Llama 3 style templates print it in the system prompt)."""
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """The ``dict`` global: builds plain dicts without exposing the ``dict`` type itself to the template."""

    def __call__(self, *args, **kwargs) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """Jinja's ``namespace`` refusing underscore-prefixed attributes (a route to CPython internals)."""

    def __init__(*args, **kwargs):  # same signature trick as Jinja's Namespace, so namespace(self=...) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"chat templates cannot set underscore-prefixed namespace attributes, got {name!r}")


class _GenerationTag(jinja2.ext.Extension):
    """Accepts ``{% generation %}...{% endgeneration %}`` and renders its body unchanged.

    transformers uses the tag to build an assistant-token mask for training; for rendering only the body
    matters, but templates that contain the tag must still parse.
    """

    tags = frozenset({"generation"})

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller) -> str:
        return caller()


@functools.lru_cache(maxsize=32)
def compile_template(template: str) -> jinja2.Template:
    """Compile a chat template in transformers' environment (cached: templates are long and reused).

    Sandboxed and immutable (a template cannot mutate the messages), ``trim_blocks`` and ``lstrip_blocks`` on,
    ``loopcontrols`` (``break``/``continue``) and the ``generation`` tag enabled; globals ``raise_exception``,
    ``strftime_now``, ``dict`` and a hardened ``namespace``; the ``tojson`` override. Beyond transformers,
    rendering is bounded in work, value sizes and output (`ggufpy.chat_bounds`).
    """
    env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.finish_setup()
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(template)


# --- the template inputs -----------------------------------------------------------------------------


def plain_data(value: Any) -> Any:
    """Rebuild ``value`` out of plain JSON-like types before a template sees it.

    Subclasses of str/int/float (enums, NumPy scalars) lose their extra methods, dataclasses and pydantic
    models become dicts, and anything else becomes an inert ``"<TypeName>"`` placeholder: templates are
    untrusted code and must not reach methods the sandbox does not know are dangerous.
    """
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain_data(k): plain_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_data(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain_data(v) for v in value)
    if hasattr(value, "dtype") and hasattr(value, "item") and getattr(value, "shape", None) == ():
        return plain_data(value.item())  # a NumPy scalar: np.bool_(False) must stay falsy
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return plain_data(value.model_dump())
    return f"<{type(value).__name__}>"


def normalize_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Messages as the template sees them.

    Keys whose value is ``None`` are dropped (OpenAI-style ``content=None`` / ``tool_calls=None`` would
    otherwise render as "None" in many templates, which handle a missing key), and a message's reasoning is
    copied to both ``reasoning_content`` and ``thinking`` whichever name it came under.
    """
    out = []
    for i, message in enumerate(messages):
        message = plain_data(message)
        if not isinstance(message, dict):
            raise TypeError(f"chat message {i} must be a mapping with 'role' and 'content', got {message!r}")
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def render_chat(
    template: str,
    messages: Sequence[Message],
    *,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    tools: Sequence[Mapping[str, Any]] | None = None,
    limits: RenderLimits = DEFAULT_LIMITS,
    **extra: Any,
) -> str:
    """Render ``messages`` (``[{"role": ..., "content": ...}, ...]``) with a Jinja chat template.

    ``add_generation_prompt`` appends the header that starts the assistant's reply (transformers defaults it
    to False; a generator nearly always wants it). ``tools`` are JSON schemas
    (``{"type": "function", "function": {...}}``); ``extra`` keyword arguments become template variables
    (e.g. ``enable_thinking=False``, ``documents=[...]``). As in transformers, ``tools`` and ``documents`` are
    defined (as ``None``) even when not given. Errors raised by the template (``raise_exception``) come out as
    `jinja2.exceptions.TemplateError`; a template that exceeds ``limits`` raises `ChatTemplateError`.
    """
    if tools is not None:
        bad = [t for t in tools if not isinstance(t, Mapping)]
        if bad:
            raise TypeError(f"tools must be JSON-schema dicts, got {type(bad[0]).__name__}")
    variables = plain_data({"bos_token": bos_token, "eos_token": eos_token, "documents": None, **extra})
    variables.update(
        messages=normalize_messages(messages),
        tools=plain_data(None if tools is None else list(tools)),
        add_generation_prompt=add_generation_prompt,
    )
    return bounded_render(compile_template(template), variables, limits)


# llama.cpp's fallback format (`LLM_CHAT_TEMPLATE_CHATML` in src/llama-chat.cpp)
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class ChatTemplate:
    """A chat template bound to its model's BOS/EOS token strings.

    Build it from GGUF metadata: ``ChatTemplate(meta["tokenizer.chat_template"], bos_token=..., eos_token=...)``
    where the token strings are the vocabulary entries of ``tokenizer.ggml.bos_token_id`` / ``eos_token_id``.
    ``name`` says where the template came from (``"tokenizer.chat_template"``, a built-in's name, ``"chatml"``)
    and ``note`` is a one-line explanation when it is not the file's own, for a user interface to show;
    ``stop`` the stop strings a reply in this format needs (plain-text formats have no end-of-turn token).
    """

    def __init__(
        self,
        template: str,
        bos_token: str = "",
        eos_token: str = "",
        name: str = "",
        note: str | None = None,
        stop: Sequence[str] = (),
    ):
        if not isinstance(template, str) or not template:
            raise ValueError("chat template must be a non-empty string (GGUF key tokenizer.chat_template)")
        self.template = template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.name = name
        self.note = note
        self.stop = tuple(stop)  # strings that end a reply, for formats without an end-of-turn token
        compile_template(template)  # a malformed template fails here, not at first use

    @classmethod
    def from_tokenizer(cls, tokenizer, metadata: Mapping[str, Any] | None = None, warn: bool = True) -> ChatTemplate:
        """The template of a GGUF tokenizer (`tokenizer.chat_template`), with its BOS/EOS strings.

        A file without one is, most often, a base model: when its ``metadata`` names no instruction tuning it
        gets `PLAIN_TEMPLATE` (a base model never learnt turn tokens: the packaged Gemma 3 270M loops on them and
        answers in plain text). Otherwise the built-in template `ggufpy.templates.detect` finds (architecture,
        special tokens, name; without ``metadata`` the vocabulary alone), and ChatML when none fits, as
        llama.cpp's `common_chat_templates_init` falls back. ``note`` says which; ``warn`` also warns.
        """
        template, name, note, stop = tokenizer.chat_template, "tokenizer.chat_template", None, ()
        if not template:
            builtin = _detect_builtin(tokenizer, metadata)
            if metadata is not None and _names_no_tuning(metadata):
                template, name, stop = PLAIN_TEMPLATE, "plain", PLAIN_STOP
                note = (
                    f"the file has no chat template and general.name {metadata.get('general.name', '')!r} names no "
                    "instruction tuning: a base model, so a plain 'User: / Assistant:' prompt is used"
                    + (f" (--chat-template {builtin.name} for its family's turns)" if builtin else "")
                )
            elif builtin is not None:
                template, name = builtin.source, builtin.name
                note = f"the file has no chat template; using the built-in {builtin.name!r} template ({builtin.reason})"
            else:
                template, name = CHATML_TEMPLATE, "chatml"
                note = "the file has no chat template and no built-in one fits it; using ChatML (llama.cpp's fallback)"
            if warn:
                warnings.warn(note, stacklevel=2)
        return cls(template, *_bos_eos(tokenizer), name=name, note=note, stop=stop)

    @classmethod
    def by_name(cls, name: str, tokenizer) -> ChatTemplate:
        """A built-in template by name: ``plain``, ``chatml`` or one of `ggufpy.templates.TEMPLATES`."""
        if name == "plain":
            return cls(PLAIN_TEMPLATE, *_bos_eos(tokenizer), name=name, stop=PLAIN_STOP)
        if name == "chatml":
            return cls(CHATML_TEMPLATE, *_bos_eos(tokenizer), name=name)
        from .templates import by_name

        return cls(by_name(name).source, *_bos_eos(tokenizer), name=name)

    def render(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render ``messages`` to the prompt string; see `render_chat` for the arguments."""
        return render_chat(
            self.template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            tools=tools,
            **kwargs,
        )

    def __repr__(self) -> str:
        return f"ChatTemplate({len(self.template)} chars, bos_token={self.bos_token!r}, eos_token={self.eos_token!r})"


# A base model's chat: plain text it has seen in pretraining, ended by stop strings (it has no end-of-turn token).
PLAIN_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' %}{{ message['content'] | trim + '\\n\\n' }}"
    "{% else %}{{ ('User: ' if message['role'] == 'user' else 'Assistant: ') + message['content'] | trim + '\\n' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
PLAIN_STOP = ("\nUser:", "\nAssistant:")
# general.name / general.finetune words that mean instruction (or chat) tuning
_TUNED = re.compile(r"\b(it|instruct|chat|sft|dpo|rlhf|assistant)\b|-it\b|instruct", re.IGNORECASE)


def _names_no_tuning(metadata: Mapping[str, Any]) -> bool:
    """Whether the file's name and fine-tune fields say nothing of instruction tuning (a base model)."""
    words = " ".join(str(metadata.get(k, "")) for k in ("general.name", "general.finetune", "general.basename"))
    return not _TUNED.search(words)


def _bos_eos(tokenizer) -> tuple[str, str]:
    return tuple("" if i is None else tokenizer.piece(i) for i in (tokenizer.bos_id, tokenizer.eos_id))


def _detect_builtin(tokenizer, metadata: Mapping[str, Any] | None):
    """`ggufpy.templates.detect` on the file's metadata (or what the tokenizer knows), None if unavailable."""
    try:
        from .templates import detect
    except ImportError:
        return None
    return detect(metadata if metadata is not None else {"tokenizer.ggml.tokens": tokenizer.vocab.tokens})
