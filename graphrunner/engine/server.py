"""An OpenAI-compatible HTTP server over the reference engine (`graphrunner serve MODEL`).

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (both with `"stream": true`
as server-sent events), `GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus text).
With an API key, every /v1 route wants `Authorization: Bearer KEY` (401 otherwise).

A request's `model` field names the base model (its served name or path) or one of the LoRA
adapters the server was started with (`--lora-modules`): the request then runs on that adapter.
Any other name gets 404 listing the served names.

The engine runs on one background thread (`AsyncEngine`); each HTTP request submits its
prompts and reads their outputs from an asyncio queue. A client that disconnects aborts its
requests (their KV blocks are freed with the next step). Beyond `max_num_seqs +
max_queued_requests` live requests, new ones get HTTP 429. Errors come in OpenAI's shape,
`{"error": {"message", "type", "param", "code"}}`, with 400 for a bad request.

Needs the `serve` extra: `pip install 'graphrunner[serve]'` (FastAPI and uvicorn).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict

from graphrunner.engine.async_engine import TTFT_BUCKETS, AsyncEngine, EngineDead, QueueFull, now
from graphrunner.engine.chat import render_chat
from graphrunner.engine.request import CompletionOutput, RequestOutput
from graphrunner.protocol import LoRARequest, SamplingParams

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------- request bodies (OpenAI's fields)
class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields are ignored, as OpenAI-compatible servers do

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    bad_words: list[str] | None = None


class CompletionBody(_Body):
    prompt: str | list[str] | list[int] | list[list[int]]
    best_of: int | None = None
    logprobs: int | None = None
    echo: bool = False


class ChatBody(_Body):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class APIError(Exception):
    """An error the client gets in OpenAI's shape with `status`."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             429: "rate_limit_error", 500: "server_error", 503: "server_error"}

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def response(self) -> JSONResponse:
        return JSONResponse(status_code=self.status, content=error_body(self.status, self.message, self.param))


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": APIError.TYPES.get(status, "server_error"), "param": param,
                      "code": status}}


@dataclass
class ServerConfig:
    """What `build_app` needs besides the engine: the served name, the key, the queue bound, and the
    LoRA adapters a request may name (`lora_modules`, each by its `lora_name`)."""

    served_model_name: str
    model: str
    api_key: str | None = None
    max_queued_requests: int = 1024
    lora_modules: tuple[LoRARequest, ...] = ()


def build_app(engine: AsyncEngine, config: ServerConfig) -> FastAPI:
    """The FastAPI application over a running `AsyncEngine` (module docstring)."""
    app = FastAPI(title="graphrunner", docs_url=None, redoc_url=None)
    llm = engine.llm
    max_model_len = llm.max_model_len
    adapters = {lora.lora_name: lora for lora in config.lora_modules}

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ())[1:]) or 'body'}: {e.get('msg')}"
                             for e in exc.errors())
        return JSONResponse(status_code=400, content=error_body(400, f"malformed request body: {problems}"))

    @app.middleware("http")
    async def _check_key(request: Request, call_next: Any) -> Response:
        if config.api_key is not None and request.url.path.startswith("/v1"):
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {config.api_key}".encode()):
                return JSONResponse(status_code=401, content=error_body(
                    401, "missing or wrong API key: send 'Authorization: Bearer <key>' with the server's --api-key"))
        return await call_next(request)

    @app.get("/health")
    async def health() -> Response:
        if engine.error is not None:
            return JSONResponse(status_code=503, content=error_body(503, f"engine stopped: {engine.error!r}"))
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        created = now()
        base = {"id": config.served_model_name, "object": "model", "created": created, "owned_by": "graphrunner",
                "root": config.model, "parent": None, "max_model_len": max_model_len}
        # vLLM's shape for adapters: the folder as root, the base model as parent.
        loras = [{"id": lora.lora_name, "object": "model", "created": created, "owned_by": "graphrunner",
                  "root": lora.lora_path, "parent": config.served_model_name, "max_model_len": max_model_len}
                 for lora in config.lora_modules]
        return {"object": "list", "data": [base, *loras]}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(prometheus_text(engine, config.served_model_name),
                                 media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request) -> Response:
        lora = _resolve_model(body, config, adapters)
        prompts = _completion_prompts(body.prompt)
        params = _sampling_params(body, max_tokens=16 if body.max_tokens is None else body.max_tokens,
                                  logprobs=body.logprobs, best_of=body.best_of)
        if body.echo:
            raise APIError(400, "echo=true is not supported", "echo")
        request_id = f"cmpl-{uuid.uuid4().hex}"
        return await _serve(engine, request, body, prompts, params, request_id, _CompletionFormat(body, config, lora),
                            lora)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, request: Request) -> Response:
        lora = _resolve_model(body, config, adapters)
        try:
            prompts = render_chat(llm.tokenizer, body.messages, chat_template=body.chat_template,
                                  add_generation_prompt=body.add_generation_prompt,
                                  continue_final_message=body.continue_final_message,
                                  chat_template_kwargs=body.chat_template_kwargs)
        except ValueError as e:
            raise APIError(400, str(e), "messages") from None
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if limit is None:  # vLLM's default: the rest of the context
            limit = max(max_model_len - len(prompts[0]["prompt_token_ids"]), 1)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        params = _sampling_params(body, max_tokens=limit,
                                  logprobs=(body.top_logprobs or 0) if body.logprobs else None, best_of=None)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        return await _serve(engine, request, body, prompts, params, request_id, _ChatFormat(body, config, lora),
                            lora)

    return app


