"""``mdiedge chat``: the rule that keeps a conversation within the context, one ``--message``
for scripts, and the interactive session as a user meets it in a terminal."""
from __future__ import annotations

import os
import subprocess
import time
from typing import Any, List

import pytest

from mdiedge.base.errors import GenerationError
from mdiedge.cli.chat import Conversation, fit_turns
from commands import MDIEDGE



@pytest.mark.parametrize("lengths, budget, context, dropped", [
    ([50, 30, 10], 10, 100, 0),  # all of it fits
    ([95, 60, 20], 10, 100, 1),  # the oldest turn goes
    ([200, 150, 90], 10, 100, 2),  # only the newest message is left
    ([10], 90, 100, 0),  # exactly full
])
def test_the_oldest_turns_go_until_it_fits(lengths: List[int], budget: int, context: int,
                                           dropped: int) -> None:
    assert fit_turns(len(lengths) - 1, lambda d: lengths[d], budget, context) == dropped


def test_a_message_that_cannot_fit_is_one_line() -> None:
    with pytest.raises(GenerationError, match="the message is 120 tokens with the template; "
                       "with -n 10 that exceeds the context of 100 tokens"):
        fit_turns(1, lambda d: [150, 120][d], 10, 100)


def test_a_conversation_lists_system_turns_and_the_new_message() -> None:
    talk = Conversation("Be terse.", [("hi", "hello")])
    assert [(m.role, m.content) for m in talk.messages("again")] == [
        ("system", "Be terse."), ("user", "hi"), ("assistant", "hello"), ("user", "again")]
    talk.reset()
    assert [m.role for m in talk.messages("x")] == ["system", "user"]


def _greedy(*args: str) -> List[str]:
    return MDIEDGE + ["chat", "--temperature", "0", *args]


def test_one_message_prints_the_answer_alone() -> None:
    """The answer (the template's dialogue continued) and nothing else on stdout; equal to
    a greedy generate of the rendered template."""
    done = subprocess.run(_greedy("--message", "Hello", "-n", "12"), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    prompt = "USER:\nHello\n\nASSISTANT:\n"  # NanoLlama: the default template, no BOS
    plain = subprocess.run(MDIEDGE + ["generate", prompt, "-n", "12", "--temperature", "0",
                                      "--nodes", "1", "--json"],
                           capture_output=True, text=True, timeout=120)
    import json

    assert done.stdout == json.loads(plain.stdout)["samples"][0]["text"] + "\n"
    assert done.stderr == ""


@pytest.mark.parametrize("args, message", [
    (["-n", "0"], "-n/--max-new-tokens: expected an integer >= 1, got 0"),
    (["--message", "  "], "--message: expected some text, got '  '"),
    (["--nodes", "0"], "--nodes: expected an integer >= 1, got 0"),
])
def test_bad_values_are_one_line(args: List[str], message: str) -> None:
    done = subprocess.run(MDIEDGE + ["chat", "--message", "hi", *args], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and done.stderr == f"mdiedge: error: {message}\n"


def _spawn(*args: str) -> Any:
    pexpect = pytest.importorskip("pexpect")
    child = pexpect.spawn(MDIEDGE[0], MDIEDGE[1:] + ["chat", *args], encoding="utf-8",
                          timeout=90, env=dict(os.environ, COLUMNS="100"))
    child.expect_exact(">>> ")
    return child


def test_an_interactive_session_streams_resets_and_ends() -> None:
    child = _spawn("-n", "8", "--temperature", "0", "--system", "Be brief.")
    child.sendline("Good morrow")
    child.expect_exact(">>> ")
    first = child.before
    assert "Good morrow" in first and len(first.split("\n")) >= 2  # the echo, then the answer
    child.sendline("/reset")
    child.expect_exact("(the conversation is forgotten)")
    child.expect_exact(">>> ")
    child.sendline("/exit")
    child.expect(pexpect_eof())
    child.close()
    assert child.exitstatus == 0


def pexpect_eof() -> Any:
    import pexpect

    return pexpect.EOF


def test_ctrl_c_stops_the_answer_not_the_session() -> None:
    """Ctrl-C typed in the terminal reaches its whole process group, the local ring's
    workers too (the default --nodes): they leave it to the chat, whose answer stops."""
    child = _spawn("-n", "900", "--temperature", "0.8", "--seed", "3")
    child.sendline("Speak at length")
    child.expect(r"\S", timeout=60)  # the answer streams
    time.sleep(0.5)
    child.sendintr()
    child.expect_exact("[stopped]")
    child.expect_exact(">>> ")
    child.sendline("And now?")  # the session goes on, with the stopped answer in its history
    child.expect_exact(">>> ", timeout=120)
    child.sendeof()
    child.expect(pexpect_eof())
    child.close()
    assert child.exitstatus == 0


def test_one_message_streams_in_a_terminal() -> None:
    """``--message`` on a terminal (the default local ring): the answer's words keep coming
    for more than a second, while it is generated (not all at once at its end); Ctrl-C then
    ends the command with one line of its own after the text, status 130."""
    pexpect = pytest.importorskip("pexpect")
    child = pexpect.spawn(MDIEDGE[0], MDIEDGE[1:] + ["chat", "--message", "Speak at length",
                                                     "-n", "900", "--seed", "3"],
                          encoding="utf-8", timeout=90, env=dict(os.environ, COLUMNS="100"))
    shown, first_word = "", None
    while first_word is None or time.monotonic() - first_word < 1.0:
        try:
            shown += child.read_nonblocking(4096, timeout=90)
        except pexpect.EOF:
            break
        if first_word is None and any(c.isalnum() for c in shown):
            first_word = time.monotonic()
    assert child.isalive() and first_word is not None, shown  # 900 tokens take longer
    assert "mdiedge" not in shown and len(shown.split()) >= 2, shown  # the answer alone
    child.sendintr()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 130, child.before
    lines = [line.replace("^C", "") for line in (shown + child.before).split("\r\n")]
    assert lines[-2:] == ["mdiedge: error: interrupted", ""], lines[-3:]


def test_the_default_template_ends_an_answer_at_the_next_role() -> None:
    """A model without a chat template of its own (a base model such as Gemma 3 270M) goes
    on to write the next turn: under the default template an answer ends at a role's line;
    a model's own template ends answers with its own tokens, so it adds no stop."""
    from mdiedge.serving.api.chat import ChatTemplate
    from mdiedge.serving.api.schema import ChatMessage

    default = ChatTemplate()
    assert default.stops == ("\nUSER:", "\nASSISTANT:", "\nSYSTEM:")
    assert ChatTemplate("{{ messages[0]['content'] }}").stops == ()
    prompt = default.render([ChatMessage("user", "hi")])
    assert prompt.endswith("USER:\nhi\n\nASSISTANT:\n")
