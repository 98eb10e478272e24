"""The OpenAI-compatible HTTP face of an :class:`~loomrl.rollout.serving.EpisodeServer` (FastAPI, as vLLM and
SGLang serve theirs).

    POST /v1/episodes                              start an episode: {"episode_id": ...}
    POST /v1/episodes/{id}/chat/completions        a turn of episode {id}: an OpenAI chat completion request
    POST /v1/chat/completions                      the same, naming the episode in the body ("episode_id")
    POST /v1/episodes/{id}/reward                  {"reward": 1.0}: the episode's reward; it ends the episode
    GET  /v1/episodes/{id}                         its trajectory: prompt and response token ids, log-probs, mask
    GET  /v1/models                                the served model

An agent written against the ``openai`` client runs unmodified with ``base_url=<server>/v1/episodes/<id>``
(or passes ``extra_body={"episode_id": id}``). Errors are OpenAI's shape, ``{"error": {"message": <one line>,
"type": ..., "code": <status>}}``: 400 for a malformed request, 404 for an unknown episode, 409 for an ended or
busy one, 410 for one expired or forgotten, 413 for a body over the limit, 429 at the open-episode limit, 500 for a
turn the engine failed on (it ends that episode), 504 for a turn not answered in time; the server stays up.

A turn's route is a coroutine waiting on the engine's future, so any number of agents' turns are in flight at
once (none holds a thread while the engine decodes it); only checking and tokenizing a request runs on a worker
thread. Bodies are read up to ``--max-body-bytes`` and refused past it, whatever their declared length.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from loomrl.rollout.serving import EndpointError, EpisodeServer

_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    409: "conflict_error",
    410: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


def create_app(server: EpisodeServer, model_name: str) -> FastAPI:
    """The HTTP routes of ``server`` (see the module docstring)."""
    app = FastAPI(title="loomrl rollouts", openapi_url=None, docs_url=None, redoc_url=None)
    limit = server.limits.max_body_bytes

    @app.exception_handler(EndpointError)
    async def _refused(_request, exc: EndpointError) -> JSONResponse:
        return _error(exc.status, str(exc))

    @app.exception_handler(HTTPException)
    async def _http(_request, exc: HTTPException) -> JSONResponse:  # unknown routes, wrong methods
        return _error(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _failed(_request, exc: Exception) -> JSONResponse:
        return _error(500, f"{type(exc).__name__}: {exc}")

    async def body_of(request: Request, optional: bool = False) -> dict[str, Any]:
        """The request's JSON object, read up to the body limit."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise EndpointError(
                413, f"request body of {int(declared)} bytes is over the limit of {limit} (--max-body-bytes)"
            )
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > limit:
                raise EndpointError(413, f"request body is over the limit of {limit} bytes (--max-body-bytes)")
        if optional and not raw.strip():
            return {}
        try:
            body = json.loads(raw)
        except RecursionError:
            raise EndpointError(400, "malformed request: JSON nested too deeply") from None
        except ValueError as exc:  # bad JSON, or bytes that are not UTF-8
            raise EndpointError(400, f"malformed request: the body is not JSON ({exc})") from None
        if optional and body is None:
            return {}
        if not isinstance(body, dict):
            raise EndpointError(400, f"malformed request: the body must be a JSON object, not {type(body).__name__}")
        return body

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "loomrl"}]}

    @app.post("/v1/episodes")
    async def open_episode(request: Request) -> dict:
        episode_id = (await body_of(request, optional=True)).get("episode_id")
        if episode_id is not None and not isinstance(episode_id, str):
            raise EndpointError(400, f"episode_id must be a string, got {type(episode_id).__name__}")
        return {"episode_id": server.open(episode_id)}

    @app.post("/v1/episodes/{episode_id}/chat/completions")
    async def episode_turn(episode_id: str, request: Request) -> dict:
        return await _completion(server, model_name, episode_id, await body_of(request))

    @app.post("/v1/chat/completions")
    async def turn(request: Request) -> dict:
        body = await body_of(request)
        episode_id = body.get("episode_id")
        if not isinstance(episode_id, str):
            raise EndpointError(
                400, "name the episode: POST /v1/episodes/{id}/chat/completions, or an 'episode_id' in the body"
            )
        return await _completion(server, model_name, episode_id, body)

    @app.post("/v1/episodes/{episode_id}/reward")
    async def reward(episode_id: str, request: Request) -> dict:
        body = await body_of(request)
        await run_in_threadpool(server.finish, episode_id, body.get("reward"))  # it may write a trajectory
        return {"episode_id": episode_id, "ended": True}

    @app.get("/v1/episodes/{episode_id}")
    async def trajectory(episode_id: str) -> dict:
        return server.trajectory(episode_id)

    return app


async def _completion(server: EpisodeServer, model_name: str, episode_id: str, body: dict[str, Any]) -> dict:
    if body.get("n", 1) != 1 or body.get("stream"):
        raise EndpointError(400, "one choice per request, not streamed (n=1, stream=false)")
    # shielded: a client that goes away mid-turn leaves the turn to finish and its episode consistent, not busy
    return await asyncio.shield(asyncio.ensure_future(_turn(server, model_name, episode_id, body)))


async def _turn(server: EpisodeServer, model_name: str, episode_id: str, body: dict[str, Any]) -> dict:
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    turn = await run_in_threadpool(server.begin, episode_id, body.get("messages"), max_tokens, body.get("temperature"))
    timeout = server.limits.turn_timeout_s
    try:
        completion = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(turn.future)), timeout or None)
    except Exception as exc:  # timed out, or the engine failed on it
        raise server.failed(turn, exc, timeout) from None
    reply = server.conclude(turn, completion)
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": reply["content"]},
                "finish_reason": reply["finish_reason"],
                "logprobs": None,
            }
        ],
        "usage": {
            "prompt_tokens": reply["prompt_tokens"],
            "completion_tokens": reply["completion_tokens"],
            "total_tokens": reply["prompt_tokens"] + reply["completion_tokens"],
        },
    }


def _error(status: int, message: str) -> JSONResponse:
    kind = _TYPES.get(status, "server_error")
    line = " ".join(message.split())[:500]  # one line, however the message came
    return JSONResponse({"error": {"message": line, "type": kind, "code": status}}, status_code=status)
