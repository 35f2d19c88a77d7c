"""Where a model chunk's decode step runs, said and never silent: the compiled step
(``mdiedge.model._stepconstants``) or torch, for its blocks and its head, with the reason where
torch runs on the CPU (one line naming the family and the block)."""
from __future__ import annotations

from typing import Any, Dict, Optional

from .block import step_matrix


def decode_route(model: Any, step: Any) -> Dict[str, str]:
    """``blocks`` and ``head`` each ``step`` or ``torch`` (absent where the chunk ``model``, a
    ``Transformer``, has none), and ``reason`` where torch runs them; ``step``: the step
    module the model selected (compiled, or its twin)."""
    route: Dict[str, str] = {}
    reasons = []
    for part, refusal in (("blocks", _blocks_refusal), ("head", _head_refusal)):
        if part == "blocks" and not model.layers or part == "head" and not model.has_head:
            continue
        why = refusal(model, step)
        route[part] = "torch" if why else "step"
        if why:
            reasons.append(why)
    if reasons:
        route["reason"] = "; ".join(reasons)
    return route


def _cpu_refusal(model: Any, step: Any) -> Optional[str]:
    """Why nothing of ``model`` may run in the step, whatever its family; None if it may."""
    param = next(model.parameters(), None)
    if param is not None and param.device.type != "cpu":
        return f"on {param.device.type} (FP32 torch there)"
    if not step.PREFERRED:
        return "the compiled step is not built (its pure-Python twin runs)"
    return None


def _blocks_refusal(model: Any, step: Any) -> Optional[str]:
    family = model.family.name
    why = _cpu_refusal(model, step)
    if why is not None:
        return f"{family} blocks {why}"
    if not model.family.step_blocks:
        kind = " (mixture-of-experts blocks decode in torch)" if model.family.moe else ""
        return f"the compiled step does not run {family} blocks{kind}"
    if model.n_slots == 0:
        return f"{family} blocks: no KV cache set up"
    if model._step_weights():
        return None
    for index, block in model.layers.items():
        if block.step_weights(*model._tables(block.attn.window)) is None:
            return f"{family} block {index}: {block.step_refusal()}"
    return f"{family} blocks: the compiled step refuses them"


def _head_refusal(model: Any, step: Any) -> Optional[str]:
    why = _cpu_refusal(model, step)
    if why is not None:
        return f"head {why}"
    if not model.family.step_head:
        return f"the compiled step does not run the {model.family.name} head"
    if step_matrix(model.lm_head) is None:
        return "head: its weight is neither plain float32 nor a quantized type the step " \
               "multiplies"
    return None
