"""Resource bounds for chat templates: an untrusted template gets a budget of work, value sizes and output.

A chat template is code from the GGUF file. Jinja's sandbox stops it reaching Python internals, but not from
looping ``range(99999)`` inside ``range(99999)`` or building ``[1] * 10**9``. Rendering here is bounded by
`RenderLimits`, counted per render (a `contextvars` budget, so concurrent renders do not share it):

- operations: every loop iteration, function or method call, filter and intercepted operator costs one;
- value size: no string, list or mapping a template builds may exceed ``value_size`` (characters or items).
  Operations that could allocate more (``*``, ``+``, ``%``, ``**``, ``~``, ``join``, ``replace``, widths in
  ``center``/``format``...) are checked *before* they run, so the memory is never taken;
- output: the rendered text stops at ``output_size`` characters.

Exceeding one raises `ChatTemplateError` naming the limit. The defaults are far above what real templates use
(a 100-turn conversation with tools costs ~10^4 operations and ~10^5 characters) and small enough that the
worst case takes about a second and tens of MB.
"""

from __future__ import annotations

import contextvars
import functools
import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import jinja2.nodes as nodes
from jinja2.exceptions import TemplateError
from jinja2.runtime import Macro
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range
from jinja2.utils import generate_lorem_ipsum
from jinja2.visitor import NodeTransformer


class ChatTemplateError(TemplateError, ValueError):
    """A chat template cannot be rendered safely: a resource bound was exceeded, or the prompt cannot be split
    into template text and message content. A `jinja2.TemplateError` (like the template's own errors) and a
    `ValueError`."""


@dataclass(frozen=True)
class RenderLimits:
    """What one render may cost. ``operations``: loop iterations + calls + filters + operators;
    ``value_size``: characters of a string / items of a list any step may produce; ``output_size``:
    characters of the rendered prompt; ``int_bits``: size of an integer ``**`` may produce."""

    operations: int = 1_000_000
    value_size: int = 4 << 20
    output_size: int = 4 << 20
    int_bits: int = 4096


DEFAULT_LIMITS = RenderLimits()
MACRO_COST = 50  # operations one macro call costs


class Budget:
    """The operations left in one render."""

    def __init__(self, limits: RenderLimits):
        self.limits = limits
        self.left = limits.operations

    def charge(self, n: int = 1) -> None:
        self.left -= n
        if self.left < 0:
            raise ChatTemplateError(
                f"the chat template exceeded its budget of {self.limits.operations} operations "
                "(loop iterations, calls, filters): RenderLimits.operations"
            )


_BUDGET: contextvars.ContextVar[Budget | None] = contextvars.ContextVar("ggufpy_chat_budget", default=None)


def _budget() -> Budget:
    """The current render's budget. Outside `bounded_render` (Jinja folding constants at compile time) a
    throwaway one: sizes are still checked, nothing accumulates between calls."""
    return _BUDGET.get() or Budget(DEFAULT_LIMITS)


def bounded_render(template, variables: Mapping[str, Any], limits: RenderLimits = DEFAULT_LIMITS) -> str:
    """Render a template compiled by `BoundedEnvironment` within ``limits`` (a fresh budget per call)."""
    token = _BUDGET.set(Budget(limits))
    try:
        out, size = [], 0
        for chunk in template.generate(**variables):
            size += len(chunk)
            if size > limits.output_size:
                raise ChatTemplateError(
                    f"the chat template's output passed {limits.output_size} characters: RenderLimits.output_size"
                )
            out.append(chunk)
        return "".join(out)
    finally:
        _BUDGET.reset(token)


# --- size checks, made before an operation allocates --------------------------------------------------------


def _too_big(what: str, size: float) -> None:
    limit = _budget().limits.value_size
    if size > limit:
        raise ChatTemplateError(
            f"the chat template would build {what} of {int(size)} elements, over the limit of {limit}: "
            "RenderLimits.value_size"
        )


def _size(x: Any) -> int:
    return len(x) if isinstance(x, (str, bytes, list, tuple, dict, set, frozenset, range)) else 0


def _check_ints(args: Iterable[Any]) -> None:
    """Integer arguments are sizes for widths, paddings and repeats: none may pass the value limit."""
    for a in args:
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > _budget().limits.value_size:
            _too_big("an operand", abs(a))


_FORMAT_NUMBER = re.compile(r"\d+")


def _check_format(fmt: str) -> None:
    """Widths and precisions in a %-format or str.format string ("%999999999s", "{:>999999999}")."""
    if "%" in fmt or "{" in fmt:
        _check_ints(int(d) for d in _FORMAT_NUMBER.findall(fmt) if len(d) < 30)
        if any(len(d) >= 30 for d in _FORMAT_NUMBER.findall(fmt)):
            _too_big("a format width", math.inf)


def _check_binop(op: str, left: Any, right: Any) -> None:
    if op == "*":
        n, seq = (right, left) if isinstance(right, int) else (left, right)
        if isinstance(n, int) and _size(seq):
            _too_big("a repeated sequence", _size(seq) * max(n, 0))
    elif op == "+":
        _too_big("a concatenation", _size(left) + _size(right))
    elif op == "%" and isinstance(left, str):
        _check_format(left)
        _check_ints(right if isinstance(right, tuple) else (right,))
    elif op == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
        limit = _budget().limits.int_bits
        if right * math.log2(abs(left)) > limit:
            raise ChatTemplateError(f"{left} ** {right} has more than {limit} bits: RenderLimits.int_bits")


