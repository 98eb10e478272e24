"""vLLM as a rollout backend (:mod:`loomrl.rollout.vllm_engine`): verified weight syncs and their faults, per-sample
noise, log-prob parity with the trainer, and runs with ``rollout.backend=vllm`` on both executors.

One engine serves the engine-level tests (starting one costs seconds). Thresholds measured here (llama-1m, 2-core
x86 with AVX-512): vLLM's sampled-token log-probs differ from the trainer's forward by at most 3e-7 (mean 1.5e-7)
in float32, which the parity test bounds by 1e-5; in bf16 by 1.4e-3 in the mean (at most 4.7e-3), bounded by 0.02
in the mean (bf16's own rounding of a logit near 5 is 0.02; its kernels differ between processors, so that test is
among the slow ones).
"""

import json
import os
import signal

import pytest
import torch

from loomrl.config.schema import TrainConfig
from loomrl.config.tools import load_config
from loomrl.errors import ConfigError
from loomrl.models.tokenizer import task_tokenizer
from loomrl.models.zoo import build_causal_lm
from loomrl.rollout.engine import Request
from loomrl.rollout.sampling import SamplingParams
from loomrl.rollout.vllm_engine import VLLMEngine
from loomrl.rollout.weight_sync import WeightSyncError, fingerprint
from loomrl.train.rl import RLTrainer

PARAMS = SamplingParams(max_new_tokens=8)


def _model(dtype=torch.float32, seed=0):
    tok = task_tokenizer(load_config(TrainConfig, None, []).task, None)
    return build_causal_lm("llama-1m", tok, seed).to(dtype).eval(), tok


@pytest.fixture(scope="module")
def engine():
    model, tok = _model()
    eng = VLLMEngine(model, max_len=64, slots=16)
    yield eng, model, tok
    eng.close()


def _requests(n=4, key0=1000):
    return [Request(i, [1, 5, 6, 7 + i % 3], key0 + i) for i in range(n)]


def _sync(eng, model):
    version = eng.syncs + 1
    eng.sync(model, version)
    return version


def test_a_sync_is_numbered_verified_and_generation_needs_it(engine):
    eng, model, _ = engine
    version = _sync(eng, model)
    assert eng.version == version and eng.last_sync.tensors == len(list(model.parameters()))
    assert eng.last_sync.bytes == sum(p.numel() * p.element_size() for p in model.parameters())
    out = eng.generate_with(_requests(), PARAMS, [2], version)
    assert [c.sample_id for c in out] == [0, 1, 2, 3]
    with pytest.raises(WeightSyncError, match=rf"holds weights of version {version}, the call needs version"):
        eng.generate_with(_requests(), PARAMS, [2], version + 1)  # a skipped sync


