"""`loomrl serve-rollouts`: a model behind an OpenAI-compatible endpoint whose conversations are episodes.

Agents written against the ``openai`` client talk to it unmodified (``base_url=<url>/episodes/<id>``, after
``POST <url>/episodes``); every episode keeps its exact token ids and log-probs, and each ended episode (its
reward reported) is appended to ``--trajectories`` as one JSON line, ready to train on. The routes:
:mod:`loomrl.rollout.openai_api`; what a request and the server's state may hold: the limit flags
(:class:`~loomrl.rollout.serving.ServingLimits`). Its memory is the model, the KV cache (``--slots × --max-len``
tokens, allocated and touched before the address is printed), the kept caches (``--kept-tokens``) and at most
``--max-episodes`` open and as many ended episodes of at most ``--max-len`` tokens each.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
from pathlib import Path

__all__ = ["run_serve_rollouts"]


def run_serve_rollouts(args: argparse.Namespace) -> int:
    import torch
    import uvicorn

    from loomrl.errors import DataError
    from loomrl.models.tokenizer import decode_response, tokenizer_for
    from loomrl.models.zoo import build_causal_lm, check_model_spec
    from loomrl.role.devices import resolve_device, resolve_dtype
    from loomrl.rollout import RolloutEngine, SamplingParams, generation_eos_ids
    from loomrl.rollout.openai_api import create_app
    from loomrl.rollout.serving import EpisodeServer

    limits = _limits(args)
    # the engine's threads leave a core to the HTTP side: intra-op threads contending with it for the cores
    # slow every decode step many times over (a 24-token turn took 10 to 70 s instead of 1.4 s on 2 busy cores)
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 2) - 1))
    check_model_spec(args.model)
    tokenizer = tokenizer_for(args.model, chat_template=args.chat_template)
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"model '{args.model}': its tokenizer has no chat template, which chat requests need "
            "(give --chat-template FILE, a Jinja template)"
        )
    device = resolve_device(args.device, "--device")
    model = build_causal_lm(args.model, tokenizer, args.seed).to(device, resolve_dtype(args.precision, device)).eval()
    stops = []
    for text in args.stop_token:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) != 1:
            raise DataError(f"--stop-token {text!r}: is {len(ids)} tokens of this tokenizer, not one")
        stops.append(ids[0])
    params = SamplingParams(args.max_tokens, args.temperature, top_p=args.top_p, stop_ids=tuple(stops))
    eos_ids = (tokenizer.eos_token_id, *generation_eos_ids(model))
    max_len = min(args.max_len, model.config.max_position_embeddings)  # a model's positions bound it too
    engine = RolloutEngine(model, params, eos_ids, tokenizer.pad_token_id or 0, slots=args.slots, max_len=max_len)
    trajectories = Path(args.trajectories) if args.trajectories else None
    lock = threading.Lock()

    def write(trajectory: dict) -> None:
        if trajectories is not None:
            with lock, trajectories.open("a", encoding="utf-8") as f:
                f.write(json.dumps(trajectory) + "\n")

    server = EpisodeServer(
        engine,
        tokenizer,
        lambda ids: decode_response(tokenizer, ids),
        args.max_tokens,
        args.seed,
        on_end=write,
        limits=limits,
    )
    server.warm()
    http = uvicorn.Server(
        uvicorn.Config(create_app(server, args.model), host=args.host, port=args.port, log_level="warning")
    )
    stop = threading.Event()
    web = threading.Thread(target=http.run, name="http", daemon=True)
    web.start()
    while not http.started and web.is_alive():
        stop.wait(0.05)
    if not web.is_alive():
        raise DataError(f"--port {args.port}: the server could not start on {args.host}:{args.port}")
    port = http.servers[0].sockets[0].getsockname()[1]
    cache_gib = _cache_bytes(engine) / 2**30
    print(
        f"serving {args.model} on http://{args.host}:{port}/v1 (episodes: POST /v1/episodes; KV cache "
        f"{args.slots} slots × {max_len} tokens, {cache_gib:.2f} GiB)",
        flush=True,
    )
    try:
        server.run(lambda: not web.is_alive())  # the engine on this thread, until the HTTP server stops
    except KeyboardInterrupt:
        pass
    finally:
        http.should_exit = True
        web.join(timeout=10)
    return 0


def _limits(args: argparse.Namespace):
    """The serving limits of the flags, each checked with a one-line error naming it."""
    from loomrl.errors import DataError
    from loomrl.rollout.serving import ServingLimits

    for flag, value, low in (
        ("--slots", args.slots, 1),
        ("--max-len", args.max_len, 2),
        ("--max-tokens", args.max_tokens, 1),
        ("--max-body-bytes", args.max_body_bytes, 1024),
        ("--max-messages", args.max_messages, 1),
        ("--max-episodes", args.max_episodes, 1),
        ("--idle-timeout", args.idle_timeout, 0),
        ("--kept-tokens", args.kept_tokens, 0),
        ("--turn-timeout", args.turn_timeout, 0),
        ("--threads", args.threads, 0),
    ):
        if not value >= low:
            raise DataError(f"{flag} {value}: must be at least {low}")
    return ServingLimits(
        max_body_bytes=args.max_body_bytes,
        max_messages=args.max_messages,
        max_episodes=args.max_episodes,
        idle_timeout_s=args.idle_timeout,
        kept_tokens=args.kept_tokens,
        ended=args.max_episodes,
        turn_timeout_s=args.turn_timeout,
    )


def _cache_bytes(engine) -> int:
    """The bytes of the engine's slot cache (allocated by the warm-up's first forward)."""
    cache = engine.cache
    if cache is None:
        return 0
    return sum(t.numel() * t.element_size() for t in (*cache.keys, *cache.values))
