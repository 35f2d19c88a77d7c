"""Compressed links: frames encoded with each codec through both framing and codec
implementations, the link handshake's codec agreement (a mismatch is one line at set-up), a
frame in a codec the link did not agree on, and 3-node rings per codec: ``none`` token for
token the single process, fp16 and int8 running the exactness matrix's shapes, bytes and
frames per link counted."""
from __future__ import annotations

import socket
import threading
from pathlib import Path
from typing import Any, Dict, Iterator, List

import numpy as np
import pytest
import torch

from mdiedge.base.arrays import to_numpy
from mdiedge.runtime.framing import CODEC, FRAMING
from mdiedge.base.codecs import FP16, INT8, NONE, Compression, encoded_size
from mdiedge.base.errors import CodecMismatch, ConfigError, FrameError
from mdiedge.base.nodes import NodeSpec
from mdiedge.model.sampling import SamplingParams
from mdiedge.engine.local import LocalEngine
from mdiedge.roles.local_ring import LocalRing
from mdiedge.engine.ring import RingEngine
from mdiedge.runtime import framing, messages
from mdiedge.runtime.auth import Authenticator
from mdiedge.runtime.links import Link, accept_authenticated, connect_authenticated, tcp_listen
from mdiedge.runtime.messages import Message

pytestmark = pytest.mark.twins
GREEDY = SamplingParams(temperature=0)
PROMPT = "hello ring 1 the quick brown fox jumps hello ring 2 the quick brown fox"
PAIRS = [(f, c) for f in FRAMING.implementations() for c in CODEC.implementations()]


@pytest.mark.parametrize("framing_impl,codec_impl", PAIRS,
                         ids=[f"{f.__name__[-9:]}+{c.__name__[-7:]}" for f, c in PAIRS])
@pytest.mark.parametrize("codec", [NONE, FP16, INT8])
def test_a_frame_round_trips_into_the_callers_tensor(framing_impl: Any, codec_impl: Any,
                                                     codec: int) -> None:
    x = torch.randn(2, 7, 45)
    x[0, 0, :3] = torch.tensor([float("inf"), float("nan"), -float("inf")])
    out = np.full(tuple(x.shape), 99.0, dtype=np.float32)
    a, b = socket.socketpair()
    with a, b:
        sent = framing.send_tensor(a, framing.ACTIVATION, [4, 5], [0, 0], x, framing.FLAG_PREFILL,
                                   seq=3, impl=framing_impl, codec=codec, codec_impl=codec_impl)
        header, got = framing.recv_frame(b, 1 << 20, out=out, impl=framing_impl,
                                         codec_impl=codec_impl)
    assert got is out and framing.codec_of(header.flags) == codec
    got = torch.from_numpy(got)
    assert sent == framing.frame_bytes(header) == 48 + 16 + encoded_size(codec, x.numel())
    assert torch.equal(torch.isnan(got), torch.isnan(x))
    finite = torch.isfinite(x)
    assert torch.equal(got[~finite & ~torch.isnan(x)], x[~finite & ~torch.isnan(x)])
    tolerance = {NONE: 0.0, FP16: 2e-3, INT8: 0.05}[codec]
    assert (got[finite] - x[finite]).abs().max() <= tolerance * x[finite].abs().max()


def test_other_dtypes_go_as_they_are() -> None:
    x = torch.randn(1, 2, 32).to(torch.bfloat16)
    a, b = socket.socketpair()
    with a, b:
        messages.send(a, Message(messages.ACTIVATION, [0], [0], x), Compression("int8", "int8"))
        message, size = messages.receive(b, 1 << 20, Compression("int8", "int8"))
    assert np.array_equal(message.hidden, to_numpy(x)) and size == 48 + 8 + 128


def test_a_frame_in_another_codec_than_agreed_is_a_frame_error() -> None:
    a, b = socket.socketpair()
    with a, b:
        messages.send(a, Message(messages.ACTIVATION, [0], [0], torch.ones(1, 3, 32),
                                 prefill=True), Compression("int8", "fp16"))
        with pytest.raises(FrameError, match="a prefill frame in codec int8 on a link that "
                                             "agreed on fp16"):
            messages.receive(b, 1 << 20, Compression("fp16", "fp16"))


def handshake(ours: str, theirs: str) -> Dict[str, Any]:
    """Accept with ``ours`` and connect with ``theirs``; what each end raised."""
    auth = Authenticator(b"0123456789abcdef-secret")
    results: Dict[str, Any] = {}
    with tcp_listen("127.0.0.1", 0) as listener:
        port = listener.getsockname()[1]

        def accept() -> None:
            try:
                results["accept"] = accept_authenticated(listener, auth, 5.0, "test",
                                                         codecs=Compression.parse(ours))
            except Exception as e:
                results["accept"] = e

        thread = threading.Thread(target=accept)
        thread.start()
        try:
            results["connect"] = connect_authenticated("127.0.0.1", port, auth, "peer",
                                                       retry_s=3.0,
                                                       codecs=Compression.parse(theirs))
        except Exception as e:
            results["connect"] = e
        thread.join(10)
    for link in results.values():
        if isinstance(link, Link):
            link.close()
    return results