@pytest.mark.parametrize(
    "fault, message",
    [
        ("skip", r"tensor 'model.embed_tokens.weight' never reached the engine"),
        ("drop", r"tensor 'model.layers.2.self_attn.q_proj.weight' never reached the engine"),
        ("twice", r"tensor 'model.norm.weight' reached it 2 times"),
        ("corrupt", r"tensor 'model.layers.1.mlp.up_proj.weight' differs from the trainer's"),
        ("corrupt_fused", r"tensor 'model.layers.3.self_attn.v_proj.weight' differs from the trainer's"),
        ("stale", r"tensor 'model.layers.0.self_attn.k_proj.weight' differs from the trainer's"),
    ],
)
def test_every_injected_sync_fault_is_caught_naming_the_tensor(engine, monkeypatch, fault, message):
    """A skipped sync, a dropped bucket, a tensor sent twice, a corrupted tensor (also one vLLM fuses with its
    neighbours) and a stale one (the engine keeps the old weights of a tensor the trainer changed): each stops
    the sync in one line naming the tensor, and the engine then holds no version a call could generate from."""
    eng, model, _ = engine
    _sync(eng, model)
    load = VLLMEngine._load

    def faulty(self, tensors):
        tensors = list(tensors)
        if fault == "skip":
            tensors = []
        elif fault == "drop":
            tensors = [(n, t) for n, t in tensors if "layers.2.self_attn" not in n]
        elif fault == "twice":
            tensors += [(n, t) for n, t in tensors if n == "model.norm.weight"]
        elif fault == "corrupt":
            tensors = [(n, t * 1.5 if n == "model.layers.1.mlp.up_proj.weight" else t) for n, t in tensors]
        elif fault == "corrupt_fused":
            tensors = [(n, -t if n == "model.layers.3.self_attn.v_proj.weight" else t) for n, t in tensors]
        elif fault == "stale":
            tensors = [(n, old[n] if n == "model.layers.0.self_attn.k_proj.weight" else t) for n, t in tensors]
        return load(self, tensors)

    old = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():  # one small training-sized change of every weight
        for p in model.parameters():
            p.add_(1e-3 * torch.sign(p))
    monkeypatch.setattr(VLLMEngine, "_load", faulty)
    try:
        with pytest.raises(WeightSyncError, match=message) as err:
            _sync(eng, model)
        assert "\n" not in str(err.value)
        assert eng.version is None
        with pytest.raises(WeightSyncError, match="holds no verified weights"):
            eng.generate_with(_requests(), PARAMS, [2], eng.syncs)
    finally:
        monkeypatch.undo()
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(old[n])
    _sync(eng, model)  # a good sync after a fault restores the engine


def test_a_samples_tokens_do_not_depend_on_its_batch(engine):
    eng, model, _ = engine
    version = _sync(eng, model)
    batch = eng.generate_with(_requests(12), PARAMS, [2], version)
    alone = eng.generate_with([_requests(12)[7]], PARAMS, [2], version)
    assert alone[0].tokens == batch[7].tokens and alone[0].logps == pytest.approx(batch[7].logps, abs=1e-6)
    other = eng.generate_with(_requests(12, key0=5000), PARAMS, [2], version)
    assert [c.tokens for c in other] != [c.tokens for c in batch]


def test_a_paused_sample_continues_from_its_prefix(engine):
    eng, model, _ = engine
    version = _sync(eng, model)
    params = SamplingParams(max_new_tokens=10, temperature=1.0)
    head = eng.generate_with([Request(0, [1, 5, 6], 77, pause_at=4)], params, [2], version)[0]
    assert head.finish_reason in ("paused", "eos") and len(head.tokens) <= 4
    if head.finish_reason == "paused":
        tail = eng.generate_with(
            [Request(0, [1, 5, 6], 77, prefix=head.tokens, prefix_logps=head.logps)], params, [2], version
        )[0]
        assert tail.tokens[:4] == head.tokens and tail.logps[:4] == head.logps and len(tail.tokens) <= 10


def _trainer_logps(model, prompt, tokens):
    ids = torch.tensor([[*prompt, *tokens]])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def test_vllm_logprobs_match_the_trainers_in_float32(engine):
    eng, model, _ = engine
    version = _sync(eng, model)
    diffs = []
    for req, c in zip(_requests(8), eng.generate_with(_requests(8), PARAMS, [2], version)):
        diffs.append((_trainer_logps(model, req.prompt, c.tokens) - torch.tensor(c.logps)).abs())
    assert torch.cat(diffs).max() < 1e-5


def test_vllm_logprobs_match_the_trainers_in_bf16():
    model, _ = _model(torch.bfloat16, seed=1)
    eng = VLLMEngine(model, max_len=64, slots=8)
    try:
        eng.sync(model, 1)
        diffs = []
        for req, c in zip(_requests(8), eng.generate_with(_requests(8), PARAMS, [2], 1)):
            diffs.append((_trainer_logps(model, req.prompt, c.tokens) - torch.tensor(c.logps)).abs())
        assert torch.cat(diffs).mean() < 0.02
    finally:
        eng.close()


