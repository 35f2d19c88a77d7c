"""llama-server's native routes, the parts local-LLM tools and editor plugins speak: ``POST
/completion`` (a prompt as text or token ids; llama-server's field names, its reply and stream
shapes, ``timings``), ``/tokenize``, ``/detokenize``, ``/apply-template`` and ``GET /props``. A
body's fields are read into the same ``Options`` as the OpenAI routes' (one reading, one set of
checks); fields with no meaning here are accepted and ignored (``IGNORED_NATIVE``)."""
from __future__ import annotations

import json
from typing import Any, AsyncIterator, Dict, List, Mapping, Optional, Sequence, Tuple

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ...base import defaults
from ...base.errors import ApiError
from .bodies import read_json
from .errors import api_error
from .logprobs import entries
from .schema import ChatRequest, CompletionRequest, Options, token_prompt

# llama-server fields that change nothing here (its other samplers, slots, LoRA, images...)
IGNORED_NATIVE = ("n_keep", "n_indent", "tfs_z", "typical_p", "repeat_last_n", "penalize_nl",
                  "mirostat", "mirostat_tau", "mirostat_eta", "dynatemp_range",
                  "dynatemp_exponent", "xtc_probability", "xtc_threshold", "dry_multiplier",
                  "dry_base", "dry_allowed_length", "dry_penalty_last_n",
                  "dry_sequence_breakers", "samplers", "id_slot", "return_tokens",
                  "post_sampling_probs", "response_fields", "lora", "t_max_predict_ms",
                  "image_data", "timings_per_token", "top_n_sigma", "min_keep",
                  "return_progress", "n_cmpl", "n_cache_reuse", "cache_reuse")
RENAMED = {"n_predict": "max_tokens", "n_probs": "logprobs"}
KEPT = ("temperature", "repeat_penalty", "top_k", "top_p", "min_p", "stop", "stream",
        "presence_penalty", "frequency_penalty", "grammar", "json_schema", "cache_prompt", "model")


def openai_fields(body: Mapping[str, Any]) -> Dict[str, Any]:
    """A ``/completion`` body as the OpenAI completion fields ``Options`` reads (llama-server's
    ``n_predict`` -1, ``seed`` -1 and ``n_probs`` 0 mean "none"); a 400 for a field it does
    not know."""
    unknown = sorted(set(body) - set(KEPT) - set(RENAMED) - set(IGNORED_NATIVE)
                     - {"prompt", "seed", "logit_bias", "ignore_eos"})
    if unknown:
        raise ApiError(400, f"unknown field {unknown[0]!r}", unknown[0], "unknown_field")
    out = {name: body[name] for name in KEPT if body.get(name) is not None}
    for theirs, ours in RENAMED.items():
        if body.get(theirs) is not None:
            out[ours] = body[theirs]
    if out.get("max_tokens") == -1:
        del out["max_tokens"]
    if out.get("logprobs") == 0:
        del out["logprobs"]
    if body.get("seed") not in (None, -1):
        out["seed"] = body["seed"]
    if body.get("logit_bias") is not None:
        out["logit_bias"] = native_bias(body["logit_bias"])
    return out


def native_bias(value: Any) -> Dict[str, Any]:
    """llama-server's ``logit_bias`` (``[[id, bias], ...]``, ``false`` banning the token, or
    OpenAI's object) as OpenAI's object of id strings."""
    if isinstance(value, dict):
        return value
    if not isinstance(value, list) or not all(
            isinstance(p, list) and len(p) == 2 for p in value[:defaults.MAX_LOGIT_BIAS + 1]):
        raise ApiError(400, "logit_bias: expected [[token id, bias], ...] or an object",
                       "logit_bias", "invalid_value")
    return {str(token): -100 if bias is False else bias for token, bias in value}


