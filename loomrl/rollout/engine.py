"""The rollout engine: continuous batching over a slot KV cache, per-sample streams, streaming, abort/resubmit.

A fixed number of slots decode together; the moment a sample finishes (eos or its token budget) its slot is
freed and the next waiting request is prefilled into it, so no step is spent on finished samples and nobody
waits for the longest one. Live samples always occupy slots ``0..n-1`` (a finishing sample's slot receives the
last live sample's cache), so decoding reads a plain slice of the cache.

Tokens are drawn from each sample's own random stream (see :mod:`loomrl.rollout.sampling`): the token at step
``t`` of a sample depends only on its key, ``t`` and the logits, never on which slot, batch or device produced
it. An aborted request returns its prefix; resubmitted with that prefix it is prefilled over prompt + prefix
and continues at step ``len(prefix)``, so the final sample equals an uninterrupted one. A request may also pause
itself at a set length (``pause_at``: a partial rollout's weight update) and be resubmitted the same way.

Multi-turn episodes continue the same way without recomputing their past: a request with ``keep_cache`` leaves
its keys and values with the engine when it finishes (out of the slots, so an episode waiting on its environment
holds no slot and no decode row); resubmitted with a prefix that extends what it generated (its turn, then the
environment's observation tokens), only the new tokens are prefilled, at their own positions, over the kept
cache. Prefilling a continuation computes the same keys, values and logits as prefilling the whole context again,
so a continued episode samples the tokens a re-prefilled one would.

Legend: B = rows in a forward, P = prefill length, V = vocabulary.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from transformers import PreTrainedModel

from loomrl.rollout.kv_cache import SlotKVCache, causal_slot_mask
from loomrl.rollout.lean_forward import lean_logits, supports_lean_forward
from loomrl.rollout.sampling import SamplingParams, sample_tokens


@dataclass
class Request:
    """One sample to generate. ``prefix`` (with its log-probs) resumes an aborted request."""

    sample_id: int
    prompt: list[int]
    key: int
    """The sample's random-stream key (see :func:`loomrl.rollout.sampling.stream_keys`)."""
    max_new_tokens: int | None = None
    """Token budget of this sample (prefix included); None uses the engine's SamplingParams."""
    prefix: list[int] = field(default_factory=list)
    prefix_logps: list[float] = field(default_factory=list)
    keep_cache: bool = False
    """Keep this sample's keys and values when it finishes (not when aborted), for a resubmission whose prefix
    extends its tokens (the next turn of an episode); :meth:`RolloutEngine.release` drops them."""
    pause_at: int | None = None
    """Stop the sample, unfinished, once it has this many tokens (prefix included), as ``paused``: a partial
    rollout's weight update interrupts it there, and resubmitted with its tokens as the prefix it continues."""


@dataclass
class _Kept:
    """A finished sample's keys and values, kept for its continuation."""

    context: list[int]
    """Prompt and tokens whose keys and values are kept (all but the last sampled token)."""
    kv: list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class Completion:
    """A finished (or aborted) sample: every generated token, its log-prob, and why it stopped."""

    sample_id: int
    tokens: list[int]
    logps: list[float]
    finish_reason: str
    """'eos', 'stop' (a stop token), 'length', 'aborted' or 'paused' (unfinished at its ``pause_at``)."""


@dataclass
class _Live:
    request: Request
    budget: int
    tokens: list[int]
    logps: list[float]
    cached: int
    """Tokens of prompt + generated whose keys/values are in the cache (the last sampled token is not yet)."""


def generation_eos_ids(model: PreTrainedModel) -> tuple[int, ...]:
    """The eos ids of ``model``'s generation config (an int, a list, or none)."""
    config = getattr(model, "generation_config", None)
    ids = getattr(config, "eos_token_id", None)
    if ids is None:
        return ()
    return (int(ids),) if isinstance(ids, int) else tuple(int(i) for i in ids)


