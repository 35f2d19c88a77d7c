"""The CUDA path in FP32 (Jetson boards run it): the same tokens as the CPU for the single
process, N in-process stages and a ring whose nodes compute on the GPU. Skipped without CUDA."""
from __future__ import annotations

from pathlib import Path
from typing import Any, List

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("CUDA is not available here", allow_module_level=True)

from mdiedge.model.sampling import SamplingParams  # noqa: E402
from mdiedge.engine.local import LocalEngine  # noqa: E402
from mdiedge.roles.local_ring import LocalRing  # noqa: E402
from mdiedge.engine.ring import RingEngine  # noqa: E402

GREEDY = SamplingParams(temperature=0)
SAMPLED = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=11)
PROMPT = "hello ring"


def tokens(out: Any) -> List[List[int]]:
    return [s["token_ids"] for s in out.samples]


@pytest.fixture(scope="module")
def cpu_reference(ring_model: Path) -> LocalEngine:
    return LocalEngine(ring_model)


@pytest.mark.parametrize("stages", [1, 3])
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_cuda_stages_equal_the_cpu(ring_model: Path, cpu_reference: LocalEngine, stages: int,
                                   params: SamplingParams) -> None:
    engine = LocalEngine(ring_model, device="cuda", stages=stages)
    assert engine.model.lm_head.weight.device.type == "cuda"
    assert engine.model.lm_head.weight.dtype == torch.float32
    want = tokens(cpu_reference.generate(PROMPT, 24, 3, params))
    assert tokens(engine.generate(PROMPT, 24, 3, params, micro_batch=2)) == want


def test_a_ring_on_the_gpu_equals_the_cpu(ring_model: Path, cpu_reference: LocalEngine) -> None:
    want = tokens(cpu_reference.generate(PROMPT, 24, 4, SAMPLED))
    local = LocalRing(2, device="cuda")
    with local as workers:
        engine = RingEngine(workers, ring_model, device="cuda", secret=local.secret)
        try:
            got = tokens(engine.generate(PROMPT, 24, 4, SAMPLED, micro_batch=2))
            devices = [n.device for n in engine.starter.node_status()]
        finally:
            engine.close()
    assert got == want and devices == ["cuda", "cuda"]


def test_a_gpu_ring_recovers_from_a_killed_worker(ring_model: Path,
                                                  cpu_reference: LocalEngine) -> None:
    """A worker of a GPU ring killed mid-generation: its layers move to the survivor (on the
    GPU too), the replay refills the caches, and the tokens still equal the CPU's."""
    import os
    import signal

    want = tokens(cpu_reference.generate(PROMPT, 24, 4, SAMPLED))
    local = LocalRing(2, device="cuda")
    with local as workers:
        engine = RingEngine(workers, ring_model, device="cuda", secret=local.secret, stall_s=2.0)
        count = [0]

        def on_token(index: int, token: int) -> None:
            count[0] += 1
            if count[0] == 10:
                os.kill(local.processes[0].pid, signal.SIGKILL)

        try:
            out = engine.generate(PROMPT, 24, 4, SAMPLED, micro_batch=2, on_token=on_token)
            devices = [n.device for n in engine.starter.node_status() if n.state != "down"]
        finally:
            engine.close()
    assert tokens(out) == want and [r.nodes for r in out.recoveries] == [["w1"]]
    assert devices == ["cuda"]


@pytest.mark.parametrize("name", ["tiny-llama-2x256-Q4_K_M.gguf", "tiny-llama-2x256-Q6_K.gguf"])
def test_gguf_blocks_stay_quantized_on_the_gpu(name: str) -> None:
    """A GGUF file's blocks move to the GPU as the file holds them (uint8), each product
    widens its weight there in float32: the CPU kernels' greedy tokens."""
    from mdiedge.model.qlayers import QuantLinear

    file = Path(__file__).parent / "data" / "gguf" / name
    gpu = LocalEngine(file, device="cuda")
    held = [m.qweight for m in gpu.model.modules() if isinstance(m, QuantLinear)]
    assert held and all(q.device.type == "cuda" and q.dtype == torch.uint8 for q in held)
    want = LocalEngine(file).generate(PROMPT, max_new_tokens=24, params=GREEDY)
    assert tokens(gpu.generate(PROMPT, max_new_tokens=24, params=GREEDY)) == tokens(want)
