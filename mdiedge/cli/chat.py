"""``mdiedge chat``: a conversation with the model's chat template, on the same engines as
``generate`` (one process, a local ring or a ring file's workers).

Each turn renders the whole conversation with the template (as transformers'
``apply_chat_template(..., add_generation_prompt=True)``) and generates the answer, which streams to
stdout. The oldest turns are dropped when the conversation and the answer's budget would not fit the
context. ``--message`` answers one turn, streamed as well, and prints the answer alone."""
from __future__ import annotations

import dataclasses
import threading
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import typer

if TYPE_CHECKING:
    from ..engine.engine import Engine, Prompt

from ..base import defaults
from ..base.engineoptions import EngineOptions
from ..base.errors import ContextExceeded, ConversationError, GenerationError
from ..base.request import Asked
from .app import (
    app,
    asked,
    engine_spec,
    need,
    one_line_errors,
    open_checked,
    temperature_option,
    terminate_gracefully,
    top_k_option,
    top_p_option,
    with_engine_options,
)
from .console import end_line, write_text

HELP_LINE = "/reset forgets the conversation, /exit (or Ctrl-D) ends it, Ctrl-C stops an answer"
PROMPT = ">>> "


@dataclass
class Conversation:
    """The messages so far (the system message first, if any) and the rule that keeps them
    within the context."""

    system: Optional[str] = None
    turns: List[Tuple[str, str]] = field(default_factory=list)  # (user, assistant)

    def messages(self, user: str) -> List[Any]:
        from ..serving.api.schema import ChatMessage

        out = [ChatMessage("system", self.system)] if self.system else []
        for question, answer in self.turns:
            out += [ChatMessage("user", question), ChatMessage("assistant", answer)]
        return out + [ChatMessage("user", user)]

    def reset(self) -> None:
        self.turns.clear()


def fit_turns(n_turns: int, prompt_length: Callable[[int], int], budget: int,
              context: int) -> int:
    """How many of the oldest turns to drop so that the prompt (``prompt_length(dropped)``
    tokens) plus ``budget`` new tokens fit ``context``; a GenerationError when even the
    newest message alone does not."""
    for dropped in range(n_turns + 1):
        length = prompt_length(dropped)
        if length + budget <= context:
            return dropped
    raise GenerationError(f"the message is {length} tokens with the template; with -n {budget} "
                          f"that exceeds the context of {context} tokens")


class ChatSession:
    """One engine, its template and a conversation; ``answer`` runs one turn. ``interactive``:
    Ctrl-C stops an answer and the session goes on; else (``--message``) it ends the command."""

    def __init__(self, engine: "Engine", conversation: Conversation, wanted: Asked,
                 interactive: bool) -> None:
        from ..serving.api.chat import ChatTemplate

        self.engine, self.conversation = engine, conversation
        self.template = ChatTemplate.for_model(engine.path, engine.tokenizer,
                                               engine.cfg.max_seq_len)
        self.wanted = dataclasses.replace(wanted, stop=tuple(self.template.stops))
        self.budget = wanted.max_new_tokens or 1
        self.interactive = interactive

    def prompt(self, user: str) -> "Prompt":
        """The conversation's ``Prompt`` with ``user`` as the next message, the oldest turns
        dropped (from the conversation too) until it fits."""
        def prompt(dropped: int) -> "Prompt":
            saved = self.conversation.turns
            self.conversation.turns = saved[dropped:]
            try:
                return self.engine.prompt(self._render(user), templated=True)
            finally:
                self.conversation.turns = saved

        tried: Dict[int, "Prompt"] = {}  # each length tried is tokenized once
        context = self.engine.cfg.max_seq_len

        def length(dropped: int) -> int:
            try:
                tried[dropped] = prompt(dropped)
            except ContextExceeded:  # its text is too long to tokenize: drop older turns
                if dropped == len(self.conversation.turns):
                    raise
                return context + 1
            return len(tried[dropped].ids)

        dropped = fit_turns(len(self.conversation.turns), length, self.budget, context)
        del self.conversation.turns[:dropped]
        return tried[dropped]

    def _render(self, user: str) -> str:
        """The conversation's text; the template's failure a GenerationError (one line)."""
        try:
            return self.template.prompt(self.conversation.messages(user))
        except ConversationError as e:
            raise GenerationError(f"the chat template refused the conversation: {e}") from None

    def answer(self, user: str) -> str:
        """Generate the answer to ``user``, streamed to stdout, add the turn, return the
        answer's text. Ctrl-C stops the answer: what was generated is kept (and the command
        ends with KeyboardInterrupt unless ``interactive``)."""
        request = self.engine.request(self.prompt(user), self.wanted)

        def on_token(index: int, token: int) -> None:
            write_text(generation.samples[0].output.fresh())

        generation = self.engine.generation_of(request, on_token)
        interrupted = _run_interruptibly(self.engine, generation)
        text = generation.samples[0].text
        write_text(generation.samples[0].output.rest(text) + "\n")
        if interrupted and not self.interactive:
            raise KeyboardInterrupt
        if interrupted:
            typer.echo("[stopped]", err=True)
        self.conversation.turns.append((user, text))
        return text