def _resolve_model(body: _Body, config: ServerConfig, adapters: dict[str, LoRARequest]) -> LoRARequest | None:
    """The adapter the body's `model` names, None for the base model (or no name); 404 listing the
    served names for any other."""
    if body.model is None or body.model in (config.served_model_name, config.model):
        return None
    lora = adapters.get(body.model)
    if lora is None:
        names = [config.served_model_name, *adapters]
        raise APIError(404, f"model {body.model!r} is not served here; this server serves "
                            f"{', '.join(repr(n) for n in names)}", "model")
    return lora


def _completion_prompts(prompt: Any) -> list[Any]:
    """The prompts of a completion body: a text, a list of texts, token ids, or lists of token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt is empty", "prompt")
    if isinstance(prompt[0], int):
        return [{"prompt_token_ids": prompt}]
    return [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompt]


def _sampling_params(body: _Body, *, max_tokens: int, logprobs: int | None, best_of: int | None) -> SamplingParams:
    """The body's sampling fields as `SamplingParams` (400 naming the bad field)."""
    fields: dict[str, Any] = {"max_tokens": max_tokens, "n": body.n, "best_of": best_of, "logprobs": logprobs}
    for name in ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "top_k", "min_p",
                 "repetition_penalty", "min_tokens", "ignore_eos", "skip_special_tokens",
                 "include_stop_str_in_output"):
        value = getattr(body, name)
        if value is not None:
            fields[name] = value
    if body.stop is not None:
        fields["stop"] = body.stop
    if body.stop_token_ids is not None:
        fields["stop_token_ids"] = body.stop_token_ids
    if body.bad_words:
        fields["bad_words"] = body.bad_words
    if body.logit_bias:
        try:
            fields["logit_bias"] = {int(k): v for k, v in body.logit_bias.items()}
        except ValueError:
            raise APIError(400, f"logit_bias keys must be token ids, got {sorted(body.logit_bias)[:4]}",
                           "logit_bias") from None
    try:
        return SamplingParams(**fields)
    except ValueError as e:
        raise APIError(400, str(e), str(e).split("=", 1)[0] if "=" in str(e) else None) from None


