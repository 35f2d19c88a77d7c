"""bin/widen-gguf: a quantized GGUF file's weights de-quantized to F32, metadata kept."""
from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import torch

gguf = pytest.importorskip("gguf")

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "tests" / "data" / "gguf" / "tiny-llama-2x256-Q6_K.gguf"


def test_the_widened_file_is_f32_and_computes_what_the_quantized_one_does(tmp_path: Path) -> None:
    from mdiedge.model.checkpoint import load_model

    out = tmp_path / "tiny-f32.gguf"
    runpy.run_path(str(ROOT / "bin" / "widen-gguf"))["widen"](SOURCE, out)
    before, after = gguf.GGUFReader(SOURCE), gguf.GGUFReader(out)
    assert {t.tensor_type for t in after.tensors} == {gguf.GGMLQuantizationType.F32}
    assert any(t.tensor_type == gguf.GGMLQuantizationType.Q6_K for t in before.tensors)
    assert [t.name for t in after.tensors] == [t.name for t in before.tensors]
    kept = set(before.fields) - {gguf.Keys.General.FILE_TYPE}
    assert all(after.fields[k].contents() == before.fields[k].contents() for k in kept
               if not k.startswith("GGUF."))
    ids = torch.tensor([[1, 908, 1721, 783, 1387, 146]])
    logits = []
    for path in (SOURCE, out):
        model = load_model(path)
        model.setup_cache(1, 16)
        with torch.no_grad():
            logits.append(model(ids, torch.tensor([0]), [0], all_logits=True)[0])
    quantized, widened = logits
    torch.testing.assert_close(widened, quantized, rtol=1e-4, atol=1e-4)
