"""The ASGI app (starlette): ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` (JSON, or
server-sent events ending ``data: [DONE]``), ``/metrics``, ``/health`` and the ring's ``/status``
(as a starter's control plane answers it); an optional API key (``Authorization: Bearer`` or
``X-Api-Key``) on every route but ``/health``; CORS for the origins allowed (``cors``); bounded
bodies; every error in OpenAI's shape."""
from __future__ import annotations

import functools
import logging
import time
from typing import Any, AsyncIterator, Awaitable, Callable, Dict, List, Optional, Sequence, Union

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ...base.errors import ApiError
from ...base.humanize import plural
from ...engine.engine import Prompt
from .cors import Cors
from .errors import api_error
from .logprobs import (StreamedLogprobs, chat_logprobs, completion_logprobs, entries,
                       prompt_entries)
from .bodies import read_json
from .metrics import CONTENT_TYPE
from .native import NativeRoutes
from .responses import (ChatChunk, ChatCompletion, Choice, Completion, CompletionChunk,
                        ModelCard, new_id, sse)
from .rules import authorized
from .schema import ChatRequest, CompletionRequest, Options
from .toolreplies import ChoiceStream, reply
from .tools import ToolRequest
from .service import ApiService, Run
from .shapes import Shape, total_usage
from ..service import status_body

log = logging.getLogger("mdiedge.api")
OPEN_PATHS = ("/health",)  # answered without the API key
Handler = Callable[[Request], Awaitable[Response]]


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.to_json(), error.status, headers=error.headers())


class KeyCheck:
    """A request without the key is a 401 before any route runs."""

    def __init__(self, app: Any, key: Optional[str]) -> None:
        self.app, self.key = app, key

    async def __call__(self, scope: Dict[str, Any], receive: Any, send: Any) -> None:
        headers = Headers(scope=scope) if scope["type"] == "http" else None
        if headers is not None and scope["path"] not in OPEN_PATHS and \
                not authorized(headers.get("authorization"), self.key, headers.get("x-api-key")):
            error = ApiError(401, "missing or wrong API key (send Authorization: Bearer KEY, "
                             "or X-Api-Key: KEY)", code="invalid_api_key")
            await error_response(error)(scope, receive, send)
            return
        await self.app(scope, receive, send)


