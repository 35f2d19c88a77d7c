"""The jinja environment chat templates run in. A model file's template is code from a stranger:
jinja's immutable sandbox keeps it from Python's internals and from mutating lists and dicts,
and the budgets here keep it from the server's time and memory. Each render has

- steps: loop iterations, calls, filters and intercepted operators (``TEMPLATE_STEPS``),
- nesting: macros and recursive loops inside one another (``TEMPLATE_DEPTH``),
- time: a wall-clock deadline (``TEMPLATE_DEADLINE_S``), looked at on every step,
- size: no value it makes (a text, a list) longer than the prompt may be (``Limits.size``,
  from the context), checked *before* the operations that could make a longer one from short
  inputs (``*``, ``**``, ``%``, ``+``, ``~``, ``join``, ``replace``, ``indent``, ``format``,
  wide arguments), and after every other; and all it makes on the way, garbage included, at
  most ``TEMPLATE_WORK`` times that.

Every check raises ``ChatTemplateError`` inside the render, so a runaway template ends itself
on whatever thread runs it (a Python thread cannot be killed). The hooks: the sandbox's own
(``call``, ``call_binop``, ``getitem``), every filter wrapped, and the parsed template rewritten
(each loop's iterable counted, each ``~`` and each write measured) by ``_Guard``.
"""
from __future__ import annotations

import functools
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

from jinja2 import nodes
from jinja2.runtime import LoopContext, Macro
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range
from jinja2.visitor import NodeTransformer

from ...base import defaults
from ...base.errors import ChatTemplateError, ContextExceeded, ConversationError

LOOP, CONCAT, WRITE = "~loop", "~concat", "~write"  # names no template can write
INT_BITS = 1 << 16  # the largest integer an operator may make
MAX_INDENT = 16  # tojson's indent
MAX_SUMMED = 1024  # lists `sum` may join (each sum copies all before it)
REFUSED_METHODS = ("expandtabs", "translate", "maketrans")  # of str and bytes: no bound known
_WIDTHS = re.compile(r"\d+")
_NESTED_FIELD = re.compile(r"\{[^{}]*:[^{}]*\{")  # "{0:>{1}}": a width no digit run shows
_local = threading.local()


@dataclass(frozen=True)
class Limits:
    """``size``: characters per value (and bytes of the prompt)."""

    size: int
    steps: int = defaults.TEMPLATE_STEPS
    depth: int = defaults.TEMPLATE_DEPTH
    deadline_s: float = defaults.TEMPLATE_DEADLINE_S

    @classmethod
    def for_context(cls, context: int) -> "Limits":
        return cls(defaults.TEMPLATE_BYTES_PER_TOKEN * context)

    @property
    def work(self) -> int:
        return defaults.TEMPLATE_WORK * self.size


def measure(value: Any, limit: int) -> int:
    """About the characters ``str(value)`` takes, counted until past ``limit`` (a self-holding
    container ends there too)."""
    total, stack = 0, [value]
    while stack and total <= limit:
        item = stack.pop()
        if isinstance(item, (str, bytes)):
            total += len(item)
        elif isinstance(item, (list, tuple)):
            total += 2 + 2 * len(item)
            if total <= limit:
                stack.extend(item)
        elif isinstance(item, dict):
            total += 2 + 4 * len(item)
            if total <= limit:
                stack.extend(item.keys())
                stack.extend(item.values())
        elif isinstance(item, int):
            total += item.bit_length() // 3 + 1
        else:
            total += 8
    return total


def _shown(value: int) -> str:
    return str(value) if value.bit_length() < 64 else f"an integer of {value.bit_length()} bits"


