"""The one way to open an engine, for the CLI, the API, the long-lived starter and the tools:
``open_text`` opens the model's text side once (config, tokenizer, the config against the weights'
headers) so a command can check its request before any node starts; ``open_engine`` builds on it, so
the tokenizer loads once. The engine owns what it started: ``close`` stops a local ring's workers.
"""
from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence

from ..base import defaults
from ..base.accel import warn_if_uncompiled
from ..base.engineoptions import EngineOptions, torch_option
from ..base.errors import ConfigError, MdiedgeError, UsageError
from ..base.nodes import NodeSpec, StarterOptions
from ..base.threads import available_cores, node_threads, use_threads
from .engine import Engine, PathLike, TextModel

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ..model.earlyexit.files import ExitSettings
    from ..roles.starter import Route


@dataclass(frozen=True)
class EngineSpec(EngineOptions):
    """Which engine to open and how: the command line's ``EngineOptions`` (ring options given win
    over a ring file's) and where the blocks run. ``nodes`` 1: this process; N > 1: a local ring of
    N - 1 workers (``spares`` more; ``respawn``). ``ring``: a ring file of running workers.
    ``workers``: running workers with the starter's ``options`` (a long-lived starter). ``route``:
    where each link connects (tests, the relay tool). ``timeout_s`` None: the ring file's, else a
    local ring's."""

    model: Optional[PathLike] = None
    tokenizer: Optional[PathLike] = None
    nodes: int = 1
    workers: Sequence[NodeSpec] = ()
    options: StarterOptions = StarterOptions()
    respawn: bool = False
    route: "Optional[Route]" = None
    timeout_s: Optional[float] = None

    def given_ring_options(self) -> Dict[str, Any]:
        given = super().given_ring_options()
        return given if self.timeout_s is None else dict(given, timeout_s=self.timeout_s)

    @property
    def local(self) -> bool:
        return self.ring is None and not self.workers and self.nodes == 1


def check_spec(spec: EngineSpec) -> None:
    """Device, dtype and ring size, before any file is read."""
    if spec.ring is None and not spec.workers and spec.nodes < 1:
        raise UsageError(f"--nodes: expected an integer >= 1, got {spec.nodes}")
    needs = torch_option(spec.device, spec.dtype)
    if needs is not None:  # cpu in float32 needs no torch
        from ..base.torchcheck import require_torch
        from ..model.devices import parse_device, parse_dtype

        require_torch(needs)
        parse_device(spec.device), parse_dtype(spec.dtype)
    if spec.speculate not in (None, "off"):
        from ..runtime.drafting import parse_speculate

        parse_speculate(spec.speculate)
        if spec.early_exit is not None:
            raise UsageError(f"--speculate {spec.speculate}: not together with --early-exit "
                             f"{spec.early_exit} (a verification step scores every block)")


def check_draft(speculate: Optional[str], text: TextModel) -> None:
    """A ``draft:PATH`` model shares the target's vocabulary (ConfigError quoting both), from its
    config before any node starts."""
    if speculate in (None, "off"):
        return
    from ..model.hub import resolve_model
    from ..model.modelfile import model_file
    from ..runtime.drafting import parse_speculate

    kind, arg = parse_speculate(speculate)
    if kind != "draft":
        return
    try:
        cfg = model_file(resolve_model(arg)).cfg
    except MdiedgeError as e:
        raise ConfigError(f"--speculate {speculate}: {e}") from None
    if (cfg.vocab_size, cfg.bos_id) != (text.cfg.vocab_size, text.cfg.bos_id):
        raise ConfigError(f"draft model {arg!r}: vocabulary {cfg.vocab_size} (bos "
                          f"{cfg.bos_id}) is not the target's {text.cfg.vocab_size} (bos "
                          f"{text.cfg.bos_id}); a draft shares the tokenizer")


