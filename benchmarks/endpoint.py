"""The rollout endpoint under load: agents driving `loomrl serve-rollouts` through the real ``openai`` client over
loopback, against the same episodes run in process on the engine.

    .venv/bin/python benchmarks/endpoint.py [--model smollm2-135m-instruct] [--agents 1,16,64] [--turns 2]
        [--turn-tokens 24] [--storm 10000]

For each count of agents, a fresh ``loomrl serve-rollouts`` process (same seed, flags below) serves that many
agents at once; each opens its episode (in order, so agent i has sample i's random stream), then runs ``--turns``
turns of at most ``--turn-tokens`` tokens, appending the reply and a fixed user message, and reports a reward. The
same episodes then run in this process on one engine: every agent's turn submitted together, the observations
through the same chat template; their sampled tokens are identical (checked against the served trajectories), so
the two rates count the same tokens. Reported: turns/s, sampled tokens/s, turn latency p50/p99 (a turn's request
to its reply, as the client sees it; in process, its submission to its completion), the first turn's latency, and
the ratio of the rates. Both paths run the engine on ``--threads`` CPU threads (the server's default: all cores but
one). ``--storm N`` opens N episodes on one more server, one in ten taking a short turn, none
ending (``--idle-timeout`` short so they expire), and reports the server's resident memory before and after.
Bounded: loopback only, every request with a timeout, each row within ``--row-timeout`` seconds.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402
import openai  # noqa: E402
from rich.console import Console  # noqa: E402

from loomrl.report import summary_table  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FOLLOW_UP = "Check it and give the result again."


def question(i: int) -> str:
    return f"What is {17 + i} plus {5 * i + 3}? Answer briefly."


def serve(args: argparse.Namespace, *extra: str) -> tuple[subprocess.Popen, str]:
    """A ``loomrl serve-rollouts`` process on a free loopback port, and its base URL once it serves."""
    cmd = [sys.executable, "-m", "loomrl.cli", "serve-rollouts", args.model, "--port", "0", "--seed", "0"]
    cmd += ["--max-tokens", str(args.max_tokens), "--slots", str(args.slots), "--max-len", str(args.max_len)]
    cmd += ["--threads", str(args.threads), *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line.startswith("serving "):
        proc.kill()
        raise SystemExit(f"endpoint: the server did not start: {line}{proc.stderr.read()[-2000:]}")
    return proc, line.split(" on ")[1].split()[0]


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def http_row(args: argparse.Namespace, agents: int) -> tuple[dict, list[list[int]]]:
    """``agents`` agents at once against a fresh server: the row's figures and each episode's response ids."""
    proc, base = serve(args)
    try:
        plain = httpx.Client(timeout=args.row_timeout)
        episodes = [plain.post(f"{base}/episodes").json()["episode_id"] for _ in range(agents)]
        latencies: list[float] = []
        firsts: list[float] = []
        sampled = [0] * agents
        start = threading.Barrier(agents + 1)

        def agent(i: int) -> None:
            client = openai.OpenAI(
                base_url=f"{base}/episodes/{episodes[i]}", api_key="unused", timeout=args.row_timeout, max_retries=0
            )
            messages = [{"role": "user", "content": question(i)}]
            start.wait()
            for turn in range(args.turns):
                t0 = time.perf_counter()
                reply = client.chat.completions.create(model=args.model, messages=messages, max_tokens=args.turn_tokens)
                (firsts if turn == 0 else latencies).append(time.perf_counter() - t0)
                sampled[i] += reply.usage.completion_tokens
                text = reply.choices[0].message.content
                messages += [{"role": "assistant", "content": text}, {"role": "user", "content": FOLLOW_UP}]
            plain.post(f"{base}/episodes/{episodes[i]}/reward", json={"reward": 1.0})

        with ThreadPoolExecutor(agents) as pool:
            runs = [pool.submit(agent, i) for i in range(agents)]
            start.wait()
            t0 = time.perf_counter()
            for run in runs:
                run.result(timeout=args.row_timeout)
            seconds = time.perf_counter() - t0
        tokens = [plain.get(f"{base}/episodes/{e}").json() for e in episodes]
        rss = rss_mib(proc.pid)
    finally:
        stop(proc)
    latencies = sorted(firsts + latencies)
    row = {
        "agents": agents,
        "path": "HTTP (openai client)",
        "turns/s": agents * args.turns / seconds,
        "sampled tokens/s": sum(sampled) / seconds,
        "turn p50 s": _quantile(latencies, 0.5),
        "turn p99 s": _quantile(latencies, 0.99),
        "first turn s": max(firsts),
        "server RSS MiB": rss,
    }
    return row, [[t for t, m in zip(tr["response_ids"], tr["mask"]) if m] for tr in tokens]


def in_process_row(args: argparse.Namespace, agents: int, engine, tokenizer, decode) -> tuple[dict, list[list[int]]]:
    """The same episodes on one engine in this process: each turn of every agent submitted together."""
    from loomrl.rollout import Request, stream_keys
    from loomrl.rollout.episodes import ObservationTokens, conversation_ids

    observe = ObservationTokens(tokenizer, [*engine.eos_ids, *engine.params.stop_ids])
    keys = stream_keys(0, 0, range(agents)).tolist()
    prompts = [conversation_ids(tokenizer, [{"role": "user", "content": question(i)}]) for i in range(agents)]
    observed = observe([{"role": "user", "content": FOLLOW_UP}])
    tokens: list[list[int]] = [[] for _ in range(agents)]
    logps: list[list[float]] = [[] for _ in range(agents)]
    sampled: list[list[int]] = [[] for _ in range(agents)]
    latencies, firsts = [], []
    t0 = time.perf_counter()
    for turn in range(args.turns):
        requests = []
        for i in range(agents):
            prefix = tokens[i] + (observed if turn else [])
            lp = logps[i] + ([0.0] * len(observed) if turn else [])
            room = min(args.max_tokens - len(prefix), engine.max_len - len(prompts[i]) - len(prefix))
            budget = len(prefix) + min(room, args.turn_tokens)
            requests.append(Request(i, prompts[i], keys[i], budget, prefix, lp, True))
        submitted = time.perf_counter()
        for c in engine.stream(requests):
            (firsts if turn == 0 else latencies).append(time.perf_counter() - submitted)
            start = len(requests[c.sample_id].prefix)
            sampled[c.sample_id] += c.tokens[start:]
            tokens[c.sample_id], logps[c.sample_id] = list(c.tokens), list(c.logps)
    seconds = time.perf_counter() - t0
    engine.release(range(agents))
    latencies = sorted(firsts + latencies)
    row = {
        "agents": agents,
        "path": "in process (engine)",
        "turns/s": agents * args.turns / seconds,
        "sampled tokens/s": sum(map(len, sampled)) / seconds,
        "turn p50 s": _quantile(latencies, 0.5),
        "turn p99 s": _quantile(latencies, 0.99),
        "first turn s": max(firsts),
    }
    return row, sampled


def storm(args: argparse.Namespace) -> dict:
    """``--storm`` abandoned episodes, one in ten after a short turn, against a server whose idle episodes expire."""
    proc, base = serve(args, "--idle-timeout", "5")
    try:
        before = rss_mib(proc.pid)
        client = httpx.Client(timeout=60)
        refused = 0

        def abandon(i: int) -> None:
            nonlocal refused
            opened = client.post(f"{base}/episodes")
            if opened.status_code != 200:
                refused += 1
                return
            eid = opened.json()["episode_id"]
            if i % 10:  # one in ten takes a turn (its cache is kept) before its agent goes away
                return
            body = {"messages": [{"role": "user", "content": question(i)}], "max_tokens": 2}
            client.post(f"{base}/episodes/{eid}/chat/completions", json=body)

        t0 = time.perf_counter()
        peak = before
        with ThreadPoolExecutor(16) as pool:
            for i, _ in enumerate(pool.map(abandon, range(args.storm))):
                if i % 500 == 0:
                    peak = max(peak, rss_mib(proc.pid))
        seconds = time.perf_counter() - t0
        after = rss_mib(proc.pid)
    finally:
        stop(proc)
    return {
        "abandoned episodes": args.storm,
        "refused at --max-episodes": refused,
        "seconds": seconds,
        "RSS before MiB": before,
        "RSS peak MiB": max(peak, after),
        "RSS after MiB": after,
    }


def _quantile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def build_engine(args: argparse.Namespace):
    """The model, as ``loomrl serve-rollouts`` builds it, on one engine."""
    import torch

    from loomrl.models.tokenizer import decode_response, tokenizer_for
    from loomrl.models.zoo import build_causal_lm
    from loomrl.rollout import RolloutEngine, SamplingParams, generation_eos_ids

    torch.set_num_threads(args.threads)
    tokenizer = tokenizer_for(args.model)
    model = build_causal_lm(args.model, tokenizer, 0).to("cpu", torch.float32).eval()
    params = SamplingParams(args.max_tokens, 1.0)
    eos_ids = (tokenizer.eos_token_id, *generation_eos_ids(model))
    max_len = min(args.max_len, model.config.max_position_embeddings)
    engine = RolloutEngine(model, params, eos_ids, tokenizer.pad_token_id or 0, slots=args.slots, max_len=max_len)
    return engine, tokenizer, lambda ids: decode_response(tokenizer, ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--agents", default="1,16,64", help="comma-separated counts of concurrent agents")
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--turn-tokens", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=256, help="an episode's tokens (the server's --max-tokens)")
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--storm", type=int, default=0, help="abandoned episodes to open on one more server (0: none)")
    ap.add_argument("--row-timeout", type=float, default=600.0)
    ap.add_argument(
        "--threads", type=int, default=0, help="the engine's CPU threads, served and in process (0: all cores but one)"
    )
    args = ap.parse_args()
    args.threads = args.threads or max(1, (os.cpu_count() or 2) - 1)
    counts = [int(x) for x in args.agents.split(",")]
    if any(c < 1 or c > 256 for c in counts) or args.turns < 1 or args.turn_tokens < 1:
        raise SystemExit("endpoint: --agents must be counts in 1..256, --turns and --turn-tokens at least 1")
    engine, tokenizer, decode = build_engine(args)
    from loomrl.rollout import Request

    engine.generate([Request(-1, [engine.pad_id] * 4, 0, 2)])  # warm, as the server warms itself
    rows, ratios = [], []
    for agents in counts:
        served, served_tokens = http_row(args, agents)
        local, local_tokens = in_process_row(args, agents, engine, tokenizer, decode)
        same = served_tokens == local_tokens
        served["same tokens"] = local["same tokens"] = "yes" if same else "NO"
        ratios.append((agents, served["sampled tokens/s"] / local["sampled tokens/s"]))
        rows += [served, local]
    console = Console(width=170)
    title = f"{args.model}: agents × {args.turns} turns of ≤ {args.turn_tokens} tokens, loopback"
    console.print(summary_table(rows, title))
    for agents, ratio in ratios:
        console.print(f"{agents} agents: HTTP sampled tokens/s = {ratio:.2f} of in process")
    if args.storm:
        console.print(summary_table([storm(args)], f"{args.storm} abandoned episodes (--idle-timeout 5)"))


if __name__ == "__main__":
    main()