class Budget:
    """What this thread's render has spent; ``active()`` finds it."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.steps = self.depth = self.made = 0
        self.deadline = time.monotonic() + limits.deadline_s

    def step(self) -> None:
        self.steps += 1
        if self.steps > self.limits.steps:
            raise ChatTemplateError(f"the chat template went past its limit of "
                                    f"{self.limits.steps} steps (loop iterations, calls, "
                                    f"filters and operators)")
        if time.monotonic() > self.deadline:
            raise ChatTemplateError(f"the chat template did not finish within "
                                    f"{self.limits.deadline_s:g} s")

    def fits(self, size: int, what: str) -> None:
        if size > self.limits.size:
            raise ChatTemplateError(f"the chat template would make {what} of {size} or more "
                                    f"characters, over its limit of {self.limits.size}")

    def made_value(self, value: Any, counted: bool = True) -> Any:
        size = measure(value, self.limits.size)
        self.fits(size, "a value")
        if counted:
            self.made += size
            if self.made > self.limits.work:
                raise ChatTemplateError(f"the chat template made more than its limit of "
                                        f"{self.limits.work} characters on the way")
        return value

    def enter(self) -> None:
        self.depth += 1
        if self.depth > self.limits.depth:
            raise ChatTemplateError(f"the chat template nests macros or recursive loops "
                                    f"deeper than its limit of {self.limits.depth}")

    def small_ints(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        """Integer arguments (widths, counts) no larger than a value may be."""
        for value in (*args, *kwargs.values()):
            if isinstance(value, int) and abs(value) > self.limits.size:
                raise ChatTemplateError(f"the chat template passes {_shown(value)} as an "
                                        f"argument, over its limit of {self.limits.size}")

    def format_widths(self, text: Any) -> None:
        if isinstance(text, (str, bytes)):
            shown = text if isinstance(text, str) else text.decode("latin-1")
            for digits in _WIDTHS.findall(shown):
                if len(digits) > 12 or int(digits) > self.limits.size:
                    raise ChatTemplateError(f"the chat template formats with a width of "
                                            f"{digits[:20]}, over its limit of {self.limits.size}")


def active() -> Budget:
    """Outside a render (jinja folding constants while compiling) an error, so nothing limited runs
    before it."""
    budget: Optional[Budget] = getattr(_local, "budget", None)
    if budget is None:
        raise ChatTemplateError("the chat template ran outside a render")
    return budget


def render(template: Any, limits: Limits, variables: Dict[str, Any]) -> str:
    """Every template failure a one-line ``ChatTemplateError``; the prompt's size checked in bytes.
    """
    from jinja2 import TemplateError

    saved = getattr(_local, "budget", None)
    _local.budget = Budget(limits)
    try:
        text = str(template.render(**variables))
    except (ChatTemplateError, ConversationError):  # its limits, its raise_exception
        raise
    except TemplateError as e:
        raise ChatTemplateError(f"the chat template failed: {_one_line(e)}") from None
    except Exception as e:  # noqa: BLE001 - Python's errors inside a template are its own
        raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: "
                                f"{_one_line(e)}") from None
    finally:
        _local.budget = saved
    check_fits("the chat template rendered a prompt of", len(text.encode("utf-8", "surrogatepass")),
               limits)
    return text


def check_fits(what: str, size: int, limits: Limits) -> None:
    """A ContextExceeded when ``size`` bytes cannot fit the context ``limits`` are for."""
    per_token = defaults.TEMPLATE_BYTES_PER_TOKEN
    if size > limits.size:
        raise ContextExceeded(f"{what} {size} bytes, more than a {limits.size // per_token}-token "
                              f"context holds (at most {per_token} bytes per token)")


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= 300 else text[:300] + "..."


# ---------------------------------------------------------------------- before an operation

def _check_binop(budget: Budget, operator: str, left: Any, right: Any) -> None:
    size = budget.limits.size
    if operator == "*":
        times, seq = (right, left) if isinstance(right, int) else (left, right)
        if isinstance(seq, (str, bytes, list, tuple)) and isinstance(times, int):
            budget.fits(measure(seq, size) * max(times, 0), "a repeated value")
        elif isinstance(left, int) and isinstance(right, int) and \
                left.bit_length() + right.bit_length() > INT_BITS:
            raise ChatTemplateError(f"the chat template would make an integer of more than "
                                    f"{INT_BITS} bits")
    elif operator == "**":
        if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1 \
                and right * left.bit_length() > INT_BITS:
            raise ChatTemplateError(f"the chat template would make an integer of more than "
                                    f"{INT_BITS} bits")
    elif operator == "%" and isinstance(left, (str, bytes)):
        _check_format(budget, left, right if isinstance(right, tuple) else (right,), {})
    elif operator == "+" and (isinstance(left, (str, bytes)) and isinstance(right, (str, bytes))
                              or isinstance(left, (list, tuple))
                              and isinstance(right, (list, tuple))):
        budget.fits(measure(left, size) + measure(right, size), "a joined value")


def _check_format(budget: Budget, text: Any, args: Tuple[Any, ...],
                  kwargs: Dict[str, Any]) -> None:
    """Widths within the size, each field at most all arguments."""
    budget.format_widths(text)
    budget.small_ints(args, kwargs)
    if isinstance(text, (str, bytes)):
        fields = text.count("%" if isinstance(text, str) else b"%") + \
            text.count("{" if isinstance(text, str) else b"{")
        size = budget.limits.size
        budget.fits(len(text) + fields * measure((args, kwargs), size), "a formatted text")


def _check_text_method(budget: Budget, text: Any, name: str, args: Tuple[Any, ...],
                       kwargs: Dict[str, Any]) -> Tuple[Any, ...]:
    size = budget.limits.size
    if name in REFUSED_METHODS:
        raise ChatTemplateError(f"the chat template calls {type(text).__name__}.{name}, which "
                                f"a chat template may not")
    if name == "replace" and len(args) >= 2 and isinstance(args[1], type(text)):
        found = text.count(args[0]) if isinstance(args[0], type(text)) else 0
        if len(args) > 2 and isinstance(args[2], int) and args[2] >= 0:
            found = min(found, args[2])
        budget.fits(len(text) + found * len(args[1]), "a replaced text")
    elif name == "join" and args:
        items = args[0] if isinstance(args[0], (list, tuple, str, dict)) else list(args[0])
        budget.fits(measure(items, size) + len(text) * len(items), "a joined text")
        args = (items,) + args[1:]
    elif name in ("format", "format_map"):
        if _NESTED_FIELD.search(text if isinstance(text, str) else ""):
            raise ChatTemplateError("the chat template formats with a width from an argument "
                                    "(a nested replacement field), which a chat template may not")
        _check_format(budget, text, args, kwargs)
    return args


# ---------------------------------------------------------------------- filters

FilterCheck = Callable[[Budget, Any, Tuple[Any, ...], Dict[str, Any]], Any]


def _arg(args: Tuple[Any, ...], kwargs: Dict[str, Any], index: int, name: str,
         default: Any = None) -> Any:
    return args[index] if len(args) > index else kwargs.get(name, default)


def _join_filter(budget: Budget, value: Any, args: Tuple[Any, ...],
                 kwargs: Dict[str, Any]) -> Any:
    items = value if isinstance(value, (list, tuple, str, dict)) else list(value)
    glue = str(_arg(args, kwargs, 0, "d", ""))
    budget.fits(measure(items, budget.limits.size) + len(glue) * len(items), "a joined text")
    return items


def _replace_filter(budget: Budget, value: Any, args: Tuple[Any, ...],
                    kwargs: Dict[str, Any]) -> Any:
    text, old, new = str(value), str(_arg(args, kwargs, 0, "old", "")), \
        str(_arg(args, kwargs, 1, "new", ""))
    budget.fits(len(text) + text.count(old) * len(new), "a replaced text")
    return value


def _indent_filter(budget: Budget, value: Any, args: Tuple[Any, ...],
                   kwargs: Dict[str, Any]) -> Any:
    width = _arg(args, kwargs, 0, "width", 4)
    prefix = len(width) if isinstance(width, str) else int(width or 0)
    text = str(value)
    budget.fits(len(text) + (text.count("\n") + 1) * prefix, "an indented text")
    return value


def _wordwrap_filter(budget: Budget, value: Any, args: Tuple[Any, ...],
                     kwargs: Dict[str, Any]) -> Any:
    text, width = str(value), _arg(args, kwargs, 0, "width", 79)
    glue = _arg(args, kwargs, 2, "wrapstring", None) or "\n"
    lines = len(text) // max(int(width), 1) + text.count(" ") + text.count("\n") + 1
    budget.fits(len(text) + lines * len(str(glue)), "a wrapped text")
    return value


def _format_filter(budget: Budget, value: Any, args: Tuple[Any, ...],
                   kwargs: Dict[str, Any]) -> Any:
    _check_format(budget, value, args, kwargs)
    return value


def _sum_filter(budget: Budget, value: Any, args: Tuple[Any, ...],
                kwargs: Dict[str, Any]) -> Any:
    items = list(value)
    start = _arg(args, kwargs, 1, "start", 0)
    if isinstance(start, (list, tuple)) or any(isinstance(i, (list, tuple)) for i in items):
        if len(items) > MAX_SUMMED:
            raise ChatTemplateError(f"the chat template sums {len(items)} lists, over its "
                                    f"limit of {MAX_SUMMED}")
        budget.fits(measure(items, budget.limits.size) + measure(start, budget.limits.size),
                    "a summed list")
    return items


def _tojson_filter(budget: Budget, value: Any, args: Tuple[Any, ...],
                   kwargs: Dict[str, Any]) -> Any:
    indent = _arg(args, kwargs, 1, "indent", None)
    width = len(indent) if isinstance(indent, str) else int(indent or 0)
    if width > MAX_INDENT:
        raise ChatTemplateError(f"the chat template indents JSON by {width}, over its limit "
                                f"of {MAX_INDENT}")
    separators = _arg(args, kwargs, 2, "separators", None) or ()
    glue = sum(len(s) for s in separators if isinstance(s, str))
    budget.fits(measure(value, budget.limits.size) * (1 + glue), "a JSON text")
    return value


def _number_filter(budget: Budget, value: Any, args: Tuple[Any, ...],
                   kwargs: Dict[str, Any]) -> Any:
    if isinstance(value, str) and len(value) > 4300:  # Python's own limit on int("...")
        raise ChatTemplateError(f"the chat template reads a number from {len(value)} "
                                f"characters")
    return value


FILTER_CHECKS: Dict[str, FilterCheck] = {
    "join": _join_filter, "replace": _replace_filter, "indent": _indent_filter,
    "wordwrap": _wordwrap_filter, "format": _format_filter, "sum": _sum_filter,
    "tojson": _tojson_filter, "int": _number_filter, "float": _number_filter}


def _limited_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    """A step, arguments checked before and the value after."""
    check = FILTER_CHECKS.get(name)
    passes = 1 if getattr(func, "jinja_pass_arg", None) is not None else 0

    @functools.wraps(func)
    def limited(*args: Any, **kwargs: Any) -> Any:
        budget = active()
        budget.step()
        if len(args) > passes:
            rest = args[passes + 1:]
            budget.small_ints(rest, kwargs)
            if check is not None:
                value = check(budget, args[passes], rest, kwargs)
                args = args[:passes] + (value,) + rest
        return budget.made_value(func(*args, **kwargs))
    return limited


def _counted(iterable: Any, budget: Budget) -> Iterator[Any]:
    for item in iterable:
        budget.step()
        yield item


def _loop_filter(iterable: Any) -> Iterator[Any]:
    return _counted(iterable, active())


def _concat_filter(parts: Any) -> str:
    budget = active()
    budget.fits(measure(parts, budget.limits.size), "a joined text")
    return str(budget.made_value("".join(map(str, parts))))


def _write_filter(value: Any) -> Any:
    return active().made_value(value)


# ---------------------------------------------------------------------- the environment

def _filter(node: Any, name: str) -> Any:
    return nodes.Filter(node, name, [], [], None, None, lineno=node.lineno)


class _Guard(NodeTransformer):
    """Each loop's iterable counted (``LOOP``), each ``~`` measured before it joins (``CONCAT``),
    each write measured (``WRITE``)."""

    def visit_For(self, node: Any) -> Any:
        node = self.generic_visit(node)
        node.iter = _filter(node.iter, LOOP)
        return node

    def visit_Concat(self, node: Any) -> Any:
        node = self.generic_visit(node)
        return _filter(nodes.List(node.nodes, lineno=node.lineno), CONCAT)

    def visit_Output(self, node: Any) -> Any:
        node = self.generic_visit(node)
        node.nodes = [_filter(nodes.Const(child.data, lineno=child.lineno)
                              if isinstance(child, nodes.TemplateData) else child, WRITE)
                      for child in node.nodes]
        return node


class LimitedEnvironment(ImmutableSandboxedEnvironment):
    """``filters`` and ``globals``: the caller's own, limited as jinja's are."""

    intercepted_binops = frozenset(("*", "**", "%", "+"))

    def __init__(self, filters: Dict[str, Callable[..., Any]], globals: Dict[str, Any],
                 **options: Any) -> None:
        super().__init__(**options)
        self.globals.pop("lipsum", None)  # paragraphs of filler text by the thousand
        self.globals.update(globals)
        self.filters.update(filters)
        for name, func in list(self.filters.items()):
            self.filters[name] = _limited_filter(name, func)
        self.filters.update({LOOP: _loop_filter, CONCAT: _concat_filter, WRITE: _write_filter})

    def _parse(self, source: str, name: Optional[str], filename: Optional[str]) -> Any:
        tree = _Guard().visit(super()._parse(source, name, filename))
        tree.set_environment(self)
        return tree

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        budget = active()
        budget.step()
        if __obj is not safe_range:  # a lazy range, of at most jinja's MAX_RANGE
            budget.small_ints(args, kwargs)
        method = getattr(__obj, "__wrapped__", __obj)  # jinja wraps str.format
        owner = getattr(method, "__self__", None)
        if isinstance(owner, (str, bytes)):
            args = _check_text_method(budget, owner, getattr(method, "__name__", ""), args,
                                      kwargs)
        if not isinstance(__obj, (Macro, LoopContext)):
            return budget.made_value(super().call(__context, __obj, *args, **kwargs))
        if isinstance(__obj, LoopContext) and args:  # a recursive loop's next level
            args = (_counted(args[0], budget),) + args[1:]
        budget.enter()
        try:  # its text is counted as it is written
            return budget.made_value(super().call(__context, __obj, *args, **kwargs), False)
        finally:
            budget.depth -= 1

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = active()
        budget.step()
        _check_binop(budget, operator, left, right)
        return budget.made_value(self.binop_table[operator](left, right))

    def getitem(self, obj: Any, argument: Any) -> Any:
        value = super().getitem(obj, argument)
        if isinstance(argument, slice):  # a copy
            active().made_value(value)
        return value