class ApiRoutes:
    def __init__(self, service: ApiService) -> None:
        self.service = service

    def endpoint(self, handler: Handler) -> Handler:
        """Errors become OpenAI's error bodies; answers counted by status."""
        @functools.wraps(handler)
        async def wrapped(request: Request) -> Response:
            try:
                response = await handler(request)
            except Exception as e:  # noqa: BLE001 - every error is an API error body
                error = api_error(e)
                if error.status == 500:  # a fault of the server's: the operator needs it
                    log.error("%s %s failed", request.method, request.url.path, exc_info=e)
                response = error_response(error)
            self.service.metrics.requests.labels(str(response.status_code)).inc()
            self.service.answered += 1
            return response
        return wrapped

    async def models(self, request: Request) -> Response:
        card = ModelCard(self.service.name, self.service.created)
        return JSONResponse({"object": "list", "data": [card.to_json()]})

    async def model(self, request: Request) -> Response:
        name = request.path_params["model"]
        if name != self.service.name and self.service.strict_model_name:
            raise ApiError(404, f"model {name!r} not found: this server serves "
                           f"{self.service.name!r}", "model", "model_not_found")
        return JSONResponse(ModelCard(name, self.service.created).to_json())

    async def completions(self, request: Request) -> Response:
        body = CompletionRequest.from_json(await read_json(request, self.service.limits.max_body))
        drawn, slots = len(body.prompts) * body.best_of, self.service.limits.slots
        if drawn > slots and drawn > body.options.n:  # else: n's own 400
            field = "prompt" if len(body.prompts) > 1 else "best_of"
            raise ApiError(400, f"{field}: {plural(len(body.prompts), 'prompt')} of "
                           f"{plural(body.best_of, 'sample')} each need {drawn} KV slots, the "
                           f"server has {slots}", field, "invalid_value")
        prompts = [self.service.prompt_of(p) for p in body.prompts]
        return await self.respond(request, prompts, body.options, chat=False,
                                  shape=Shape(body.options, body.echo, body.best_of))

    async def chat(self, request: Request) -> Response:
        body = ChatRequest.from_json(await read_json(request, self.service.limits.max_body))
        prompt = await self.service.template.render_async(body.messages, body.tools)
        call = body.tools.call_schema() if body.tools is not None else None
        if call is not None and body.options.output is None:  # a call is required: hold to one
            body.options.output = ("json_schema", call, "tool_choice")
        body.options.server_stops = tuple(self.service.template.stops)
        return await self.respond(request, [prompt], body.options, chat=True, tools=body.tools)

    async def metrics(self, request: Request) -> Response:
        return Response(await run_in_threadpool(self.service.metrics.render),
                        media_type=CONTENT_TYPE)

    async def status(self, request: Request) -> Response:
        return JSONResponse(await run_in_threadpool(status_body, self.service.engine))

    async def health(self, request: Request) -> Response:
        """503 with the reason while a request would not be served (a load balancer's cue)."""
        why = await run_in_threadpool(self.service.unavailable)
        if why is None:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable", "error": why}, 503,
                            headers={"Retry-After": "5"})

    async def respond(self, request: Request, prompts: Sequence[Union[str, Prompt]],
                      options: Options, chat: bool, tools: Optional[ToolRequest] = None,
                      shape: Optional[Shape] = None) -> Response:
        """Each prompt its own request (``shape.best_of`` samples), answered in order as one body or
        one stream."""
        shape = shape or Shape(options)
        runs = await self.start_all(prompts, shape.drawing(options), chat)
        try:
            first = await runs[0].next(request.is_disconnected)
            if first is None and runs[0].error is not None:
                raise api_error(runs[0].error)
            if not options.stream:
                return JSONResponse(await self.answered(request, runs, chat, shape, tools))
        except BaseException:
            for run in runs:  # none of them is answered now
                run.cancel()
            raise
        return StreamingResponse(self.events(runs, first, options, chat, shape, tools),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def answered(self, request: Request, runs: Sequence[Run], chat: bool, shape: Shape,
                       tools: Optional[ToolRequest]) -> Dict[str, Any]:
        """The first run's error if one failed."""
        for run in runs[1:]:
            while await run.next(request.is_disconnected) is not None:
                pass
        for run in runs:
            stopped = api_error(run.error) if run.error is not None else self.shutdown_error(run)
            if stopped is not None:
                raise stopped
        return self.whole(runs, chat, shape, tools)

    async def start_all(self, prompts: Sequence[Union[str, Prompt]], options: Options,
                        chat: bool) -> List[Run]:
        """Each drawing its own seed unless the body named one; one refused cancels those started.
        """
        runs: List[Run] = []
        try:
            for k, prompt in enumerate(prompts):
                runs.append(await self.service.start(prompt, options.reseeded() if k else options,
                                                      templated=chat))
        except BaseException:
            for run in runs:
                run.cancel()
            raise
        return runs

    def shutdown_error(self, run: Run) -> Optional[ApiError]:
        """A 503 for a request the shutdown cut short (not an answer); else None."""
        samples = run.generation.samples if run.generation is not None else []
        if self.service.closed and any(s.finish_reason == "cancelled" for s in samples):
            return ApiError(503, "the server shut down before the request was done",
                            code="shutting_down", retry_after=5)
        return None

    def whole(self, runs: Sequence[Run], chat: bool, shape: Shape,
              tools: Optional[ToolRequest] = None) -> Dict[str, Any]:
        choices = []
        for k, run in enumerate(runs):
            assert run.generation is not None
            kept = shape.kept(run.generation.samples)
            for j, sample in enumerate(kept):
                text, echo = sample.text, shape.echoed(run)
                logprobs = self.logprobs(run, sample, text, chat, echo) \
                    if shape.asked_logprobs else None
                choices.append(reply(Choice(k * len(kept) + j, echo + text,
                                            sample.finish_reason, logprobs=logprobs), tools))
        kind = ChatCompletion if chat else Completion
        return kind(new_id("chatcmpl" if chat else "cmpl"), int(time.time()), self.service.name,
                    choices, total_usage(runs), self.service.fingerprint).to_json()

    def logprobs(self, run: Run, sample: Any, text: str, chat: bool,
                 echo: str = "") -> Dict[str, Any]:
        """After the ``echo``ed prompt's, when scored."""
        assert run.generation is not None
        tokenizer, scores = self.service.engine.tokenizer, run.generation.prompt_logprobs
        items = entries(tokenizer, sample.prompt, sample.logprobs,
                        len(echo) + len(text) if sample.finish_reason == "stop" else None,
                        len(echo))
        if echo and scores is not None:
            items = prompt_entries(tokenizer, sample.prompt, scores, echo) + items
        return (chat_logprobs if chat else completion_logprobs)(items)

    async def events(self, runs: Sequence[Run], first: Any, options: Options, chat: bool,
                     shape: Shape, tools: Optional[ToolRequest] = None) -> AsyncIterator[bytes]:
        """A chat's role chunks, each run's text as sampled (echoed prompt first), last texts and
        finish reasons, usage if asked, ``[DONE]``. A client going away cancels the requests
        (starlette cancels this generator)."""
        ident, created = new_id("chatcmpl" if chat else "cmpl"), int(time.time())

        def chunk(choices: Any, **extra: Any) -> bytes:
            kind = ChatChunk if chat else CompletionChunk
            return sse(kind(ident, created, self.service.name, choices,
                            system_fingerprint=self.service.fingerprint, **extra).to_json())

        try:
            if chat:
                for index in range(options.n):
                    yield chunk([Choice(index, "")], role=True)
            for k, run in enumerate(runs):
                item = first if k == 0 else await run.next(_never)
                for index in range(options.n if shape.echo else 0):
                    yield chunk([self.echo_choice(run, k * options.n + index, shape)])
                async for choice in self.run_choices(run, item, options, chat, tools,
                                                     shape.echoed(run)):
                    if isinstance(choice, ApiError):
                        yield sse(choice.to_json())
                        return
                    choice.index += k * options.n
                    yield chunk([choice])
            if options.include_usage:
                yield chunk([], usage=total_usage(runs))
            yield sse("[DONE]")
        finally:
            for run in runs:
                run.cancel()  # nothing when it ended; else the client is gone

    def echo_choice(self, run: Run, index: int, shape: Shape) -> Choice:
        """A stream's first chunk of a choice echoing its prompt (and its logprobs when scored)."""
        assert run.generation is not None
        choice, scores = Choice(index, shape.echoed(run)), run.generation.prompt_logprobs
        if scores is not None:
            choice.logprobs = completion_logprobs(prompt_entries(
                self.service.engine.tokenizer, run.generation.samples[0].prompt, scores,
                choice.text))
        return choice

    async def run_choices(self, run: Run, first: Any, options: Options, chat: bool,
                          tools: Optional[ToolRequest], echo: str = "") -> AsyncIterator[Any]:
        """Samples' text as sampled, then last text and finish reasons; an ApiError last where it
        failed."""
        generation = run.generation
        assert generation is not None
        tokenizer = self.service.engine.tokenizer
        shapes = [ChoiceStream(s.index, tools) for s in generation.samples]
        logprobs = StreamedLogprobs(tokenizer, generation.samples, chat,
                                    generation.params.top_logprobs is not None, len(echo))
        item = first
        while item is not None:
            logprobs.push(item[0])
            for k, choice in enumerate(shapes[item[0]].push(item[2])):
                choice.logprobs = logprobs.take(item[0]) if k == 0 else None
                yield choice
            item = await run.next(_never)
        error = api_error(run.error) if run.error is not None else self.shutdown_error(run)
        if error is not None:
            yield error
            return
        for sample, shape in zip(generation.samples, shapes):
            final = sample.text
            cut = len(echo) + len(final) if sample.finish_reason == "stop" else None
            for k, choice in enumerate(shape.finish(sample.output.rest(final), final,
                                                    sample.finish_reason)):
                choice.logprobs = logprobs.take(sample.index, cut) if k == 0 else None
                yield choice


async def _never() -> bool:
    return False


def build_app(service: ApiService, api_key: Optional[str] = None,
              cors_origins: Sequence[str] = ()) -> Any:
    """``api_key`` None: none; ``cors_origins``: browsers' allowed origins (``*``: any)."""
    routes = ApiRoutes(service)
    table = [("/v1/models", routes.models, ["GET"]),
             ("/v1/models/{model:path}", routes.model, ["GET"]),
             ("/v1/completions", routes.completions, ["POST"]),
             ("/v1/chat/completions", routes.chat, ["POST"]),
             ("/metrics", routes.metrics, ["GET"]),
             ("/health", routes.health, ["GET"]),
             ("/status", routes.status, ["GET"])] + NativeRoutes(routes).table()

    async def http_error(request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        message = f"no route {request.method} {request.url.path}" if status in (404, 405) \
            else str(getattr(exc, "detail", exc))
        return error_response(ApiError(status, message, code="not_found" if status == 404
                                       else None))

    app = Starlette(routes=[Route(path, routes.endpoint(fn), methods=methods)
                            for path, fn, methods in table],
                    exception_handlers={HTTPException: http_error})
    return Cors(KeyCheck(app, api_key), cors_origins)
