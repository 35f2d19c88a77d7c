"""The command line's own usage errors (a misspelt command or option, ``--nodes abc``, a
missing argument) as one line, ``mdiedge: error: ...``, exit status 2, as every other bad
value; ``--help`` and a bare ``mdiedge`` still print the help."""
from __future__ import annotations

import contextlib
import difflib
import inspect
import re
import sys
from typing import Any, Iterator, List, Optional, Sequence

import typer
from typer.core import TyperCommand, TyperGroup

# the click that typer runs on: the click package, or typer's own copy of it (typer >= 0.2x)
_click = sys.modules[typer.BadParameter.__module__]
_ARGV = "mdiedge.argv"  # the command line's words, kept in the context's meta
_EXPECTED = (("int", "an integer"), ("float", "a number"))  # a parameter's type, in words


class CommandGroup(TyperGroup):
    """A group of commands whose usage errors are one line, and a misspelt command named
    with the closest ones."""

    def make_context(self, info_name: Optional[str], args: List[str], *rest: Any,
                     **extra: Any) -> Any:
        argv = list(args)
        with one_line_usage(argv):
            ctx = super().make_context(info_name, args, *rest, **extra)
        ctx.meta.setdefault(_ARGV, argv)
        return ctx

    def invoke(self, ctx: Any) -> Any:
        with one_line_usage(ctx.meta.get(_ARGV, [])):
            return super().invoke(ctx)

    def resolve_command(self, ctx: Any, args: List[str]) -> Any:
        name = args[0] if args else ""
        if name and not name.startswith("-") and self.get_command(ctx, name) is None \
                and not ctx.resilient_parsing:
            raise _click.UsageError(no_such_command(name, self.list_commands(ctx)), ctx)
        return super().resolve_command(ctx, args)


class ArgumentsCommand(TyperCommand):
    """A command with arguments: its usage line names them as its help does (``PROMPT``;
    typer from 0.2x writes a required one ``{PROMPT}``)."""

    def collect_usage_pieces(self, ctx: Any) -> List[str]:
        return [re.sub(r"^\{(.+)\}", r"\1", piece)
                for piece in super().collect_usage_pieces(ctx)]


def no_such_command(name: str, commands: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, commands, n=3, cutoff=0.6)
    if close:
        return f"no such command {name!r}; did you mean {' or '.join(close)}?"
    return f"no such command {name!r}; the commands: {', '.join(commands)}"


@contextlib.contextmanager
def one_line_usage(argv: Sequence[str]) -> Iterator[None]:
    """A usage error raised in the block shows as one line naming the offending value (the
    help's own "error", printed without a command line, is left as it is)."""
    try:
        yield
    except _click.UsageError as e:
        if not isinstance(e, getattr(_click, "NoArgsIsHelpError", ())) \
                and "show" not in vars(e):
            line = one_line(e, argv)
            e.show = lambda file=None: typer.echo(f"mdiedge: error: {line}", err=True)
        raise


def one_line(e: Any, argv: Sequence[str]) -> str:
    """The message of click's usage error ``e``: a bad value as ``--nodes: expected an
    integer, got 'abc'``, else click's own words on one line, and where help is."""
    param = getattr(e, "param", None)
    if isinstance(e, _click.BadParameter) and not isinstance(e, _click.MissingParameter) \
            and param is not None and param.param_type_name == "option":
        value = option_value(argv, list(param.opts) + list(param.secondary_opts))
        expected = expected_value(e.ctx, param.name)
        if value is not None and expected:
            return f"{'/'.join(param.opts)}: expected {expected}, got {value!r}"
    if isinstance(e, _click.NoSuchOption) and e.possibilities:
        return f"no such option {e.option_name}; did you mean {' or '.join(e.possibilities)}?"
    message = " ".join(e.format_message().split()).rstrip(".")
    message = message[:1].lower() + message[1:]
    if e.ctx is not None and not message.startswith("no such command"):
        message += f" (see {e.ctx.command_path} --help)"
    return message


def option_value(argv: Sequence[str], names: Sequence[str]) -> Optional[str]:
    """The value the command line gave the option ``names`` last (``--nodes 3``,
    ``--nodes=3``, ``-n3``); None when it gave none."""
    value = None
    for i, word in enumerate(argv):
        for name in names:
            if word == name and i + 1 < len(argv):
                value = argv[i + 1]
            elif word.startswith(name + "="):
                value = word[len(name) + 1:]
            elif len(name) == 2 and name[1] != "-" and word.startswith(name) and len(word) > 2 \
                    and not word.startswith("--"):
                value = word[2:]
    return value


def expected_value(ctx: Any, name: Optional[str]) -> Optional[str]:
    """What the parameter ``name`` of ``ctx``'s command takes, in words, from the type of the
    command's argument (``int``, ``Optional[float]``); None for any other type."""
    callback = getattr(getattr(ctx, "command", None), "callback", None)
    if callback is None or name is None:
        return None
    param = inspect.signature(callback).parameters.get(name)
    annotation = None if param is None else param.annotation
    for word, expected in _EXPECTED:
        if re.search(rf"\b{word}\b", str(annotation)):
            return expected
    return None