async def _serve(engine: AsyncEngine, request: Request, body: _Body, prompts: list[Any], params: SamplingParams,
                 request_id: str, fmt: _Format, lora: LoRARequest | None) -> Response:
    """Submit every prompt (on `lora`'s adapter, or the base model), then answer at once (non-streaming)
    or as server-sent events."""
    if body.stream and params.best_of is not None and params.best_of > params.n:
        raise APIError(400, f"best_of={params.best_of} > n={params.n} cannot stream", "best_of")
    if engine.num_live + len(prompts) > engine.max_live:
        raise APIError(429, f"the server is at its request limit ({engine.num_live} live of "
                            f"max_num_seqs + --max-queued-requests = {engine.max_live}); retry later")
    streams = [engine.generate(p, params, f"{request_id}-{i}", stream=body.stream, lora_request=lora)
               for i, p in enumerate(prompts)]
    merged = _merge(streams)
    if body.stream:
        try:
            first = await merged.__anext__()  # a bad prompt fails here, before any byte is sent
        except StopAsyncIteration:
            first = None
        except Exception as e:
            await merged.aclose()
            raise _api_error(e) from None
        return _EventStream(_sse(merged, first, fmt, request_id, params), media_type="text/event-stream")
    results: list[tuple[int, RequestOutput]] = []
    listener = asyncio.ensure_future(_disconnected(request))
    try:
        while True:
            nxt = asyncio.ensure_future(merged.__anext__())
            done, _ = await asyncio.wait({nxt, listener}, return_when=asyncio.FIRST_COMPLETED)
            if nxt not in done:  # the client left: abort its requests
                nxt.cancel()
                await asyncio.gather(nxt, return_exceptions=True)
                await merged.aclose()
                return Response(status_code=499)
            try:
                results.append(nxt.result())
            except StopAsyncIteration:
                break
            except Exception as e:
                await merged.aclose()
                raise _api_error(e) from None
    finally:
        listener.cancel()
    results.sort(key=lambda r: r[0])
    return JSONResponse(fmt.full(request_id, [out for _, out in results], params))


def _api_error(e: Exception) -> APIError:
    """The HTTP error of an engine-side exception: a bad request 400, a full server 429."""
    if isinstance(e, (ValueError, TypeError)):
        return APIError(400, str(e))
    if isinstance(e, QueueFull):
        return APIError(429, str(e))
    if isinstance(e, EngineDead):
        return APIError(503, str(e))
    return APIError(500, f"{type(e).__name__}: {e}")


async def _disconnected(request: Request) -> None:
    """Returns once the client has disconnected."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _merge(streams: list[AsyncGenerator[RequestOutput, None]]) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """(prompt index, output) from several request streams as they come; closing it aborts them all."""
    if len(streams) == 1:
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncGenerator[RequestOutput, None]) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
        except BaseException as e:  # noqa: B036 - handed to the reader
            await queue.put(e)
        finally:
            await queue.put(done)

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()


class _EventStream(StreamingResponse):
    """A streamed response that closes its event generator when the response ends, however it ends.

    A client that leaves mid-stream cancels the response while it sends a chunk, which leaves the
    generator suspended at its `yield`; Starlette does not close it, so only its finalization would
    (at once by reference count, or at the next cyclic collection if a reference cycle holds it). Until
    then its requests are neither aborted nor off the server's live count. Closing it here aborts them
    as the response ends."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]  # an async generator (_sse)


async def _sse(merged: Any, first: tuple[int, RequestOutput] | None, fmt: _Format, request_id: str,
               params: SamplingParams) -> AsyncIterator[str]:
    """The server-sent events of a streamed request; the client leaving cancels it (and aborts)."""
    usage = {"prompt_tokens": 0, "completion_tokens": 0}
    seen: set[int] = set()
    try:
        item = first
        while item is not None:
            i, out = item
            if i not in seen:
                seen.add(i)
                usage["prompt_tokens"] += len(out.prompt_token_ids)
                for chunk in fmt.stream_start(request_id, i, params):
                    yield _event(chunk)
            for c in out.outputs:
                usage["completion_tokens"] += len(c.token_ids)
            yield _event(fmt.chunk(request_id, i, out, params))
            try:
                item = await merged.__anext__()
            except StopAsyncIteration:
                item = None
        if (fmt.body.stream_options or {}).get("include_usage"):
            yield _event(fmt.usage_chunk(request_id, usage))
        yield "data: [DONE]\n\n"
    except (ValueError, RuntimeError) as e:
        yield _event(error_body(500, str(e)))
    finally:
        await merged.aclose()


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


