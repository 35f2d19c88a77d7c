"""The final norm and head in one call (``logits`` of ``ext/_cstep.pyx`` and its twin
``mdiedge/model/_pystep.py``): equal to the model's torch head within float32 rounding,
a row's logits independent of the rows beside it and of the thread count (compiled), the
model's head taking it only where it applies, and argument checks quoting the value."""
from __future__ import annotations

from types import ModuleType
from typing import Any, Dict

import pytest
import torch
import torch.nn.functional as F

from mdiedge.model._stepconstants import STEP_ROWS
from mdiedge.model.transformer import STEP
from mdiedge.model import transformer as transformer_module
from mdiedge.model.config import ModelConfig
from mdiedge.model.layers import rms_norm
from mdiedge.model.transformer import Transformer
from tolerance import assert_close

pytestmark = pytest.mark.twins
IMPLS = STEP.implementations()
EPS = 1e-5


@pytest.fixture(params=IMPLS, ids=[m.__name__ for m in IMPLS])
def impl(request: pytest.FixtureRequest) -> Any:
    return request.param


def head_inputs(rows: int, dim: int = 44, vocab: int = 70, seed: int = 0) -> Dict[str, Any]:
    """Widths that are not multiples of 8 (dim) or of the kernel's 4 columns (vocab)."""
    g = torch.Generator().manual_seed(seed)
    return {"norm": torch.rand(dim, generator=g) + 0.5, "eps": EPS,
            "head": torch.randn(vocab, dim, generator=g),
            "x": torch.randn(rows, dim, generator=g) * 3, "out": torch.empty(rows, vocab),
            "threads": 2}


def reference(args: Dict[str, Any]) -> torch.Tensor:
    return F.linear(rms_norm(args["x"], args["norm"], EPS), args["head"])


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 8])
@torch.no_grad()
def test_logits_equal_the_torch_head(impl: ModuleType, rows: int) -> None:
    args = head_inputs(rows, seed=rows)
    impl.logits(**args)
    assert_close(args["out"], reference(args), 2 * args["x"].shape[1])  # the norm, the head


@torch.no_grad()
def test_row_logits_do_not_depend_on_batch_or_threads() -> None:
    if len(IMPLS) < 2:
        pytest.skip("the compiled module is not built")
    compiled = IMPLS[1]
    batch = head_inputs(8)
    compiled.logits(**batch)
    for threads in (1, 3):
        for r in range(8):
            alone = dict(batch, x=batch["x"][r:r + 1].clone(), out=torch.empty(1, 70),
                         threads=threads)
            compiled.logits(**alone)
            assert torch.equal(alone["out"][0], batch["out"][r])


@pytest.mark.parametrize("change, message", [
    (lambda a: a.update(threads=0), "threads 0 is not >= 1"),
    (lambda a: a.update(out=torch.empty(2, 70)), "out (2, 70) torch.float32 is not"),
    (lambda a: a.update(out=torch.empty(1, 70, dtype=torch.float64)), "out (1, 70) torch.float64"),
    (lambda a: a.update(x=torch.zeros(STEP_ROWS + 1, 44)), f"logits of x ({STEP_ROWS + 1}, 44)"),
    (lambda a: a.update(x=torch.zeros(1, 40)), "logits of x (1, 40) by norm (44,)"),
    (lambda a: a.update(head=torch.zeros(44, 70).t()), "head (70, 44)"),
    (lambda a: a.update(head=torch.zeros(70, 44, dtype=torch.float64)), "head (70, 44)"),
    (lambda a: a.update(norm=torch.zeros(2, 22)), "by norm (2, 22)"),
])
@torch.no_grad()
def test_bad_arguments_quote_the_value(impl: ModuleType, change: Any, message: str) -> None:
    args = head_inputs(1)
    change(args)
    args["out"].fill_(7.0)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        impl.logits(**args)
    assert torch.all(args["out"] == 7.0)  # nothing written


def test_a_gradient_is_refused(impl: ModuleType) -> None:
    args = head_inputs(1)
    args["head"].requires_grad_(True)
    with pytest.raises(ValueError, match="no gradient"):
        impl.logits(**args)


def test_the_head_takes_it_only_where_it_applies(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode rows (strided or not, up to STEP_ROWS) take the call; more rows, every
    position's logits and a head kept transposed take torch's; all agree."""
    compiled = IMPLS[-1]
    calls = []

    class Counting:
        PREFERRED, MAX_ROWS = True, compiled.MAX_ROWS
        logits_usable = staticmethod(compiled.logits_usable)

        @staticmethod
        def logits(*args: Any) -> None:
            calls.append(args[3].shape[0])
            compiled.logits(*args)

    torch.manual_seed(0)
    net = Transformer(ModelConfig(vocab_size=70, dim=44, n_layers=1, n_heads=2,
                                  n_kv_heads=1, intermediate_size=52, max_seq_len=16)).eval()
    hidden = torch.randn(9, 3, 44)  # (B, T, dim)
    cases = [(hidden[:4, -1], [4]), (hidden[0, :1], [1]), (hidden[:, -1], [9]), (hidden, []),
             (torch.randn(STEP_ROWS + 1, 44), [])]
    with torch.inference_mode():
        for x, taken in cases:
            expected = net.lm_head(net.norm(x)).float()  # torch's own
            with monkeypatch.context() as m:
                m.setattr(transformer_module, "_step", Counting)
                calls.clear()
                got = net.head_logits(x)
            assert calls == taken
            assert_close(got, expected, 2 * net.cfg.dim)  # the norm, the head
        net.lm_head.weight = torch.nn.Parameter(net.lm_head.weight.detach().t().contiguous().t())
        monkeypatch.setattr(transformer_module, "_step", Counting)
        calls.clear()
        net.head_logits(hidden[:2, -1])
        assert calls == []
