"""Ctrl-C held back while code loads (mdiedge.base.interrupts)."""
from __future__ import annotations

import os
import signal
import threading
from typing import Iterator, List

import pytest

from mdiedge.base import interrupts


@pytest.fixture(autouse=True)
def python_handler() -> Iterator[None]:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    interrupts._pressed.clear()
    signal.signal(signal.SIGINT, signal.default_int_handler)


def press() -> None:
    os.kill(os.getpid(), signal.SIGINT)
    for _ in range(99):  # the handler runs at the next check of the interpreter's loop
        pass


def test_a_held_ctrl_c_is_raised_on_release_once() -> None:
    assert interrupts.hold()
    press()
    with pytest.raises(KeyboardInterrupt):
        interrupts.release()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    interrupts.release()  # nothing pressed since: nothing raised


def test_release_without_a_press_only_puts_the_handler_back() -> None:
    assert interrupts.hold()
    interrupts.release()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with pytest.raises(KeyboardInterrupt):
        press()


def test_held_raises_after_the_block_and_an_inner_hold_leaves_the_outer() -> None:
    done: List[str] = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts.held():
            with interrupts.held():
                press()
                done.append("inner")
            done.append("outer")  # the inner block ended without raising
    assert done == ["inner", "outer"]


def test_a_command_s_own_handler_is_kept() -> None:
    seen: List[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
    assert not interrupts.hold()
    with interrupts.held():
        press()
    assert seen == [signal.SIGINT]


def test_off_the_main_thread_nothing_is_held() -> None:
    held: List[bool] = []
    thread = threading.Thread(target=lambda: held.append(interrupts.hold()))
    thread.start()
    thread.join()
    assert held == [False] and signal.getsignal(signal.SIGINT) is signal.default_int_handler