# ---------------------------------------------------------------- response shapes
class _Format:
    """How one endpoint's responses look (completions or chat)."""

    def __init__(self, body: Any, config: ServerConfig, lora: LoRARequest | None = None) -> None:
        # Responses name what ran, as vLLM's do: the adapter, or the base model's served name.
        self.model = lora.lora_name if lora is not None else config.served_model_name
        self.body, self.created = body, now()

    def usage(self, outs: list[RequestOutput]) -> dict[str, int]:
        prompt = sum(len(o.prompt_token_ids) for o in outs)
        completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def usage_chunk(self, request_id: str, usage: dict[str, int]) -> dict[str, Any]:
        return {**self._head(request_id, True), "choices": [],
                "usage": {**usage, "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"]}}

    def stream_start(self, request_id: str, prompt_index: int, params: SamplingParams) -> list[dict[str, Any]]:
        return []

    def _head(self, request_id: str, chunk: bool) -> dict[str, Any]:
        raise NotImplementedError

    def full(self, request_id: str, outs: list[RequestOutput], params: SamplingParams) -> dict[str, Any]:
        raise NotImplementedError

    def chunk(self, request_id: str, prompt_index: int, out: RequestOutput, params: SamplingParams) -> dict[str, Any]:
        raise NotImplementedError


def _choice_index(prompt_index: int, c: CompletionOutput, params: SamplingParams) -> int:
    return prompt_index * params.n + (c.index if c.index < params.n else 0)


