"""The chat template renderer against random hostile templates (issue 45): jinja fragments that
loop, repeat, format, join, replace, indent, recurse and raise, nested inside loops, macros and
``{% set %}`` blocks, with sizes from 0 to 10**12; the probe's templates first. Each one either
fails to compile (a ConfigError), renders a prompt within the size limit, or fails with the
renderer's own errors (a prompt beyond the context included); none takes past its deadline or
allocates more than a few MB. Bounded to about 20 s."""
from __future__ import annotations

import os
import time
import tracemalloc
from dataclasses import replace
from typing import Any, Callable, List

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from mdiedge.base.errors import ChatTemplateError, ConfigError, ContextExceeded, ConversationError
from mdiedge.serving.api.chat import ChatTemplate
from mdiedge.serving.api.schema import ChatMessage

BUDGET_S = float(os.environ.get("MDIEDGE_FUZZ_BUDGET_S", "20"))  # of the whole test; the
#                                 examples past it return at once
DEADLINE_S = 0.2  # of one render (shorter than a server's, for more examples)
STEPS = 5_000
PEAK_BYTES = 32 << 20  # of one template's compile and render
MESSAGES = [ChatMessage("system", "Be terse."), ChatMessage("user", "Hello"),
            ChatMessage("assistant", "Hi"), ChatMessage("user", "More")]
SIZES = [0, 1, 3, 100, 4096, 100_000, 10**12, -1]
PREFIX = ("{% set ns = namespace(s='ab', l=[]) %}"
          "{% macro m(n) %}{{ n }}{% if n > 0 %}{{ m(n - 1) }}{% endif %}{% endmacro %}")
LEAVES = [
    "{{ 'x' * N }}", "{{ messages[1].content * N }}", "{{ N ** N }}", "{{ '%0Nd' % 1 }}",
    "{{ '{:N}'.format(1) }}", "{{ '{0}{0}{0}{0}'.format(ns.s * N) }}",
    "{{ ('x' * N) | replace('x', 'yy') }}", "{{ range(N) | list | join(',') }}",
    "{{ ('a\\n' * N) | indent(N) }}", "{{ 'x' | center(N) }}",
    "{{ messages | tojson(indent=N) }}", "{{ [[1] * N] * N }}",
    "{{ (['a'] * N) | sum(start=[]) }}", "{{ ns.s }}{% set ns.s = ns.s ~ ns.s %}",
    "{% set ns.s = ns.s + ns.s %}", "{% set ns.l = ns.l + [ns.s] * N %}{{ ns.l | length }}",
    "{{ raise_exception('refused') }}", "{{ 1 / 0 }}", "{{ nothing.here }}",
    "{{ messages.__class__.__mro__ }}", "{{ 'x'.expandtabs(N) }}", "{{ lipsum(N) }}",
    "{{ ('ab' * N)[::-1] }}", "{{ range(N) | max }}", "{{ ('9' * N) | int }}", "{{ m(N) }}",
    "{% for x in [1] recursive %}{{ loop([1] * N) }}{% endfor %}", "{{ 'a' ~ ns.s ~ N }}",
    "{{ ns.s | wordwrap(N) }}", "{{ range(N) }}", "{{ ns }}", "{{ (ns.s * N).split('a') }}",
    "{{ '%s' * N % ns.s }}", "{{ '%*s' % (N, 'x') }}", "{{ ns.l | join(ns.s) }}",
    "{{ '{0:>{1}}'.format('x', 'N') }}", "{{ raise_exception('a\\n' * N) }}",
]
WRAPS = [
    "{% for i in range(N) %}BODY{% endfor %}", "{% for c in ns.s %}BODY{% endfor %}",
    "{% set b %}BODY{% endset %}{{ b ~ b }}", "{% macro w() %}BODY{% endmacro %}{{ w() }}{{ w() }}",
    "{% if messages %}BODY{% endif %}", "{% for msg in messages %}BODY{% endfor %}",
    "{% macro r(k) %}BODY{{ r(k) }}{% endmacro %}{{ r(1) }}",
]
TOKENS = ["{%", "%}", "{{", "}}", "for", "in", "range(", ")", "endfor", "if", "endif", "x",
          "*", "~", "N", "'a'", "macro", "set", "=", "|", "join", "(", ",", "[", "]"]


def filled(template: str, size: int) -> str:
    return template.replace("N", str(size))


leaves = st.builds(filled, st.sampled_from(LEAVES), st.sampled_from(SIZES))


def wrapped(children: Any) -> Any:
    wrap = st.builds(lambda w, size, body: filled(w, size).replace("BODY", body),
                     st.sampled_from(WRAPS), st.sampled_from(SIZES), children)
    return st.one_of(wrap, st.builds(lambda a, b: a + b, children, children))


structured = st.recursive(leaves, wrapped, max_leaves=6)
scrambled = st.builds(lambda parts, size: filled(" ".join(parts), size),
                      st.lists(st.sampled_from(TOKENS), max_size=24), st.sampled_from(SIZES))
spent: List[float] = []


def render_within_limits(source: str) -> None:
    began = time.monotonic()
    tracemalloc.start()
    try:
        try:
            template = ChatTemplate(PREFIX + source, context=256)
        except ConfigError:
            return
        template.limits = replace(template.limits, steps=STEPS, deadline_s=DEADLINE_S)
        try:
            text = template.prompt(MESSAGES)
            assert len(text.encode("utf-8")) <= template.limits.size
        except (ChatTemplateError, ContextExceeded, ConversationError):
            pass
        peak = tracemalloc.get_traced_memory()[1]
        assert peak < PEAK_BYTES, f"{peak} bytes for {source!r}"
    finally:
        tracemalloc.stop()
        took = time.monotonic() - began
        spent.append(took)
    assert took < DEADLINE_S + 2.0, f"{took:.1f} s for {source!r}"


def bounded(test: Callable[[str], None]) -> Callable[[str], None]:
    def run(source: str) -> None:
        if sum(spent) < BUDGET_S:
            test(source)
    return run


@settings(max_examples=1000, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(st.one_of(structured, scrambled))
@example("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
@example("{{ 'x' * 20000000 }}")
@example("{{ range(10**12) }}")
@example("{% macro m(n) %}{{ m(n + 1) }}{% endmacro %}{{ m(0) }}")
@example("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}")
@example("{% for i in range(90000) %}{% set top = range(4000) | max %}{% endfor %}")
def test_hostile_templates_fail_only_as_template_errors(source: str) -> None:
    bounded(render_within_limits)(source)
