"""``mdiedge bench --profile``: each node's decode step by category, with the model's own code
timed in place and left as it was."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

from mdiedge.model import block, layers, transformer
from mdiedge.tools.profile import CATEGORIES, profile_ring, table_lines
from commands import MDIEDGE


def test_profile_of_a_two_node_ring(ring_model: Path) -> None:
    def patched() -> tuple:
        return (layers.project, layers.RMSNorm.forward,
                block.apply_rope, block.attention, block.KVCache.update,
                transformer._step.block, transformer._step.blocks, transformer._step.logits)

    originals = patched()
    profiles = profile_ring(ring_model, 2, 3, context=32, steps=2)
    assert [p["node"] for p in profiles] == [0, 1]
    assert profiles[0]["blocks"][0] == 0 and profiles[0]["blocks"][1] == profiles[1]["blocks"][0]
    for p in profiles:
        assert p["rows"] == 3 and p["step_ms"] > 0
        assert all(p[c] >= 0 for c in CATEGORIES)
        if transformer._step.PREFERRED:  # the blocks decode through the compiled step
            assert p["block step"] > 0 and p["attention"] == 0 and p["rope"] == 0
            # the starter's final norm and head are one call too
            assert p["projections"] == 0 and p["norms"] == 0
            assert (p["head step"] > 0) == (p["node"] == 0)
        else:
            assert p["block step"] == 0 and p["head step"] == 0
            assert p["projections"] > 0 and p["attention"] > 0
    assert profiles[0]["sampling"] > 0 and profiles[1]["sampling"] == 0
    assert patched() == originals
    lines = table_lines(profiles)
    assert lines[0].split()[:4] == ["node", "blocks", "rows", "step"] and len(lines) == 3


def test_cli_profile_json_and_bad_rows(ring_model: Path) -> None:
    run = [*MDIEDGE, "bench", "--profile", "--model", str(ring_model),
           "--nodes", "2", "--samples", "2", "--context", "32"]
    out = subprocess.run(run + ["--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert [(p["node"], p["rows"]) for p in result["profiles"]] == [(0, 1), (1, 1), (0, 2), (1, 2)]
    bad = subprocess.run(run[:-4] + ["--samples", "9"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines()[-1].endswith("--samples: expected an integer 1..8 "
                                                        "(rows of a decode step), got 9")