def test_the_handshake_agrees_on_the_codecs() -> None:
    ends = handshake("int8:fp16", "int8:fp16")
    assert all(isinstance(s, Link) and s.keys is not None for s in ends.values())


def test_a_codec_mismatch_is_one_line_at_set_up_on_both_ends() -> None:
    ends = handshake("int8", "fp16")
    assert isinstance(ends["connect"], CodecMismatch)
    assert str(ends["connect"]) == ("data link to peer: codec mismatch: this node uses fp16, "
                                    "the other end int8")
    assert isinstance(ends["accept"], CodecMismatch)
    assert str(ends["accept"]).endswith("codec mismatch: this node uses int8, the other end fp16")


def test_bad_compression_values_are_refused(ring_model: Path) -> None:
    with pytest.raises(ConfigError, match="'int4' is not a codec"):
        RingEngine([NodeSpec("w1", "127.0.0.1", 1)], ring_model, compression="int4")
    with pytest.raises(ConfigError, match="compression of 'w1' 'int8:'"):
        RingEngine([NodeSpec("w1", "127.0.0.1", 1, compression="int8:")], ring_model)
    from mdiedge.runtime.protocol import ConnectRequest

    with pytest.raises(ValueError, match="field 'codecs_in' 'int9'"):
        ConnectRequest.from_json({"next_host": "h", "next_port": 1, "codecs_in": "int9"})


# ------------------------------------------------------------------- 3-node rings per codec

@pytest.fixture(scope="module")
def workers() -> Iterator[Any]:
    local = LocalRing(2, threads=1)
    with local as specs:
        yield local, specs


def run_ring(workers: Any, model: Path, compression: str, cases: List[Any],
             **options: Any) -> Any:
    local, specs = workers
    engine = RingEngine(specs, model, timeout_s=30, secret=local.secret,
                        compression=compression, **options)
    try:
        outs = [engine.generate(PROMPT, 12, n, GREEDY, micro_batch=m) for n, m in cases]
        return outs, engine.starter.link_stats()
    finally:
        engine.close()


MATRIX = [(1, 0), (3, 0), (5, 2), (8, 8)]


def test_none_is_token_identical_and_counts_every_link(workers: Any, ring_model: Path) -> None:
    reference = LocalEngine(ring_model)
    outs, links = run_ring(workers, ring_model, "none", MATRIX)
    for (n, m), out in zip(MATRIX, outs):
        want = reference.generate(PROMPT, 12, n, GREEDY)
        assert [s["token_ids"] for s in out.samples] == [s["token_ids"] for s in want.samples]
    assert [(l["from"], l["to"], l["codec"]) for l in links] == \
        [("starter", "w1", "none"), ("w1", "w2", "none"), ("w2", "starter", "none")]
    assert all(l["frames"] > 0 and l["bytes"] > 48 * l["frames"] for l in links)


@pytest.mark.parametrize("compression", ["fp16", "int8", "int8:fp16"])
def test_compressed_rings_run_the_matrix_with_fewer_bytes(workers: Any, ring_model: Path,
                                                          compression: str) -> None:
    base_outs, base = run_ring(workers, ring_model, "none", [(4, 0)])
    outs, links = run_ring(workers, ring_model, compression, MATRIX[:3] + [(4, 0)])
    for (n, _), out in zip(MATRIX[:3] + [(4, 0)], outs):
        assert len(out.samples) == n and all(len(s["token_ids"]) == 12 for s in out.samples)
    assert {l["codec"] for l in links} == {compression}
    # the same request (4 samples, 12 tokens) once more, alone, to compare its bytes
    _, alone = run_ring(workers, ring_model, compression, [(4, 0)])
    ratio = base[0]["bytes"] / alone[0]["bytes"]
    assert ratio > {"fp16": 1.5, "int8": 2.0, "int8:fp16": 1.5}[compression], (base, alone)


def test_a_worker_may_name_its_own_link_codec_and_prefill_is_chunked(workers: Any,
                                                                     ring_model: Path) -> None:
    import dataclasses

    local, specs = workers
    mixed = [dataclasses.replace(specs[0], compression="int8"), specs[1]]
    engine = RingEngine(mixed, ring_model, timeout_s=30, secret=local.secret,
                        compression="fp16", max_payload=32 * 4 * 3)  # 3 tokens a frame
    try:
        out = engine.generate(PROMPT, 8, 2, GREEDY)
        links = engine.starter.link_stats()
    finally:
        engine.close()
    assert all(len(s["token_ids"]) == 8 for s in out.samples)
    assert [l["codec"] for l in links] == ["int8", "fp16", "fp16"]
