"""The shipped default model: transformers agrees with mdiedge, and the main command writes
something shaped like a play."""
from __future__ import annotations

import json
import re
import subprocess

import torch

from mdiedge.model.checkpoint import load_model
from mdiedge.base.defaults import default_model_path
from commands import MDIEDGE


def test_transformers_loads_it_and_logits_match() -> None:
    from transformers import LlamaForCausalLM

    path = default_model_path()
    ref = LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    ours = load_model()
    ours.setup_cache(1, 64)
    ids = torch.tensor([[1, 100, 200, 300, 400, 13, 500, 600, 700, 800]])
    with torch.no_grad():
        theirs = ref(ids).logits[0]
        mine = ours(ids, torch.tensor([0]), [0], all_logits=True)[0]
    assert (mine - theirs).abs().max().item() <= 1e-4


def test_main_command_writes_play_dialogue() -> None:
    out = subprocess.run([*MDIEDGE, "generate", "ROMEO:", "-n", "800",
                          "--json", "--seed", "1"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["nodes"] == 3
    sample = result["samples"][0]
    assert len(sample["token_ids"]) >= 700 or sample["finish_reason"] == "eos"
    text = "ROMEO:" + sample["text"]
    speakers = re.findall(r"^[A-Z][A-Za-z ]+:$|^[A-Z][A-Z ]+:", text, flags=re.M)
    assert len(speakers) >= 3, text[:500]
    assert text.count("\n") >= 20