def _run_interruptibly(engine: "Engine", generation: Any) -> bool:
    """Run ``generation`` on a thread of its own; Ctrl-C cancels it (its KV rows are freed)
    and waits for it to end. True when it was interrupted."""
    failure: List[BaseException] = []

    def work() -> None:
        try:
            engine.run(generation)
        except BaseException as e:  # re-raised on the caller's thread
            failure.append(e)

    worker = threading.Thread(target=work, name="mdiedge-chat", daemon=True)
    worker.start()
    interrupted = False
    while worker.is_alive():
        try:
            worker.join(0.1)  # a timed join lets Ctrl-C arrive
        except KeyboardInterrupt:
            interrupted = True
            generation.cancel()
    if failure:
        raise failure[0]
    return interrupted


def _read_message() -> Optional[str]:
    """The next line typed at the prompt; None at end of input (Ctrl-D)."""
    while True:
        try:
            return input(PROMPT)
        except EOFError:
            typer.echo("", err=True)
            return None
        except KeyboardInterrupt:  # at the prompt: a fresh line, the session goes on
            typer.echo(f"\n({HELP_LINE})", err=True)


def _converse(session: ChatSession) -> None:
    """The interactive loop: a message per line until /exit or end of input."""
    typer.echo(f"mdiedge chat: {session.engine.path.name}. {HELP_LINE}.", err=True)
    while True:
        line = _read_message()
        if line is None or line.strip() == "/exit":
            return
        if line.strip() == "/reset":
            session.conversation.reset()
            typer.echo("(the conversation is forgotten)", err=True)
        elif line.strip():
            try:
                session.answer(line)
            except GenerationError as e:  # this message does not fit: the session goes on
                end_line()
                typer.echo(f"mdiedge: error: {e}", err=True)


@app.command()
@one_line_errors
@with_engine_options("the session", skip=("early_exit", "exit_threshold", "speculate"))
def chat(
    message: Optional[str] = typer.Option(None, "--message", "-m", metavar="TEXT",
                                          help="Answer this one message, print the answer "
                                          "alone and exit (for scripts)."),
    system: Optional[str] = typer.Option(None, "--system", metavar="TEXT",
                                         help="A system message that opens the conversation."),
    max_new_tokens: int = typer.Option(defaults.MAX_NEW_TOKENS, "-n", "--max-new-tokens",
                                       help="Token budget per answer."),
    seed: Optional[int] = typer.Option(None, help="Random seed (default: a new one each run)."),
    temperature: float = temperature_option(),
    top_k: int = top_k_option(),
    top_p: float = top_p_option(),
    opts: EngineOptions = EngineOptions(),
) -> None:
    """Chat with an instruct model through its chat template (interactive, or one --message)."""
    wanted = asked(max_new_tokens, 1, temperature, top_k, top_p, seed)
    need(message is None or bool(message.strip()), "--message", message, "some text")
    spec = engine_spec(opts)
    with ExitStack() as stack:
        terminate_gracefully()
        engine, _ = open_checked(stack, spec, lambda text: None)
        if opts.prompt_cache:  # one layout for every turn: each finds the last one's rows
            engine.prompt_cache = True
            engine.reserve(1, min(engine.cfg.max_seq_len, defaults.API_CONTEXT))
        session = ChatSession(engine, Conversation(system), wanted, interactive=message is None)
        if message is not None:
            session.answer(message)
            return
        _converse(session)
