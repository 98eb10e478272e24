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
busy one; the server stays up.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any

from fastapi import Body, FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from loomrl.rollout.serving import EndpointError, EpisodeServer

_TYPES = {400: "invalid_request_error", 404: "not_found_error", 409: "conflict_error"}


def create_app(server: EpisodeServer, model_name: str) -> FastAPI:
    """The HTTP routes of ``server`` (see the module docstring)."""
    app = FastAPI(title="loomrl rollouts")

    @app.exception_handler(EndpointError)
    async def _refused(_request, exc: EndpointError) -> JSONResponse:
        return _error(exc.status, str(exc))

    @app.exception_handler(RequestValidationError)
    async def _malformed(_request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or "body"
        return _error(400, f"malformed request: {where}: {first.get('msg', 'invalid')}")

    @app.exception_handler(Exception)
    async def _failed(_request, exc: Exception) -> JSONResponse:
        return _error(500, f"{type(exc).__name__}: {exc}".splitlines()[0])

    @app.get("/v1/models")
    def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "loomrl"}]}

    @app.post("/v1/episodes")
    def open_episode(body: Annotated[dict[str, Any] | None, Body()] = None) -> dict:
        episode_id = (body or {}).get("episode_id")
        if episode_id is not None and not isinstance(episode_id, str):
            raise EndpointError(400, f"episode_id must be a string, got {episode_id!r}")
        return {"episode_id": server.open(episode_id)}

    @app.post("/v1/episodes/{episode_id}/chat/completions")
    def episode_turn(episode_id: str, body: Annotated[dict[str, Any], Body()]) -> dict:
        return _completion(server, model_name, episode_id, body)

    @app.post("/v1/chat/completions")
    def turn(body: Annotated[dict[str, Any], Body()]) -> dict:
        episode_id = body.get("episode_id")
        if not isinstance(episode_id, str):
            raise EndpointError(
                400, "name the episode: POST /v1/episodes/{id}/chat/completions, or an 'episode_id' in the body"
            )
        return _completion(server, model_name, episode_id, body)

    @app.post("/v1/episodes/{episode_id}/reward")
    def reward(episode_id: str, body: Annotated[dict[str, Any], Body()]) -> dict:
        server.finish(episode_id, body.get("reward"))
        return {"episode_id": episode_id, "ended": True}

    @app.get("/v1/episodes/{episode_id}")
    def trajectory(episode_id: str) -> dict:
        return server.trajectory(episode_id)

    return app


def _completion(server: EpisodeServer, model_name: str, episode_id: str, body: dict[str, Any]) -> dict:
    if body.get("n", 1) != 1 or body.get("stream"):
        raise EndpointError(400, "one choice per request, not streamed (n=1, stream=false)")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    reply = server.chat(episode_id, body.get("messages"), max_tokens, body.get("temperature"))
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
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)