# Filters whose result can be much larger than their input, with the size they would produce.
def _join_size(value: Any, d: str = "", attribute: Any = None) -> float:
    items = list(value) if isinstance(value, Iterable) and not isinstance(value, str) else [value]
    return sum(_size(x) if isinstance(x, str) else 20 for x in items) + len(d) * len(items)


def _replace_size(s: Any, old: Any = "", new: Any = "", count: Any = None) -> float:
    if not isinstance(s, str) or not isinstance(old, str) or not isinstance(new, str):
        return 0
    n = s.count(old) if old else len(s) + 1
    return len(s) + n * max(len(new) - len(old), 0)


def _sum_size(iterable: Any, attribute: Any = None, start: Any = 0) -> float:
    if isinstance(iterable, Iterable) and not isinstance(start, (int, float)):
        return _size(start) + sum(_size(x) for x in iterable)
    return 0


def _expandtabs_size(s: Any, tabsize: Any = 8) -> float:
    return len(s) + s.count("\t") * tabsize if isinstance(s, str) and isinstance(tabsize, int) else 0


_EXPANDING = {"join": _join_size, "replace": _replace_size, "sum": _sum_size}
# str methods likewise, called on the string: "sep".join(items), s.replace(old, new), s.expandtabs(n)
_EXPANDING_METHODS = {
    "join": lambda sep, items=(): _join_size(items, sep),
    "replace": _replace_size,
    "expandtabs": _expandtabs_size,
}


def _bounded_filter(name: str, f: Callable) -> Callable:
    """A filter that costs one operation, refuses over-limit sizes first and checks its result."""
    estimate = _EXPANDING.get(name)
    passes = getattr(f, "jinja_pass_arg", None)

    @functools.wraps(f)  # keeps jinja_pass_arg: context/environment arguments are still passed
    def bounded(*args, **kwargs):
        _budget().charge()
        values = args[1:] if passes is not None else args  # the value and the filter's own arguments
        _check_ints([*values[1:], *kwargs.values()])
        if name == "format" and values and isinstance(values[0], str):
            _check_format(values[0])
        if estimate is not None and values:
            _too_big(f"the result of |{name}", estimate(*values, **kwargs))
        result = f(*args, **kwargs)
        _too_big(f"the result of |{name}", _size(result))
        return result

    return bounded


def _iterations(iterable: Any) -> Iterator[Any]:
    """What every ``{% for %}`` iterates through: one operation per item."""
    budget = _budget()
    for item in iterable:
        budget.charge()
        yield item


def _concat(values: list[Any]) -> str:
    """The ``~`` operator, sized before it joins."""
    parts = [str(v) for v in values]
    _too_big("a ~ concatenation", sum(len(p) for p in parts))
    return "".join(parts)


class _Bound(NodeTransformer):
    """Routes every for-loop's iterable through `_iterations` and every ``~`` through `_concat`."""

    def visit_For(self, node: nodes.For) -> nodes.For:
        node = self.generic_visit(node)
        node.iter = nodes.Filter(node.iter, "_ggufpy_iterations", [], [], None, None, lineno=node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Filter:
        node = self.generic_visit(node)
        return nodes.Filter(nodes.List(node.nodes), "_ggufpy_concat", [], [], None, None, lineno=node.lineno)


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox with `RenderLimits` enforced (see the module docstring)."""

    intercepted_binops = frozenset({"*", "+", "%", "**"})

    def __init__(self, **options: Any):
        super().__init__(**options)
        self.globals["range"] = self._range
        self.globals["lipsum"] = self._lipsum

    @staticmethod
    def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:
        _too_big("lipsum text", n * max * 12)  # words of at most ~11 characters and a space
        return generate_lorem_ipsum(n, html, min, max)

    def finish_setup(self) -> None:
        """Wrap the filters once the caller has added its own (call after the last filter is registered)."""
        self.filters = {name: _bounded_filter(name, f) for name, f in self.filters.items()}
        self.filters["_ggufpy_iterations"] = _iterations
        self.filters["_ggufpy_concat"] = _concat

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        return _Bound().visit(super()._parse(source, name, filename))

    @staticmethod
    def _range(*args: int) -> range:
        return safe_range(*args)  # the sandbox's own cap (100000); loops over it pay per iteration

    # jinja's own signature: the double underscores keep a template's keyword arguments from colliding
    def call(__self, __context, __obj, *args, **kwargs):
        # a macro call runs a whole template body: ~50x the cost of a loop step (measured, recursive macros)
        _budget().charge(MACRO_COST if isinstance(__obj, Macro) else 1)
        _check_ints([*args, *kwargs.values()])
        owner, name = getattr(__obj, "__self__", None), getattr(__obj, "__name__", "")
        if isinstance(owner, str) and name in _EXPANDING_METHODS:
            _too_big(f"the result of str.{name}", _EXPANDING_METHODS[name](owner, *args, **kwargs))
        result = super().call(__context, __obj, *args, **kwargs)
        _too_big("a call result", _size(result))
        return result

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        _budget().charge()
        _check_binop(operator, left, right)
        return super().call_binop(context, operator, left, right)

    def wrap_str_format(self, value: Any):
        fmt = super().wrap_str_format(value)
        if fmt is not None:
            _check_format(value.__self__)
        return fmt