def open_text(spec: EngineSpec) -> TextModel:
    """No weights; its config checked against the weights' headers."""
    from ..model.cpuload import check_checkpoint

    text = TextModel(spec.model, spec.tokenizer)
    check_checkpoint(text.path, text.cfg)
    return text


def exit_settings_of(text: TextModel, criterion: Optional[str],
                     threshold: Optional[str]) -> "Optional[ExitSettings]":
    """None without a criterion."""
    if criterion is None:
        return None
    from ..model.earlyexit.files import exit_settings

    return exit_settings(text.path, text.cfg, text.file.content_hash(), criterion, threshold)


def open_engine(spec: EngineSpec, text: Optional[TextModel] = None) -> Engine:
    """Nothing set up yet on a ring (the first request does it, or ``Engine.set_up``); ``text``:
    from ``open_text``, the spec checked. Workers it starts are stopped by the engine's ``close``,
    or here when opening fails."""
    if text is None:
        check_spec(spec)
        text = open_text(spec)
    check_draft(spec.speculate, text)
    settings = exit_settings_of(text, spec.early_exit, spec.exit_threshold)
    engine = _open(spec, text, settings)
    warn_if_uncompiled()
    if spec.speculate not in (None, "off"):
        engine.speculating(spec.speculate, spec.device)
    return engine


def _open(spec: EngineSpec, text: TextModel, settings: "Optional[ExitSettings]") -> Engine:
    """In this process, or the starter of a ring."""
    use_threads(node_threads(spec.threads, 1, available_cores()))
    if spec.local:
        from .local import LocalEngine

        return LocalEngine(device=spec.device, dtype=spec.dtype, early_exit=settings,
                           quantize=spec.quantize or "", text=text,
                           torch_for=spec.needs_torch(),
                           prefill_chunk=defaults.PREFILL_CHUNK if spec.prefill_chunk is None
                           else spec.prefill_chunk)
    from .ring import RingEngine

    if spec.ring is not None or spec.workers:
        options, workers = _running(spec)
        return RingEngine(workers, options=options, early_exit=settings, route=spec.route,
                          text=text)
    with ExitStack() as stack:  # the workers stop here unless the engine took them over
        workers, secret = _start_local_ring(spec, text, stack)
        given = {"timeout_s": defaults.LOCAL_RING_TIMEOUT_S, **spec.given_ring_options()}
        options = StarterOptions(device=spec.device, dtype=spec.dtype, secret=secret, **given)
        engine = RingEngine(workers, options=options, early_exit=settings, route=spec.route,
                            text=text)
        engine.on_close(stack.pop_all().close)
    return engine


def _running(spec: EngineSpec) -> Any:
    """The starter's options and a ring file's workers (its secret, else the environment's), or
    those given; the spec's ring options win."""
    import dataclasses

    if spec.ring is None:
        return dataclasses.replace(spec.options, **spec.given_ring_options()), list(spec.workers)
    from ..base.ringfile import load_ring

    found, workers = load_ring(spec.ring, secret=True)
    found.update(spec.given_ring_options(), dtype=spec.dtype)
    return StarterOptions(**found), workers


def _start_local_ring(spec: EngineSpec, text: TextModel, stack: ExitStack) -> Any:
    """Each worker given its share of the cores (this process too), entered on ``stack``; and the
    secret."""
    from ..placement.partition import check_ring_size
    from ..roles.local_ring import LocalRing

    check_ring_size(text.cfg.n_layers, spec.nodes)
    threads = node_threads(spec.threads, spec.nodes, available_cores())
    use_threads(threads)
    busy_poll_us = defaults.BUSY_POLL_US if spec.busy_poll_us is None else spec.busy_poll_us
    ring = LocalRing(spec.nodes - 1, threads=threads, device=spec.device, spares=spec.spares,
                     encrypt=not spec.no_encrypt, respawn=spec.respawn, busy_poll_us=busy_poll_us)
    return stack.enter_context(ring), ring.secret
