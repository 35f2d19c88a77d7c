"""A port already in use is one line naming the address, the port and which port it is: for
the control plane, the data plane and the ``mdiedge worker`` command."""
from __future__ import annotations

import errno
import socket
import subprocess
from typing import Iterator

import pytest

from mdiedge.base.errors import ListenError, MdiedgeError
from mdiedge.runtime.control import ControlServer
from mdiedge.runtime.links import tcp_listen
from commands import MDIEDGE


@pytest.fixture
def taken() -> Iterator[int]:
    """A port some other socket listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        yield sock.getsockname()[1]


def test_control_port_in_use(taken: int) -> None:
    with pytest.raises(ListenError) as raised:
        ControlServer("127.0.0.1", taken, {})
    assert str(raised.value) == (f"cannot listen on 127.0.0.1:{taken} (control port): "
                                 f"address already in use")
    assert raised.value.errno == errno.EADDRINUSE
    assert isinstance(raised.value, (MdiedgeError, OSError))


def test_data_port_in_use(taken: int) -> None:
    with pytest.raises(ListenError, match=f"^cannot listen on 127.0.0.1:{taken} \\(data port\\): "
                                          f"address already in use$"):
        tcp_listen("127.0.0.1", taken)


def test_address_not_of_this_machine() -> None:
    with pytest.raises(ListenError, match=r"^cannot listen on 192\.0\.2\.1:7 \(control port\): "
                                          r"cannot assign requested address$"):
        ControlServer("192.0.2.1", 7, {})  # TEST-NET-1: never a local address


def test_ipv6_address_is_bracketed() -> None:
    error = ListenError("::1", 7700, "data port", OSError(errno.EADDRINUSE, "Address already in use"))
    assert str(error) == "cannot listen on [::1]:7700 (data port): address already in use"


def test_worker_command_names_the_port(taken: int) -> None:
    out = subprocess.run([*MDIEDGE, "worker", "--no-config",
                          "--control-port", str(taken), "--data-port", "0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert out.stderr.strip() == (f"mdiedge: error: cannot listen on 127.0.0.1:{taken} "
                                  f"(control port): address already in use"), out.stderr
    assert out.stdout == ""
