"""`loomrl serve-rollouts`: a model behind an OpenAI-compatible endpoint whose conversations are episodes.

Agents written against the ``openai`` client talk to it unmodified (``base_url=<url>/episodes/<id>``, after
``POST <url>/episodes``); every episode keeps its exact token ids and log-probs, and each ended episode (its
reward reported) is appended to ``--trajectories`` as one JSON line, ready to train on. The routes:
:mod:`loomrl.rollout.openai_api`.
"""

from __future__ import annotations

import argparse
import json
import threading
from pathlib import Path

__all__ = ["run_serve_rollouts"]


def run_serve_rollouts(args: argparse.Namespace) -> int:
    import uvicorn

    from loomrl.errors import DataError
    from loomrl.models.tokenizer import decode_response, tokenizer_for
    from loomrl.models.zoo import build_causal_lm, check_model_spec
    from loomrl.role.devices import resolve_device, resolve_dtype
    from loomrl.rollout import RolloutEngine, SamplingParams, generation_eos_ids
    from loomrl.rollout.openai_api import create_app
    from loomrl.rollout.serving import EpisodeServer

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
    engine = RolloutEngine(model, params, eos_ids, tokenizer.pad_token_id or 0, slots=args.slots)
    trajectories = Path(args.trajectories) if args.trajectories else None
    lock = threading.Lock()

    def write(trajectory: dict) -> None:
        if trajectories is not None:
            with lock, trajectories.open("a", encoding="utf-8") as f:
                f.write(json.dumps(trajectory) + "\n")

    server = EpisodeServer(
        engine, tokenizer, lambda ids: decode_response(tokenizer, ids), args.max_tokens, args.seed, on_end=write
    )
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
    print(f"serving {args.model} on http://{args.host}:{port}/v1 (episodes: POST /v1/episodes)", flush=True)
    try:
        server.run(lambda: not web.is_alive())  # the engine on this thread, until the HTTP server stops
    except KeyboardInterrupt:
        pass
    finally:
        http.should_exit = True
        web.join(timeout=10)
    return 0