class RolloutEngine:
    """Continuous-batching generator for one HF decoder-only model (implements GenerationBackend)."""

    def __init__(
        self,
        model: PreTrainedModel,
        params: SamplingParams,
        eos_id: int | Sequence[int],
        pad_id: int,
        slots: int = 64,
        max_len: int | None = None,
        prefill_tokens: int = 4096,
    ):
        self.model, self.params = model, params
        self.pad_id = pad_id
        self.eos_ids = frozenset((eos_id,) if isinstance(eos_id, int) else eos_id)
        """Tokens that end a sample as eos (the callers give the tokenizer's eos and every eos id of the model's
        generation config: :func:`generation_eos_ids`)."""
        self.slots, self.prefill_tokens = slots, prefill_tokens
        self.max_len = max_len or model.config.max_position_embeddings
        self.device = next(model.parameters()).device
        self.waiting: deque[Request] = deque()
        self.live: list[_Live] = []
        self.kept: dict[int, _Kept] = {}
        """Caches of finished ``keep_cache`` samples, by sample id, until resubmitted or released."""
        self.cache: SlotKVCache | None = None
        self.finished_lengths: list[int] = []
        self._last_prefill = (0, 0)
        self.step_log: list[tuple[int, int, int]] = []
        """(rows decoded, rows prefilled, prefill tokens) per step: the workload the cost model prices."""
        self.lean = supports_lean_forward(model)
        """Whether forwards take :func:`~loomrl.rollout.lean_forward.lean_logits` (the model's arithmetic without
        its module layers) rather than the model's own forward."""

    # ----------------------------------------------------------------------------------------- requests
    def submit(self, requests: Iterable[Request]) -> None:
        for req in requests:
            budget = req.max_new_tokens or self.params.max_new_tokens
            if len(req.prompt) + budget > self.max_len:
                raise ValueError(
                    f"sample {req.sample_id}: prompt {len(req.prompt)} + budget {budget} tokens "
                    f"exceeds the engine's max_len {self.max_len}"
                )
            self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.live)

    def abort(self, sample_ids: Iterable[int]) -> list[Completion]:
        """Stop these samples (waiting or live) and return what each has generated so far."""
        wanted = set(sample_ids)
        out = [
            Completion(r.sample_id, list(r.prefix), list(r.prefix_logps), "aborted")
            for r in self.waiting
            if r.sample_id in wanted
        ]
        self.waiting = deque(r for r in self.waiting if r.sample_id not in wanted)
        for slot in reversed(range(len(self.live))):
            live = self.live[slot]
            if live.request.sample_id in wanted:
                out.append(Completion(live.request.sample_id, live.tokens, live.logps, "aborted"))
                self._free(slot)
        return out

    def release(self, sample_ids: Iterable[int]) -> None:
        """Drop the kept caches of these samples (episodes that ended)."""
        for sid in sample_ids:
            self.kept.pop(sid, None)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy new full weights in place (e.g. after a train step); live samples continue with them.

        The full-state-dict setter also fills tensor-parallel (DTensor) parameters from full tensors. Kept caches
        were computed with the old weights: they are dropped, and continuations prefill their whole context.
        """
        self.kept.clear()
        set_model_state_dict(
            self.model, dict(named_tensors), options=StateDictOptions(full_state_dict=True, strict=False)
        )

    # ------------------------------------------------------------------------------------------ running
    def step(self) -> list[Completion]:
        """Decode one token for every live sample, then fill free slots; returns the samples that finished."""
        if self.cache is None:
            self.cache = SlotKVCache(self.slots, self.max_len)
        was_training = self.model.training
        if was_training:  # a call per module: callers decoding many steps set eval mode once, around them all
            self.model.eval()
        decoded = len(self.live)
        with torch.no_grad():
            done = self._decode()
            done += self._admit()
        if was_training:
            self.model.train()
        self.step_log.append((decoded, *self._last_prefill))
        return done

    def stream(self, requests: Iterable[Request] = ()) -> Iterator[Completion]:
        """Yield samples in the order they finish, until nothing is waiting or live."""
        self.submit(requests)
        while self.has_work():
            yield from self.step()

    def generate(self, requests: Sequence[Request]) -> list[Completion]:
        """All requests to completion, returned in request order."""
        by_id = {c.sample_id: c for c in self.stream(requests)}
        return [by_id[r.sample_id] for r in requests]

    # -------------------------------------------------------------------------------------- internals
    def _sample(self, logits_BV: torch.Tensor, lives: Sequence[_Live]) -> list[Completion]:
        keys_B = torch.tensor([lv.request.key for lv in lives], dtype=torch.int64, device=self.device)
        steps_B = torch.tensor([len(lv.tokens) for lv in lives], dtype=torch.int64, device=self.device)
        tok_B, logp_B = sample_tokens(logits_BV, keys_B, steps_B, self.params)
        # the step's one read back from the device, tokens and log-probs together (float64 holds both exactly)
        toks, logps = torch.stack((tok_B.to(torch.float64), logp_B.to(torch.float64))).tolist()
        done = []
        for lv, tok, lp in zip(lives, map(int, toks), logps):
            lv.tokens.append(tok)
            lv.logps.append(lp)
            eos = tok in self.eos_ids and not self.params.ignore_eos
            if eos or tok in self.params.stop_ids or len(lv.tokens) >= lv.budget:
                reason = "eos" if eos else "stop" if tok in self.params.stop_ids else "length"
                done.append(Completion(lv.request.sample_id, lv.tokens, lv.logps, reason))
            elif lv.request.pause_at is not None and len(lv.tokens) >= lv.request.pause_at:
                done.append(Completion(lv.request.sample_id, lv.tokens, lv.logps, "paused"))
        return done

    def _decode(self) -> list[Completion]:
        n = len(self.live)
        if n == 0:
            return []
        pos_B1 = torch.tensor([[lv.cached] for lv in self.live], device=self.device)
        kv_len = max(lv.cached for lv in self.live) + 1  # from the host's own count: no wait on the device
        self.cache.bind(range(n), pos_B1, kv_len)
        ids_B1 = torch.tensor([[lv.tokens[-1]] for lv in self.live], device=self.device)
        logits_BV = self._forward(ids_B1, pos_B1, kv_len, torch.zeros(n, dtype=torch.long, device=self.device))
        for lv in self.live:
            lv.cached += 1
        done = self._sample(logits_BV, self.live)
        self._release(done)
        return done

    def _admit(self) -> list[Completion]:
        """Prefill waiting requests into free slots (within the prefill token budget): the whole context, or
        for a continuation only what its kept cache lacks."""
        batch: list[_Live] = []
        starts: list[int] = []
        tokens = 0
        while self.waiting and len(self.live) + len(batch) < self.slots:
            req = self.waiting[0]
            ctx = len(req.prompt) + len(req.prefix)
            start = self._kept_length(req)
            if batch and tokens + ctx - start > self.prefill_tokens:
                break
            self.waiting.popleft()
            tokens += ctx - start
            starts.append(start)
            budget = req.max_new_tokens or self.params.max_new_tokens
            batch.append(_Live(req, budget, list(req.prefix), list(req.prefix_logps), ctx))
        self._last_prefill = (len(batch), tokens)
        if not batch:
            return []
        first = len(self.live)
        self.live.extend(batch)
        contexts = [lv.request.prompt + lv.request.prefix for lv in batch]
        for b, (lv, start) in enumerate(zip(batch, starts)):
            kept = self.kept.pop(lv.request.sample_id, None)
            if start:
                self.cache.restore_slot(first + b, kept.kv)
        # a group's samples share their prompt (GRPO, RLOO): each distinct context is prefilled once, into its
        # first sample's slot, and its keys and values copied to the others' slots
        distinct: dict[tuple[int, ...], int] = {}
        owner_B = [distinct.setdefault(tuple(c), b) if not s else b for b, (c, s) in enumerate(zip(contexts, starts))]
        rows_U = sorted(set(owner_B))
        width = max(len(contexts[b]) - starts[b] for b in rows_U)
        # built on the host and moved once: no per-row copies, and the key length from the host's own numbers
        ids_UP = torch.full((len(rows_U), width), self.pad_id, dtype=torch.long)
        pos_UP = torch.arange(width).repeat(len(rows_U), 1)
        for u, b in enumerate(rows_U):
            new = contexts[b][starts[b] :]
            ids_UP[u, : len(new)] = torch.tensor(new)
            if starts[b]:
                # a continuation's padding repeats its last token at its last position: the same keys and values
                # written twice, never a stray entry past its context
                ids_UP[u, len(new) :] = new[-1]
                pos_UP[u] = (pos_UP[u] + starts[b]).clamp(max=starts[b] + len(new) - 1)
        kv_len = max(width if not starts[b] else len(contexts[b]) for b in rows_U)
        ids_UP, pos_UP = ids_UP.to(self.device), pos_UP.to(self.device)
        self.cache.bind([first + b for b in rows_U], pos_UP, kv_len)
        last_U = torch.tensor([len(contexts[b]) - starts[b] - 1 for b in rows_U], device=self.device)
        logits_UV = self._forward(ids_UP, pos_UP, kv_len, last_U)
        for b, owner in enumerate(owner_B):
            if owner != b:
                self.cache.copy_slot(first + owner, first + b, len(contexts[b]))
        index = {b: u for u, b in enumerate(rows_U)}
        u_B = torch.tensor([index[o] for o in owner_B], device=self.device)
        done = self._sample(logits_UV[u_B], batch)
        self._release(done)
        return done

    def _kept_length(self, req: Request) -> int:
        """How many leading tokens of ``req``'s context a kept cache holds (0: none, or not a prefix of it); at
        least one token is always prefilled, for its logits."""
        kept = self.kept.get(req.sample_id)
        if kept is None:
            return 0
        context = req.prompt + req.prefix
        n = len(kept.context)
        if context[:n] != kept.context:
            del self.kept[req.sample_id]
            return 0
        return min(n, len(context) - 1)

    def _forward(self, ids_BQ: torch.Tensor, pos_BQ: torch.Tensor, kv_len: int, last_B: torch.Tensor) -> torch.Tensor:
        """logits_BV at column ``last_B[b]`` of each row (the position a token is sampled from)."""
        mask = causal_slot_mask(pos_BQ, kv_len, self.model.dtype)
        if self.lean:
            return lean_logits(self.model, ids_BQ, pos_BQ, mask, self.cache, last_B)
        out = self.model(
            input_ids=ids_BQ, attention_mask=mask, position_ids=pos_BQ, past_key_values=self.cache, use_cache=True
        )
        return out.logits[torch.arange(len(last_B), device=last_B.device), last_B]

    def _release(self, done: Sequence[Completion]) -> None:
        finished = {c.sample_id: c.finish_reason for c in done}
        for slot in reversed(range(len(self.live))):
            live = self.live[slot]
            if live.request.sample_id in finished:
                if finished[live.request.sample_id] == "paused":
                    self._free(slot)
                    continue
                self.finished_lengths.append(len(live.tokens))
                if live.request.keep_cache:
                    context = (live.request.prompt + live.tokens)[: live.cached]
                    self.kept[live.request.sample_id] = _Kept(context, self.cache.save_slot(slot, live.cached))
                self._free(slot)

    def _free(self, slot: int) -> None:
        """Drop a slot, moving the last live sample into it so live slots stay 0..n-1."""
        last = len(self.live) - 1
        if slot != last:
            self.cache.move_slot(last, slot, self.live[last].cached)
            self.live[slot] = self.live[last]
        self.live.pop()
