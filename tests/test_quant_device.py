"""The CUDA path of quantized layers, checked where no GPU is: ``quant.dequantize_on_device``'s torch
de-quantizer equals the reference one value for value for every kernel type, and a GGUF model
whose products take the device branch (``qlayers.widens_on_device`` forced: each weight
widened with torch operations, then one float32 product) gives the CPU kernels' logits and
greedy tokens, for files of gguf's own types and llama-quantize's K-quants. ``test_cuda.py``
runs the same on a GPU where there is one."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

from conftest import make_hf_llama
from gguf_files import write_gguf
from mdiedge.model import qlayers, quant
from mdiedge.model import transformer as transformer_module
from mdiedge.model.checkpoint import load_model
from mdiedge.model.quant import dequantize_on_device
from quantblocks import random_blocks
from mdiedge.model.sampling import SamplingParams
from mdiedge.base.request import ids_request
from mdiedge.runtime.generation import Generation
from mdiedge.runtime.scheduler import run_single
from tolerance import assert_close, model_path_length

DATA = Path(__file__).parent / "data" / "gguf"


@pytest.mark.parametrize("qtype", quant.KERNEL_TYPES)
def test_the_device_dequantizer_equals_the_reference(qtype: str) -> None:
    width = quant.TYPES[qtype].block * 3
    raw = random_blocks(qtype, 7, width, seed=len(qtype), low=0, high=0.05)
    assert torch.equal(dequantize_on_device(raw, qtype, width),
                       quant.dequantize(raw, qtype, width))


def test_rows_that_do_not_hold_the_width_are_refused() -> None:
    with pytest.raises(ValueError, match=r"Q8_0 rows \(2, 34\) torch.uint8 do not hold 64"):
        dequantize_on_device(torch.zeros(2, 34, dtype=torch.uint8), "Q8_0", 64)


@pytest.fixture(scope="module")
def files(tmp_path_factory: Any) -> Dict[str, Path]:
    """A tiny model as gguf writes it (Q8_0, Q4_0, Q4_1), and llama-quantize's K-quants."""
    root = tmp_path_factory.mktemp("device")
    hf = make_hf_llama(root / "hf", seed=5, intermediate_size=64)
    out = {q: write_gguf(root / f"tiny-{q}.gguf", hf, q) for q in ("Q8_0", "Q4_0", "Q4_1")}
    out.update({p.stem.rsplit("-", 1)[-1]: p for p in DATA.glob("*.gguf")})
    return out


def run(net: Any, prompt: List[int], steps: int) -> List[int]:
    gen = Generation(ids_request(prompt, steps, 1, SamplingParams(temperature=0), 64), ())
    run_single(net, gen)
    return list(gen.samples[0].tokens)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "Q4_K_M", "Q6_K"])
def test_the_device_branch_gives_the_kernels_results(files: Dict[str, Path], kind: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    net = load_model(files[kind])
    held = [m for m in net.modules() if isinstance(m, qlayers.QuantLinear)]
    assert held, "the file's blocks are kept"
    prompt = [1] + torch.randint(3, net.cfg.vocab_size, (11,),
                                 generator=torch.Generator().manual_seed(2)).tolist()
    net.setup_cache(1, 64)
    with torch.inference_mode():
        want = net(torch.tensor([prompt]), torch.tensor([0]), [0], all_logits=True)
    tokens = run(net, prompt, 8)
    monkeypatch.setattr(qlayers, "widens_on_device", lambda held: True)

    class TorchPath:  # the compiled step reads CPU blocks: keep every block in torch
        PREFERRED = False
    monkeypatch.setattr(transformer_module, "_step", TorchPath)
    net.setup_cache(1, 64)
    with torch.inference_mode():
        got = net(torch.tensor([prompt]), torch.tensor([0]), [0], all_logits=True)
    assert_close(got, want, model_path_length(net.cfg))
    assert run(net, prompt, 8) == tokens


def test_the_blocks_are_swapped_in_one_pass(files: Dict[str, Path],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading walks the tensor plan once (once per tensor made loading quadratic: seconds
    for SmolLM2's 272 tensors)."""
    calls = []
    keep = qlayers.keep_quantized
    monkeypatch.setattr(qlayers, "keep_quantized", lambda *a: calls.append(1) or keep(*a))
    load_model(files["Q8_0"])
    assert len(calls) == 1