class _CompletionFormat(_Format):
    def _head(self, request_id: str, chunk: bool) -> dict[str, Any]:
        return {"id": request_id, "object": "text_completion", "created": self.created, "model": self.model}

    def full(self, request_id: str, outs: list[RequestOutput], params: SamplingParams) -> dict[str, Any]:
        choices = []
        for i, out in enumerate(outs):
            for k, c in enumerate(out.outputs):
                choices.append({"index": i * params.n + k, "text": c.text,
                                "logprobs": _completion_logprobs(c, 0), "finish_reason": c.finish_reason,
                                "stop_reason": c.stop_reason})
        return {**self._head(request_id, False), "choices": choices, "usage": self.usage(outs)}

    def chunk(self, request_id: str, prompt_index: int, out: RequestOutput, params: SamplingParams) -> dict[str, Any]:
        choices = [{"index": _choice_index(prompt_index, c, params), "text": c.text,
                    "logprobs": _completion_logprobs(c, 0), "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason} for c in out.outputs]
        return {**self._head(request_id, True), "choices": choices}


def _completion_logprobs(c: CompletionOutput, offset: int) -> dict[str, Any] | None:
    """OpenAI's legacy completion logprobs: tokens, token_logprobs, top_logprobs, text_offset."""
    if c.logprobs is None:
        return None
    tokens, token_logprobs, top, offsets = [], [], [], []
    for token_id, entry in zip(c.token_ids, c.logprobs, strict=False):
        lp = entry.get(token_id)
        text = _token_text(token_id, lp)
        offsets.append(offset)
        offset += len(text)
        tokens.append(text)
        token_logprobs.append(None if lp is None else lp.logprob)
        top.append({_token_text(t, v): v.logprob for t, v in entry.items()})
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def _token_text(token_id: int, lp: Any) -> str:
    text = None if lp is None else lp.decoded_token
    return text if text is not None else f"token_id:{token_id}"


class _ChatFormat(_Format):
    def _head(self, request_id: str, chunk: bool) -> dict[str, Any]:
        return {"id": request_id, "object": "chat.completion.chunk" if chunk else "chat.completion",
                "created": self.created, "model": self.model}

    def full(self, request_id: str, outs: list[RequestOutput], params: SamplingParams) -> dict[str, Any]:
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": self._logprobs(c), "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                   for c in outs[0].outputs]
        return {**self._head(request_id, False), "choices": choices, "usage": self.usage(outs)}

    def stream_start(self, request_id: str, prompt_index: int, params: SamplingParams) -> list[dict[str, Any]]:
        return [{**self._head(request_id, True), "choices": [
            {"index": k, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            for k in range(params.n)]}]

    def chunk(self, request_id: str, prompt_index: int, out: RequestOutput, params: SamplingParams) -> dict[str, Any]:
        choices = [{"index": c.index, "delta": {"content": c.text} if c.text or not c.finish_reason else {},
                    "logprobs": self._logprobs(c), "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                   for c in out.outputs]
        return {**self._head(request_id, True), "choices": choices}

    def _logprobs(self, c: CompletionOutput) -> dict[str, Any] | None:
        """OpenAI's chat logprobs: per token its text, logprob, bytes and the top_logprobs best."""
        if c.logprobs is None:
            return None
        k = self.body.top_logprobs or 0
        content = []
        for token_id, entry in zip(c.token_ids, c.logprobs, strict=False):
            lp = entry.get(token_id)
            text = _token_text(token_id, lp)
            best = sorted(entry.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)[:k]
            content.append({"token": text, "logprob": None if lp is None else lp.logprob,
                            "bytes": list(text.encode()),
                            "top_logprobs": [{"token": _token_text(t, v), "logprob": v.logprob,
                                              "bytes": list(_token_text(t, v).encode())} for t, v in best]})
        return {"content": content}


# ---------------------------------------------------------------- /metrics
def prometheus_text(engine: AsyncEngine, model_name: str) -> str:
    """The engine's counters and gauges in Prometheus' text format (vLLM's metric names, `graphrunner:` prefix)."""
    s = engine.stats
    label = f'model_name="{model_name}"'
    lines = []

    def metric(name: str, kind: str, help_text: str, samples: Sequence[tuple[str, float]]) -> None:
        lines.append(f"# HELP graphrunner:{name} {help_text}")
        lines.append(f"# TYPE graphrunner:{name} {kind}")
        for suffix_labels, value in samples:
            lines.append(f"graphrunner:{name}{suffix_labels} {value}")

    metric("num_requests_running", "gauge", "Requests in the running batch.", [(f"{{{label}}}", s.num_running)])
    metric("num_requests_waiting", "gauge", "Requests waiting for a batch slot.", [(f"{{{label}}}", s.num_waiting)])
    metric("num_requests_live", "gauge", "Requests the server holds (queued in the server included).",
           [(f"{{{label}}}", engine.num_live)])
    metric("kv_cache_usage_perc", "gauge", "Fraction of KV blocks in use.", [(f"{{{label}}}", s.kv_cache_usage)])
    metric("prefix_cache_hit_rate", "gauge", "Prompt tokens served from the prefix cache.",
           [(f"{{{label}}}", s.prefix_cache_hit_rate)])
    metric("num_preemptions_total", "counter", "Preemptions.", [(f"{{{label}}}", s.num_preemptions)])
    metric("prompt_tokens_total", "counter", "Prompt tokens of finished requests.", [(f"{{{label}}}", s.prompt_tokens)])
    metric("generation_tokens_total", "counter", "Generated tokens.", [(f"{{{label}}}", s.generation_tokens)])
    metric("engine_steps_total", "counter", "Engine steps run.", [(f"{{{label}}}", s.num_steps)])
    metric("request_success_total", "counter", "Finished completions by finish reason.",
           [(f'{{{label},finished_reason="{reason}"}}', count) for reason, count in sorted(s.finished.items())])
    samples: list[tuple[str, float]] = []
    for bound, count in zip(TTFT_BUCKETS, s.ttft_buckets, strict=True):
        samples.append((f'_bucket{{{label},le="{bound}"}}', count))  # cumulative: each counts every ttft <= bound
    samples += [(f'_bucket{{{label},le="+Inf"}}', s.ttft_count), (f"_sum{{{label}}}", s.ttft_sum),
                (f"_count{{{label}}}", s.ttft_count)]
    metric("time_to_first_token_seconds", "histogram", "Time from arrival to the first token.", samples)
    return "\n".join(lines) + "\n"