def test_a_killed_engine_process_fails_the_next_sync_in_one_line(engine):
    """Last of the tests on the shared engine: its process is killed, and the next sync says so in one line (a run
    then stops, or recovers with runtime.max_failures as from any lost process)."""
    eng, model, _ = engine
    _sync(eng, model)
    os.kill(eng.pid, signal.SIGKILL)
    with pytest.raises(WeightSyncError, match=r"weight sync \d+ into vLLM: the engine failed") as err:
        _sync(eng, model)
    assert "\n" not in str(err.value) and eng.version is None


def test_a_tied_output_head_is_synced_and_checked_under_its_own_name():
    """SmolLM2 ties its output head to its embedding; vLLM's CPU build holds the head apart. Sent under the
    embedding's name only, the head kept vLLM's initial weights and every sample was noise: now the head is sent
    under its own name too, and a sync that leaves it out is refused in one line."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=48,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    eng = VLLMEngine(model, max_len=64, slots=8)
    try:
        eng.sync(model, 1)
        out = eng.generate_with(_requests(8), PARAMS, [2], 1)
        diffs = [
            (_trainer_logps(model, r.prompt, c.tokens) - torch.tensor(c.logps)).abs() for r, c in zip(_requests(8), out)
        ]
        assert torch.cat(diffs).max() < 1e-5
        load = eng._load
        eng._load = lambda tensors: load((n, t) for n, t in tensors if n != "lm_head.weight")  # type: ignore[method-assign]
        with pytest.raises(WeightSyncError, match=r"tensor 'lm_head.weight' never reached the engine"):
            eng.sync(model, 2)
    finally:
        eng.close()


def test_fingerprints_see_a_change_of_any_row():
    w = torch.randn(16, 8)
    base = fingerprint(w).values
    for row in range(16):
        moved = w.clone()
        moved[row, 3] += 0.01
        assert (fingerprint(moved).values - base).abs()[row] > 1e-4


# ------------------------------------------------------------------------------------------------------- runs
def _cfg(tmp_path, name, *extra):
    return load_config(
        TrainConfig,
        None,
        [
            f"run_dir={tmp_path / name}",
            "seed=3",
            "algo.name=grpo",
            "algo.group_size=2",
            "rollout.prompts_per_iter=4",
            "rollout.max_new_tokens=6",
            "rollout.backend=vllm",
            "loop.iterations=3",
            "loop.eval_every=0",
            "loop.save_every=0",
            "loop.eval_prompts=4",
            "loop.progress=false",
            "report.html=false",
            "runtime.threads=1",
            "runtime.timeout_s=180",
            "algo.minibatches=2",
            "actor.optim.lr=0.001",
            "runtime.executor=reference",
            *extra,
        ],
    )


def _metrics(tmp_path, name, *extra):
    RLTrainer(_cfg(tmp_path, name, *extra)).run()
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _metrics(tmp_path_factory.mktemp("vllm_ref"), "ref")


def test_a_vllm_run_trains_and_measures_its_mismatch(reference):
    assert len(reference) == 3
    for record in reference:
        assert record["mismatch/tokens"] > 0
        assert record["mismatch/mean_abs_logp_diff"] < 1e-5  # float32: vLLM's log-probs are the trainer's
        assert record["mismatch/ess"] == pytest.approx(1.0, abs=1e-4)
    assert reference[0]["actor/grad_norm"] > 0


def test_a_corrupted_sync_stops_the_run_in_one_line_and_keeps_its_checkpoints(tmp_path, monkeypatch):
    load, calls = VLLMEngine._load, []

    def corrupt_third(self, tensors):
        calls.append(1)
        if len(calls) == 3:
            tensors = ((n, t + 1.0 if n.endswith("layers.0.mlp.down_proj.weight") else t) for n, t in tensors)
        return load(self, tensors)

    monkeypatch.setattr(VLLMEngine, "_load", corrupt_third)
    trainer = RLTrainer(_cfg(tmp_path, "run", "loop.save_every=1", "loop.iterations=4"))
    with pytest.raises(WeightSyncError, match=r"weight sync 3 into vLLM: tensor 'model.layers.0.mlp.down_proj") as e:
        trainer.run()
    assert "\n" not in str(e.value)
    saved = sorted(p.name for p in (tmp_path / "run").glob("checkpoint*"))
    assert saved and len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2


@pytest.mark.usefixtures("ray_session")
@pytest.mark.parametrize("plan", ["colocate", "separate"], ids=["colocate-dp2", "separate-1+1"])
def test_the_ray_runtime_with_vllm_is_the_reference_run_with_vllm(tmp_path, reference, plan):
    """Each generating worker holds its own vLLM engine (two replicas of half the batch when colocated; one
    generation device with the shadow actor when separate), and the run is the reference's with vLLM."""
    got = _metrics(
        tmp_path,
        "ray",
        "runtime.executor=ray",
        "runtime.devices=2",
        f"runtime.plan={plan}",
        "runtime.verify_reallocation=true",
    )
    assert len(got) == len(reference)
    for a, b in zip(got, reference):
        for key in ("reward/mean", "response/length", "response/length_max"):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), key
        for key in ("actor/pg_loss", "actor/grad_norm", "kl/mean", "mismatch/mean_abs_logp_diff", "mismatch/ess"):
            if key in b:
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key


