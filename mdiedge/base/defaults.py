"""The one set of defaults: ports, sampling, frame and time limits, and where the shipped model
lives. The CLI, the config files, the starter service and the library all read them here."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Tuple

from .errors import CheckpointError
from .valuechecks import Span

DEFAULT_MODEL = "nanollama"

# ports of a long-lived ring (a local ring binds free ports), and of the OpenAI API
STARTER_CONTROL_PORT = 7600
WORKER_CONTROL_PORT = 7700
WORKER_DATA_PORT = 7701
API_PORT = 8000

LOCAL_NODES = 3  # nodes of the local ring that `generate`, `chat` and `serve` start (--nodes)

# sampling, the same for `mdiedge generate`, the starter service and SamplingParams()
TEMPERATURE = 0.8
TOP_K = 0
TOP_P = 0.95
SEED = 0  # SamplingParams() and the bench, quality and calibration tools: repeatable runs
SEEDS_BELOW = 2 ** 31  # a drawn seed (a request or a `generate` that names none) is under this
# what SamplingParams, the command line and the API accept (OpenAI's range of temperature)
TEMPERATURE_RANGE = Span(0, 2)  # 0: greedy
TOP_K_RANGE = Span(0, integer=True)  # 0: no top-k filter
TOP_P_RANGE = Span(0, 1, low_open=True)  # 1: no nucleus filter
SEED_RANGE = Span(0, 2 ** 40, integer=True, high_open=True)
MAX_NEW_TOKENS_RANGE = Span(1, integer=True)
# the penalties and filters OpenAI's and llama.cpp's clients send (neutral values: 0, 0, 1, 0)
PENALTY_RANGE = Span(-2, 2)  # presence_penalty, frequency_penalty (OpenAI's range)
REPETITION_PENALTY_RANGE = Span(0, 10, low_open=True)  # 1: none; > 1 discourages repeats
MIN_P_RANGE = Span(0, 1)  # 0: no min-p filter
LOGIT_BIAS_RANGE = Span(-100, 100)  # added to a token's logit (OpenAI's range)
MAX_LOGIT_BIAS = 1024  # tokens one request may bias
MAX_STOPS = 16  # stop strings per request
MAX_STOP_CHARS = 256  # characters per stop string
TOP_LOGPROBS_RANGE = Span(0, 20, integer=True)  # alternatives reported per token
GREEDY_BELOW = 1e-5  # a temperature under this samples as greedy does (vLLM's rule): its
#                      distribution is the argmax's, and logits / it may overflow float32
EARLY_EXIT_CRITERIA = ("softmax", "similarity", "classifier")  # mdiedge.model.earlyexit.policy
MAX_NEW_TOKENS = 256
MAX_SAMPLES = 4096  # samples of one `generate` (a KV slot each; their memory is checked too)

# rows one call of the compiled decode step takes (mdiedge.model._stepconstants; many samples'
# decode rows, several samples' verified drafts): its products pass over each weight group
# MAX_ROWS (8) rows at a time while the group is in cache (16 to 64 rows a call ran 15-26%
# faster than calls of 8 on SmolLM2 and Qwen2.5, 2 threads); its scratch grows with rows x
# context. A message that verifies drafts holds at most this many rows (runtime.plan).
STEP_ROWS = 32
# a sample's consecutive rows that a call takes as decode rows, each computed as a one-token
# step computes it (mdiedge.model's MAX_ROWS); a longer run of one sample is a prefill, on the
# many-row kernels, which round otherwise in the q8 mode (a recovery replays decoded tokens in
# runs this long: runtime.plan.replay)
DECODE_ROWS = 8

# speculative decoding (mdiedge.runtime.speculation)
SPECULATION_MAX_K = 7  # drafted tokens per sample and step: with the last token, the compiled
#                       step's 8 rows
SPECULATION_ROW_COST = 0.1  # a verified row's extra cost, as a share of a one-row step of the ring
SPECULATION_WINDOW = 8  # verification rounds of a sample its acceptance estimate looks back on
SPECULATION_RETRY_AFTER = 16  # plain steps of a sample whose speculation is off before it
#                              drafts again

# data plane and liveness
MAX_PAYLOAD = 64 << 20  # bytes of one frame's tensor; larger frames close the link
PREFILL_CHUNK = 128  # prompt tokens per prefill step (0: the whole prompt): a ring's nodes work
#                      on one chunk while the next travels and the one before is computed
#                      downstream; one node holds one chunk's activations (a 512-token prompt
#                      of SmolLM2: 11 MiB less at the peak, TTFT within 5%)
RING_TIMEOUT_S = 60.0  # a message not back around the ring within this is a failure
PROGRESS_FACTOR = 8.0  # a message in flight this many times the median recent round trip,
PROGRESS_MIN_S = 1.0  # and at least this long, is overdue: a PING behind it tells a lost
#                       frame (it comes back first) from a slow node (mdiedge.runtime.progress)
PROGRESS_WINDOW = 32  # the recent round trips the median is taken over,
PROGRESS_SAMPLES = 3  # of which at least this many before any probe
IDLE_TIMEOUT_S = 60.0  # a worker whose starter is silent this long returns to idle
LINK_ACCEPT_TIMEOUT_S = 30.0  # a node waits this long for its previous node's link
LINK_RETRY_S = 10.0  # a node retries its link to the next node this long
COMPUTE_STALL_S = 60.0  # a worker busy this long on one message stops its systemd watchdog
LOCAL_RING_TIMEOUT_S = 15.0  # `generate --nodes N`: a message not back within this is a stall
STALL_S = 3.0  # no message back this long: every worker is asked; one that does not answer
#                within this again is lost, and the ring recovers without it
ASSIGN_TIMEOUT_S = 600.0  # a worker that answers its control port may load (or receive) its
#                         layers this long; one that stops answering is lost within STALL_S
REBALANCE_MARGIN = 0.25  # re-split between requests when the slowest node is this far above the mean
DIAGNOSE_TIMEOUT_S = 2.0  # a node whose control plane does not answer within this is down
STATUS_RTT_TIMEOUT_S = 0.25  # a worker's /status waits at most this for its next node's ping
HANDSHAKE_TIMEOUT_S = 10.0  # a data link's handshake, per connection (they run side by side,
#                            so strays cost nothing)
LINK_POLL_S = 0.01  # a node's accept waits this long while handshakes are under way,
LINK_IDLE_POLL_S = 0.2  # and this long without
MAX_SKEW_S = 60.0  # a signed control request older (or newer) than this is refused: clocks
#                    must agree within it
CONTROL_SOCKET_TIMEOUT_S = 20.0  # a control connection's each read and write
CONTROL_MIN_BODY_RATE = 1 << 16  # bytes/s a control request's body arrives at, on average,
#                                  at the least
REJOIN_CHECK_S = 2.0  # how often a starter asks a lost worker whether it is back
RING_SHUTDOWN_WAIT_S = 2.0  # a ring's shutdown message waits this long to come back
WORKER_READY_TIMEOUT_S = 60.0  # a local ring's worker process says it is ready within this
REAP_INTERVAL_S = 1.0  # how often a local ring looks for dead worker processes
RESPAWN_FIRST_S = 1.0  # a dead worker is started again this long after it was seen dead
RESPAWN_MAX_S = 30.0  # the pause doubles, up to this, while restarts keep dying
RESPAWN_STABLE_S = 60.0  # a restart that lived this long resets the pause and the count
BUSY_POLL_US = 200  # a node waiting for a frame polls its link this long before it sleeps:
#                   a frame that comes sooner costs no wake-up (0: sleep at once)
MAX_BUSY_POLL_US = 100_000
LOAD_SAMPLES = 5  # readings of procs_running a process takes as it starts (threads.py)
LOAD_SAMPLE_GAP_S = 0.002  # the pause between two of them
MAX_THREADS = 4096  # the most torch threads a worker may be told to use
CPU_DOTS = ("q8", "f32")  # how CPU kernels multiply quantized weights (mdiedge.base.cpudot)
CPU_DOT = "q8"  # 8-bit activations, integer dot products, as llama.cpp does; f32: exact
PERPLEXITY_CTX = 512  # `mdiedge perplexity`'s window, as llama-perplexity's -c
PERPLEXITY_MIN_CTX = 16  # a shorter window scores too few tokens to mean anything
PERPLEXITY_BATCH = 8  # positions per pass: the few-row kernels' (qlayers.KERNEL_ROWS)

# exhaustion: what a flood of connections may hold, and how its log lines are kept short
MAX_CONTROL_CONNECTIONS = 64  # open connections to a control port (a thread each)
MAX_API_CONNECTIONS = 256  # open connections to the API port; the oldest idle one gives way
#                            to a new one at the limit, else the new one is closed
ACCEPT_BACKOFF_S = (0.05, 1.0)  # an accept that fails for want of descriptors or memory
#                                 (EMFILE, ENFILE, ENOBUFS, ENOMEM) waits from the first to
#                                 the second, doubling, before it tries again
LOG_SUMMARY_S = 10.0  # repeated refusals are logged once, then summarised once per this
LIMIT_NOFILE = 65536  # the systemd units' LimitNOFILE (systemd's default soft limit is 1024)

# the files a person writes (mdiedge.base.smallfiles): regular files of at most these sizes
MAX_CONFIG_BYTES = 1 << 20  # a TOML config file
MAX_SECRET_BYTES = 4 << 10  # a ring secret (a file, a --secret-fd pipe, inline) or an API key

# what a GGUF file's header may hold (mdiedge.model.gguf): more is refused with one line, so
# that a hostile file costs memory in proportion to its size (GGUF nests no arrays: an array
# of arrays is refused, as llama.cpp does)
GGUF_MAX_KEYS = 1 << 16  # metadata entries (a model's: about 40)
GGUF_MAX_TENSORS = 1 << 16  # tensors (a large MoE's: about 1,100)
GGUF_MAX_ARRAY = 1 << 21  # entries of one metadata array (the largest vocabularies: 262,144)
GGUF_MAX_STRING = 64 << 20  # bytes of one metadata string (a key, a template, a tokenizer.json)
GGUF_MAX_HEADER = 256 << 20  # bytes of the header: metadata and tensor descriptions
GGUF_MAX_DIMS = 4  # dimensions of a tensor (ggml's GGML_MAX_DIMS)

# the OpenAI API
API_HEAD_TIMEOUT_S = 10.0  # a connection's request line and headers arrive within this, or it
#                            closes
API_BODY_TIMEOUT_S = 30.0  # a request's body arrives within this, or it is a 408
API_START_TIMEOUT_S = 30.0  # the API's server thread is listening within this
API_SLOTS = 8  # KV slots the API's requests share (`starter --slots`; `serve`'s most)
API_CONTEXT = 4096  # tokens per slot unless asked: a model's own may be 128k (KV memory)
API_KV_SHARE = 0.25  # `serve` sizes its slots and context to keep its KV cache within this
#                      share of the memory available when it starts
API_MIN_CONTEXT = 512  # and halves the context down to this (or the model's, if shorter)
API_MAX_WAITING = 32  # requests waiting for slots before a 429 (`serve --max-queue`)
MAX_QUEUE = 64  # the scheduler's own bound on waiting requests, and --max-queue's largest
PROMPT_CACHE_MIN_TOKENS = 16  # a prompt reuses a finished request's KV rows from this many
#                              shared leading tokens (`serve`, `chat`: the prompt cache)
CORS_MAX_AGE_S = 600  # how long a browser may keep a preflight's answer (--cors-origins)
API_THREADS = 8  # threads the API's handlers run blocking work on (anyio's default: 40)
API_TRIM_S = 10.0  # how often an idle API gives a burst's freed memory back to the system
API_MAX_BODY = 1 << 20  # bytes of a request's body (413 past it)
PROMPT_SCORE_ROWS = 64  # prompt rows through the head at a time (echo with logprobs)
# a chat template's render (a model file's template is not trusted): see serving/api/sandbox.py
TEMPLATE_BYTES_PER_TOKEN = 32  # the rendered prompt, and any value made on the way: at most
#                                this many bytes (characters) per token of the context
TEMPLATE_WORK = 16  # all the text and items a render makes, garbage included: this many times that
TEMPLATE_STEPS = 200_000  # loop iterations, calls, filters and operators of one render
TEMPLATE_DEPTH = 32  # macros (and recursive loops) called inside one another
TEMPLATE_DEADLINE_S = 2.0  # one render's wall-clock time
TEMPLATE_MAX_SOURCE = 256 << 10  # characters of a template's source (refused at load past it)
TEMPLATE_THREADS = 4  # the API's renders at once, off its event loop
API_SETUP_WAIT_S = 5.0  # a request waits this long for a set-up of the ring under way, then
#                         it is a 503 with Retry-After (the set-up goes on)
API_SETUP_POLL_S = 0.1  # how often such a request looks again
WAIT_POLL_S = 0.5  # a request thread's wait for its generation is timed, so Ctrl-C reaches it
COMPUTE_CLOSE_S = 10.0  # how long closing an engine or a worker waits for its compute thread
STOP_POLL_S = 0.05  # a blocked main thread or server loop looks this often for a stop (a
#                    signal that lands on another thread wakes no blocked main thread)
SHOWN_SETUP_S = 0.05  # a generation's line names its set-up from this many seconds (JSON always)

# held-out text of the quality measurements (calibrate-exit, bench --compression/--early-exit)
HELD_OUT_SHARE = 0.1  # the share at the end of a --text file held out (NanoLlama's validation
#                       split of Tiny Shakespeare)
HELD_OUT_TEXT = "tinyshakespeare-heldout.txt"  # beside the shipped model: that split, whole


def default_model_path() -> Path:
    """``$MDIEDGE_MODEL``, else the packaged copy of ``models/nanollama``, else the checkout's."""
    env = os.environ.get("MDIEDGE_MODEL")
    if env:
        return Path(env).expanduser()
    here = Path(__file__).resolve().parent.parent  # the mdiedge package
    for candidate in (here / "_models" / DEFAULT_MODEL, here.parent / "models" / DEFAULT_MODEL):
        if (candidate / "config.json").exists():
            return candidate
    raise CheckpointError(f"default model {DEFAULT_MODEL!r} not found (looked in "
                          f"{here / '_models'} and {here.parent / 'models'}); pass --model DIR")


