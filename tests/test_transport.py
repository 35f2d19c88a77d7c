"""The data-plane threads of ``mdiedge.runtime.links``: the Sender's order and inline sends."""
from __future__ import annotations

import socket
import threading
from typing import Iterator, List, Tuple

import numpy as np
import pytest
import torch

from mdiedge.runtime import framing
from mdiedge.runtime import messages
from mdiedge.runtime.links import Sender
from mdiedge.runtime.messages import Message


@pytest.fixture()
def pair() -> Iterator[Tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    b.settimeout(10)
    yield a, b
    a.close()
    b.close()


def frame(seq: int, width: int) -> Message:
    return Message(messages.ACTIVATION, [seq], [0], torch.full((1, 1, width), float(seq)), seq=seq)


def test_a_small_frame_goes_out_on_the_callers_thread(pair) -> None:
    a, b = pair
    sender = Sender(a, "test/send")  # never started: only an inline send can deliver
    sender.put(frame(1, 16))
    header, tensor = framing.recv_frame(b, 1 << 20)
    assert header.seq == 1 and np.array_equal(tensor, np.full((1, 1, 16), 1.0, dtype=np.float32))


def test_frames_queued_behind_a_large_one_keep_their_order(pair) -> None:
    a, b = pair
    sender = Sender(a, "test/send", inline_max_bytes=1024)
    sender.put(frame(1, 4096))  # too large to send inline: queued
    sender.put(frame(2, 16))  # small, but frame 1 is not on the wire yet: queued behind it
    sender.put(Message(messages.RELEASE, [3], [0], seq=3))
    b.settimeout(0.2)
    with pytest.raises(socket.timeout):
        b.recv(1, socket.MSG_PEEK)
    b.settimeout(10)
    sender.start()
    got: List[int] = []
    for _ in range(3):
        header, _ = framing.recv_frame(b, 1 << 20)
        got.append(header.seq)
    sender.close()
    assert got == [1, 2, 3] and not sender.is_alive()


def test_order_holds_under_concurrent_inline_and_queued_sends(pair) -> None:
    a, b = pair
    sender = Sender(a, "test/send", inline_max_bytes=256)
    sender.start()
    n = 300
    got: List[int] = []

    def read() -> None:
        for _ in range(n):
            header, tensor = framing.recv_frame(b, 1 << 22)
            assert tensor is not None and float(tensor.flatten()[0]) == header.seq
            got.append(header.seq)

    reader = threading.Thread(target=read)
    reader.start()
    for seq in range(n):  # every fifth frame is large (queued), the rest small (inline if idle)
        sender.put(frame(seq, 50_000 if seq % 5 == 0 else 8))
    reader.join(timeout=30)
    sender.close()
    assert got == list(range(n))


def test_a_send_error_is_remembered_and_later_frames_are_dropped(pair) -> None:
    a, b = pair
    b.close()
    sender = Sender(a, "test/send")
    sender.start()
    for seq in range(4):
        sender.put(frame(seq, 16))
    sender.close()
    assert sender.error is not None and sender.error.startswith("send failed")
    assert not sender.is_alive()