class NativeRoutes:
    """The native routes of ``routes`` (an ``ApiRoutes``: its service and checks)."""

    def __init__(self, routes: Any) -> None:
        self.routes, self.service = routes, routes.service

    def table(self) -> List[Tuple[str, Any, List[str]]]:
        return [("/completion", self.completion, ["POST"]),
                ("/tokenize", self.tokenize, ["POST"]),
                ("/detokenize", self.detokenize, ["POST"]),
                ("/apply-template", self.apply_template, ["POST"]),
                ("/props", self.props, ["GET"]),
                ("/slots", self.slots, ["GET"])]

    async def body(self, request: Request) -> Dict[str, Any]:
        return await read_json(request, self.service.limits.max_body)

    async def completion(self, request: Request) -> Response:
        body = await self.body(request)
        if "prompt" not in body:
            raise ApiError(400, "prompt: required", "prompt", "missing_field")
        parsed = CompletionRequest.from_json(dict(openai_fields(body), prompt=body["prompt"]))
        options = parsed.options
        options.ignore_eos = body.get("ignore_eos") is True
        run = await self.service.start(self.service.prompt_of(token_prompt(body["prompt"])),
                                       options)
        first = await run.next(request.is_disconnected)
        if first is None and run.error is not None:
            raise api_error(run.error)
        if options.stream:
            return StreamingResponse(self.events(run, first, options),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return JSONResponse(self.final(run, "", options))

    async def events(self, run: Any, first: Any, options: Options) -> AsyncIterator[bytes]:
        sample = run.generation.samples[0]
        try:
            item = first
            while item is not None:
                if item[2]:
                    yield _sse({"content": item[2], "stop": False, "index": 0, "id_slot": 0})
                item = await run.next(_never)
            if run.error is not None:
                yield _sse(api_error(run.error).to_json())
                return
            rest = sample.output.rest(sample.text)
            yield _sse(self.final(run, rest, options))
        finally:
            run.cancel()

    def final(self, run: Any, content: Optional[str], options: Options) -> Dict[str, Any]:
        """The reply (or the stream's last event, ``content`` its last text): llama-server's
        fields for the first sample."""
        generation = run.generation
        sample = generation.samples[0]
        whole = sample.text
        reason = sample.finish_reason
        out = {"content": whole if not options.stream else content, "index": 0, "id_slot": 0,
               "stop": True, "model": self.service.name, "tokens_predicted": len(sample.tokens),
               "tokens_evaluated": len(sample.prompt), "tokens_cached": generation.cached_tokens,
               "stop_type": {"eos": "eos", "stop": "word", "length": "limit"}.get(reason, "none"),
               "stopped_eos": reason == "eos", "stopped_word": reason == "stop",
               "stopped_limit": reason == "length", "truncated": False,
               "timings": timings(generation), "generation_settings": self.settings()}
        if generation.params.top_logprobs is not None:
            out["completion_probabilities"] = self.probabilities(sample, whole)
        return out

    def probabilities(self, sample: Any, text: str) -> List[Dict[str, Any]]:
        items = entries(self.service.engine.tokenizer, sample.prompt, sample.logprobs,
                        len(text) if sample.finish_reason == "stop" else None)
        return [{"id": scored.token, "token": e.text, "logprob": e.logprob, "bytes": e.bytes,
                 "top_logprobs": [{"id": tid, "token": alt, "logprob": lp, "bytes": raw}
                                  for (tid, _), (alt, raw, lp) in zip(scored.top, e.top)]}
                for scored, e in zip(sample.logprobs, items)]

    def settings(self) -> Dict[str, Any]:
        return {"n_ctx": self.service.context, "n_predict": self.service.limits.max_tokens,
                "temperature": defaults.TEMPERATURE, "top_k": defaults.TOP_K,
                "top_p": defaults.TOP_P, "model": self.service.name}

    async def tokenize(self, request: Request) -> Response:
        body = await self.body(request)
        content = body.get("content")
        if not isinstance(content, str):
            raise ApiError(400, "content: expected a string", "content", "invalid_type")
        ids = self.service.tokenize(content, body.get("add_special") is True)
        if body.get("with_pieces") is not True:
            return JSONResponse({"tokens": ids})
        decode = self.service.engine.tokenizer.decode
        return JSONResponse({"tokens": [{"id": i, "piece": decode([i])} for i in ids]})

    async def detokenize(self, request: Request) -> Response:
        ids = token_prompt((await self.body(request)).get("tokens"), "tokens", empty=True)
        if isinstance(ids, str):
            raise ApiError(400, "tokens: expected a list of token ids", "tokens", "invalid_type")
        return JSONResponse({"content": self.service.prompt_of(ids).text if ids else ""})

    async def apply_template(self, request: Request) -> Response:
        chat = ChatRequest.from_json(await self.body(request))
        prompt = await self.service.template.render_async(chat.messages, chat.tools)
        return JSONResponse({"prompt": prompt})

    async def props(self, request: Request) -> Response:
        from ... import __version__

        return JSONResponse({
            "default_generation_settings": {"n_ctx": self.service.context,
                                            "params": self.settings()},
            "total_slots": self.service.limits.slots, "model_alias": self.service.name,
            "model_path": str(self.service.engine.path),
            "chat_template": self.service.template.source, "modalities": {"vision": False},
            "build_info": f"mdiedge {__version__}"})

    async def slots(self, request: Request) -> Response:
        """llama-server's ``/slots``: each KV slot of the API, the sample that holds it (in
        order of the requests) and how far it is; prompts are not shown (another client's)."""
        return JSONResponse(slot_views(self.service.running(), self.service.limits.slots,
                                       self.service.context))


def slot_views(runs: Sequence[Any], n_slots: int, n_ctx: int) -> List[Dict[str, Any]]:
    """One body per slot: busy ones hold the live samples of ``runs`` (admitted, not ended),
    in order; the rest are idle."""
    live = [(run, sample) for run in runs if run.generation is not None and run.admitted
            for sample in run.generation.samples if not sample.done]
    views = []
    for slot in range(n_slots):
        view: Dict[str, Any] = {"id": slot, "id_task": -1, "n_ctx": n_ctx,
                                "is_processing": slot < len(live)}
        if slot < len(live):
            run, sample = live[slot]
            generation = run.generation
            view.update(id_task=run.task, speculative=generation.speculation is not None,
                        params={"n_predict": generation.max_new_tokens,
                                "temperature": generation.params.temperature,
                                "top_k": generation.params.top_k,
                                "top_p": generation.params.top_p,
                                "seed": generation.params.seed},
                        next_token={"has_next_token": True, "n_decoded": len(sample.tokens),
                                    "n_remain": generation.max_new_tokens - len(sample.tokens)})
        views.append(view)
    return views


def timings(generation: Any) -> Dict[str, float]:
    """llama-server's ``timings`` of a finished generation."""
    t = generation.timing
    prompt_n = len(generation.samples[0].prompt) - generation.cached_tokens
    predicted = max(0, t.new_tokens - 1)  # the first token came with the prompt
    return {"prompt_n": prompt_n, "prompt_ms": t.prefill_s * 1000,
            "prompt_per_second": prompt_n / t.prefill_s if t.prefill_s > 0 else 0.0,
            "predicted_n": t.new_tokens, "predicted_ms": t.decode_s * 1000,
            "predicted_per_second": predicted / t.decode_s if t.decode_s > 0 else 0.0,
            "cache_n": generation.cached_tokens}


def _sse(payload: Dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode("utf-8")


async def _never() -> bool:
    return False