def random_seed() -> int:
    """The seed of a request that names none (`mdiedge generate` without --seed, an API
    request without "seed"): drawn, then reported, so the run can be repeated with it."""
    import random  # its SystemRandom is secrets' (os.urandom), without OpenSSL's library

    return random.SystemRandom().randrange(SEEDS_BELOW)


def held_out_text(text: Optional[str]) -> Tuple[Path, float]:
    """The text file a quality measurement reads and the share at its end held out: ``text``
    with its last ``HELD_OUT_SHARE``, or, without one, the held-out split shipped beside
    NanoLlama, all of it (the same text as the last tenth of the whole corpus)."""
    if text is not None:
        return Path(text), HELD_OUT_SHARE
    here = Path(__file__).resolve().parent.parent  # the mdiedge package
    for folder in (here / "_models" / DEFAULT_MODEL, here.parent / "models" / DEFAULT_MODEL):
        if (folder / HELD_OUT_TEXT).is_file():
            return folder / HELD_OUT_TEXT, 1.0
    raise CheckpointError(f"held-out text {HELD_OUT_TEXT!r} not found (looked in "
                          f"{here / '_models' / DEFAULT_MODEL} and "
                          f"{here.parent / 'models' / DEFAULT_MODEL}); pass --text FILE")


def default_cache_dir() -> Path:
    """Where a worker caches received weights unless told: ``$MDIEDGE_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/mdiedge``, else ``~/.cache/mdiedge``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(os.environ.get("MDIEDGE_CACHE_DIR") or os.path.join(base, "mdiedge"))


def default_secret_file() -> Path:
    """The ring secret that ``mdiedge config init`` creates and its skeletons name:
    ``$XDG_CONFIG_HOME/mdiedge/secret``, else ``~/.config/mdiedge/secret``."""
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "mdiedge" / "secret"

# constrained decoding (response_format, grammars; mdiedge.model.grammar)
GRAMMAR_MAX_BYTES = 64 << 10  # a grammar's or JSON schema's text
GRAMMAR_MAX_DEPTH = 32  # a JSON schema's nesting
GRAMMAR_MAX_SYMBOLS = 50_000  # llguidance's max_grammar_size (symbols of its productions)
GRAMMAR_STEP_FUEL = 200_000  # llguidance's lexer fuel per token (about 15 ms of work)