def test_judges_and_dynamic_sampling_generate_with_vllm(tmp_path, monkeypatch):
    """A judge's verdicts come from its own vLLM engine (its weights synced and verified like the actor's), and
    dynamic sampling's extra waves are generated by the actor's engine."""
    engines = []
    init = VLLMEngine.__init__

    def counted(self, *args, **kwargs):
        init(self, *args, **kwargs)
        engines.append(self)

    monkeypatch.setattr(VLLMEngine, "__init__", counted)
    got = _metrics(
        tmp_path,
        "judged",
        "reward.source=judge",
        "reward.judges=[{model: llama-1m, max_new_tokens: 2}]",
        "algo.dynamic_sampling.enabled=true",
        "algo.dynamic_sampling.max_waves=2",
        "loop.iterations=1",
    )
    assert len(got) == 1 and "sampling/waves" in got[0]
    waves = int(got[0]["sampling/waves"])
    assert len(engines) == 2 and [e.syncs for e in engines] == [waves, waves]  # the actor's and the judge's


PARTIAL = "runtime.plan=separate; async=2,partial_rollout:on,segment_tokens:2"


@pytest.mark.usefixtures("ray_session")
def test_asynchronous_vllm_runs_with_partial_rollouts_are_the_reference_run(tmp_path):
    """Batches generated two iterations ahead, samples paused after two tokens and continued from their prefix
    under newer weights (a vLLM request resumed over prompt + prefix): the reference executor and the Ray runtime
    compute the same run, and the tokens span two policy versions as with loomrl's engine."""
    common = (PARTIAL, "runtime.devices=2", "loop.iterations=3")
    ref = _metrics(tmp_path, "ref", *common)
    got = _metrics(tmp_path, "ray", "runtime.executor=ray", *common)
    assert [m["async/staleness"] for m in ref] == [0.0, 1.0, 2.0]
    assert max(m["async/staleness_mean"] for m in ref) > 1.0  # resumed samples carry tokens of two versions
    for a, b in zip(got, ref):
        for key in ("reward/mean", "response/length", "async/staleness_mean"):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), key
        for key in ("actor/pg_loss", "actor/grad_norm", "mismatch/mean_abs_logp_diff"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key


@pytest.mark.parametrize(
    "extra, refused",
    [
        (("runtime.plan=colocate; stream_fusion=on",), "stream fusion"),
        (("rollout.env.name=guess",), "multi-turn episodes"),
        (("actor.lora.r=4",), "a LoRA actor"),
        (("runtime.devices=2", "runtime.layouts={actor: {tp: 2}}"), "a tensor-, pipeline- or FSDP-sharded generate"),
    ],
)
def test_what_vllm_cannot_do_is_refused_in_one_line(tmp_path, extra, refused):
    with pytest.raises(ConfigError, match=rf"rollout.backend: not available with {refused}") as err:
        RLTrainer(_cfg(tmp_path, "no", "runtime.executor=ray", *extra))
    assert "\n" not in str(err.value)
