"""The RL loop in process: every algorithm trains, group batches, determinism, exact resume, reward models.

Every run is a random-init llama-1m on a handful of sort prompts for one or two iterations, on one thread
(tiny matrices are slower on two threads that contend with other processes).
"""

import json
import math
from pathlib import Path

import pytest
import torch

from loomrl.algorithms.workflows import build_workflow
from loomrl.config.schema import ALGORITHMS, AlgoConfig, RMConfig, RolloutConfig, TrainConfig
from loomrl.config.tools import load_config
from loomrl.train.rl import RLTrainer
from loomrl.train.rm import run_rm

TINY = (
    "rollout.prompts_per_iter=4",
    "rollout.max_new_tokens=6",
    "algo.group_size=2",
    "algo.minibatches=2",
    "loop.iterations=2",
    "loop.eval_prompts=4",
    "loop.progress=false",
    "report.html=false",
    "runtime.device=cpu",
    "runtime.threads=1",
    "runtime.executor=reference",
)


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    """runtime.threads=1 sets torch's global thread count; give later test files theirs back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def tiny_cfg(run_dir: Path, *overrides: str) -> TrainConfig:
    """Later overrides win, so callers may replace any TINY setting."""
    return load_config(TrainConfig, None, [*TINY, f"run_dir={run_dir}", *overrides])


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def same_weights(model: torch.nn.Module, saved: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(p, saved[name]) for name, p in model.named_parameters())


def comparable(record: dict) -> dict:
    """A metrics record without what legitimately differs between identical runs: wall-clock times."""
    return {k: v for k, v in record.items() if k != "time" and not k.startswith(("time/", "perf/"))}


def read_records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def spy_on_iterations(trainer: RLTrainer, monkeypatch) -> list:
    """Record every IterationResult the trainer's executor produces, so a test can look at the batches."""
    results = []
    run_iteration = trainer.executor.run_iteration

    def spy(iteration, batch, waves=None, ahead=None):
        results.append(run_iteration(iteration, batch, waves, ahead))
        return results[-1]

    monkeypatch.setattr(trainer.executor, "run_iteration", spy)
    return results


# ------------------------------------------------------------------------------------------ algorithms


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_each_algorithm_trains_the_actor_and_never_the_reference(algo, tmp_path):
    trainer = RLTrainer(tiny_cfg(tmp_path, f"algo.name={algo}"))
    actor, ref = trainer.executor.roles["actor"].model, trainer.executor.roles["ref"].model
    actor_before, ref_before = snapshot(actor), snapshot(ref)
    assert same_weights(ref, actor_before), "the reference must start as a copy of the actor"
    critic_before = snapshot(trainer.executor.roles["critic"].model) if algo == "ppo" else None

    metrics = trainer.run()

    for key in (
        "reward/mean",
        "kl/mean",
        "response/length",
        "actor/pg_loss",
        "actor/clipfrac",
        "actor/approx_kl",
        "actor/entropy",
        "eval/exact_match",
        "eval/score",
    ):
        assert key in metrics, f"{algo}: {key} missing from {sorted(metrics)}"
    # the training-inference mismatch of the first minibatch: the rollout engine's float32 numerics and the trainer's
    assert 0 < metrics["mismatch/tokens"] and metrics["mismatch/mean_abs_logp_diff"] < 1e-4
    assert metrics["mismatch/ess"] == pytest.approx(1.0, abs=1e-6)
    bad = {k: v for k, v in metrics.items() if not math.isfinite(v)}
    assert not bad, f"{algo}: non-finite metrics {bad}"
    critic_keys = {k for k in metrics if k.startswith("critic/")}
    assert "actor/grad_norm" in metrics and "grad_norm" not in metrics, "each role reports its own grad norm"
    if algo == "ppo":
        assert {"critic/value_loss", "critic/vf_clipfrac", "critic/grad_norm"} <= critic_keys
        assert not same_weights(trainer.executor.roles["critic"].model, critic_before), "ppo: the critic did not train"
    else:
        assert critic_keys == set() and "critic" not in trainer.executor.roles
    assert ("actor/kl_loss" in metrics) == (algo == "grpo"), "only grpo puts the KL in the loss"
    assert 0.0 <= metrics["reward/mean"] <= 1.0  # the sort rule scores in [0, 1]
    assert 1.0 <= metrics["response/length"] <= 6.0
    assert not same_weights(actor, actor_before), f"{algo}: the actor's parameters did not change"
    assert same_weights(ref, ref_before), f"{algo}: the frozen reference changed"
    assert [r["iteration"] for r in read_records(tmp_path)] == [0, 1]


@pytest.mark.parametrize("algo", ["grpo", "rloo"])
def test_group_batches_repeat_each_prompt_consecutively_with_distinct_ids(algo, tmp_path, monkeypatch):
    g, n = 3, 4
    trainer = RLTrainer(
        tiny_cfg(
            tmp_path, f"algo.name={algo}", f"algo.group_size={g}", f"rollout.prompts_per_iter={n}", "loop.iterations=1"
        )
    )
    results = spy_on_iterations(trainer, monkeypatch)
    trainer.run()
    batch = results[0].batch
    assert len(batch) == n * g
    assert len(set(batch.ids)) == n * g, f"sample ids repeat: {batch.ids}"
    groups = [range(i * g, (i + 1) * g) for i in range(n)]
    for rows in groups:
        assert len({batch["prompt_text"][r] for r in rows}) == 1
        assert len({tuple(batch["prompt_ids"][r]) for r in rows}) == 1
        assert len({batch["answer"][r] for r in rows}) == 1
        # Distinct ids give distinct random streams: a group of identical samples would have zero advantage.
        assert len({tuple(batch["response_ids"][r]) for r in rows}) > 1
    assert len({batch["prompt_text"][rows[0]] for rows in groups}) == n, "consecutive groups share a prompt"
    assert not set(batch.ids) & set(trainer.make_batch(1).ids), "sample ids repeat across iterations"


def test_non_group_algorithm_ignores_group_size(tmp_path):
    batch = RLTrainer(tiny_cfg(tmp_path, "algo.name=ppo", "algo.group_size=3")).make_batch(0)
    assert len(batch) == 4 and len(set(batch["prompt_text"])) == 4


# ----------------------------------------------------------------------------------------- determinism


def test_same_seed_gives_identical_runs(tmp_path):
    last = [RLTrainer(tiny_cfg(tmp_path / name, "seed=3")).run() for name in ("a", "b")]
    assert comparable(last[0]) == comparable(last[1])
    a, b = read_records(tmp_path / "a"), read_records(tmp_path / "b")
    assert len(a) == 2 and [comparable(r) for r in a] == [comparable(r) for r in b]


def test_different_seed_gives_different_samples(tmp_path, monkeypatch):
    responses = []
    for seed in (0, 1):
        trainer = RLTrainer(tiny_cfg(tmp_path / str(seed), f"seed={seed}", "loop.iterations=1"))
        results = spy_on_iterations(trainer, monkeypatch)
        trainer.run()
        responses.append(results[0].batch["response_ids"])
    assert responses[0] != responses[1]


# ---------------------------------------------------------------------------------------------- resume


COSINE = (
    "actor.optim.warmup_steps=3",
    "actor.optim.lr_schedule=cosine",
    "actor.optim.min_lr_ratio=0.1",
    "critic.optim.lr_schedule=cosine",
)


@pytest.mark.parametrize(
    "precision,schedule", [("fp32", ()), ("bf16", ()), ("fp32", COSINE)], ids=["fp32", "bf16", "warmup_cosine"]
)
def test_resume_continues_exactly_as_an_uninterrupted_run(tmp_path, monkeypatch, precision, schedule):
    """A run that dies writing its last checkpoint resumes from the one before and repeats the uninterrupted run.
    bf16: the checkpoint's optimizer state carries the fp32 master weights, so the resumed run does not restart
    from the rounded bf16 weights. A learning-rate schedule is a function of the step index, which the
    iteration gives: nothing to restore."""
    common = ("algo.name=ppo", "loop.save_every=2", "loop.iterations=4", f"runtime.precision={precision}", *schedule)
    uninterrupted = RLTrainer(tiny_cfg(tmp_path / "a", *common))
    uninterrupted.run()
    crashed = RLTrainer(tiny_cfg(tmp_path / "b", *common))
    _crash_on_save(crashed, monkeypatch, crash_at=3)  # the checkpoint after iteration 1 is the last one written
    with pytest.raises(RuntimeError, match="simulated crash"):
        crashed.run()
    resumed = RLTrainer(tiny_cfg(tmp_path / "b", *common))
    resumed.run(resume=True)

    a, b = read_records(tmp_path / "a"), read_records(tmp_path / "b")
    assert [r["iteration"] for r in b] == [0, 1, 2, 3]
    for it in range(4):
        assert comparable(b[it]) == comparable(a[it]), f"iteration {it} differs after resume"
    for role in ("actor", "critic"):
        expected = snapshot(uninterrupted.executor.roles[role].model)
        assert same_weights(resumed.executor.roles[role].model, expected), f"{role} weights differ after resume"
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
        assert {p.dtype for p in resumed.executor.roles[role].model.parameters()} == {dtype}


def _crash_on_save(trainer: RLTrainer, monkeypatch, crash_at: int) -> None:
    """Make the run die while writing the checkpoint of iteration ``crash_at`` (after logging it)."""
    save = trainer.save

    def crashing_save(iteration):
        if iteration == crash_at:
            raise RuntimeError("simulated crash")
        return save(iteration)

    monkeypatch.setattr(trainer, "save", crashing_save)


def test_resume_supersedes_iterations_logged_after_the_last_checkpoint(tmp_path, monkeypatch):
    common = ("algo.name=grpo", "loop.save_every=2", "loop.iterations=4")
    reference = RLTrainer(tiny_cfg(tmp_path / "a", *common))
    reference.run()
    crashed = RLTrainer(tiny_cfg(tmp_path / "b", *common))
    _crash_on_save(crashed, monkeypatch, crash_at=3)  # iterations 2 and 3 logged, last checkpoint is 1
    with pytest.raises(RuntimeError, match="simulated crash"):
        crashed.run()
    assert len(read_records(tmp_path / "b")) == 4

    RLTrainer(tiny_cfg(tmp_path / "b", *common)).run(resume=True)
    a, b = read_records(tmp_path / "a"), read_records(tmp_path / "b")
    assert [r["iteration"] for r in b] == [0, 1, 2, 3]
    assert [comparable(r) for r in b] == [comparable(r) for r in a]
    superseded = (tmp_path / "b" / "metrics.superseded.jsonl").read_text().splitlines()
    assert [json.loads(line)["iteration"] for line in superseded] == [2, 3], "the re-done lines must be kept aside"


def test_resume_without_any_checkpoint_starts_a_clean_metrics_file(tmp_path, monkeypatch):
    crashed = RLTrainer(tiny_cfg(tmp_path, "loop.save_every=0"))
    _crash_on_save(crashed, monkeypatch, crash_at=1)  # died before its first checkpoint, with 2 lines logged
    with pytest.raises(RuntimeError, match="simulated crash"):
        crashed.run()
    old = (tmp_path / "metrics.jsonl").read_text().splitlines()
    RLTrainer(tiny_cfg(tmp_path, "loop.save_every=0")).run(resume=True)
    assert [r["iteration"] for r in read_records(tmp_path)] == [0, 1], "the restarted run must not append"
    assert (tmp_path / "metrics.superseded.jsonl").read_text().splitlines() == old, "the old lines must be kept"


# ------------------------------------------------------------------------------------- reward and sampling


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("rm")
    cfg = load_config(
        RMConfig, None, [f"out_dir={out}", "train_pairs=16", "eval_pairs=8", "epochs=1", "batch_size=8", "device=cpu"]
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        summary = run_rm(cfg, progress=False)
    finally:
        torch.set_num_threads(threads)
    assert 0.0 <= summary["eval/pair_accuracy"] <= 1.0
    return out


def test_reward_source_both_is_the_weighted_sum_of_rule_and_model(tmp_path, monkeypatch, reward_model_dir):
    scores, metrics = {}, {}
    for source in ("rule", "model", "both"):
        trainer = RLTrainer(
            tiny_cfg(
                tmp_path / source,
                f"reward.source={source}",
                f"reward.model={reward_model_dir}",
                "reward.rule_weight=1.0",
                "reward.model_weight=0.5",
                "loop.iterations=1",
            )
        )
        assert (trainer.executor.roles["reward"].model is not None) == (source != "rule")
        results = spy_on_iterations(trainer, monkeypatch)
        metrics[source] = trainer.run()
        scores[source] = results[0].batch["score"]
    assert scores["model"].abs().max() > 0, "the trained reward model scored every sample 0"
    torch.testing.assert_close(scores["both"], scores["rule"] + 0.5 * scores["model"])
    assert all(math.isfinite(v) for v in metrics["both"].values())


def test_truncated_sampling_adds_actor_inf_that_recomputes_behaviour_logprobs(tmp_path, monkeypatch):
    trainer = RLTrainer(tiny_cfg(tmp_path, "algo.name=ppo", "rollout.top_k=5"))
    mfcs = {m.name: m for m in trainer.workflow}
    assert "actor_inf" in mfcs and "old_logp" in mfcs["actor_train"].inputs
    results = spy_on_iterations(trainer, monkeypatch)
    metrics = trainer.run()
    assert all(math.isfinite(v) for v in metrics.values())
    assert "time/actor_inf_s" in metrics
    batch = results[0].batch
    real = batch["mask"].bool()
    # Rollout log-probs are under the top-5 distribution, old_logp under the full one the actor trains:
    # truncation renormalises onto fewer tokens, so each sampled token is at least as likely after it.
    gap = (batch["logp"] - batch["old_logp"])[real]
    assert gap.min() > -1e-4 and gap.max() > 1e-2


def test_untruncated_sampling_uses_rollout_logprobs():
    names = {m.name for m in build_workflow(AlgoConfig(name="ppo"), RolloutConfig())}
    assert "actor_inf" not in names
    assert "actor_inf" in {m.name for m in build_workflow(AlgoConfig(name="grpo"), RolloutConfig(top_p=0.9))}


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_kl_coef_zero_drops_the_reference_and_learns_exactly_as_with_it(algo, tmp_path, monkeypatch):
    """At kl_coef 0 the reference's log-probs weigh nothing: the workflow has no ref_inf, the run no reference
    model, and the run is the run that computed them anyway (same samples, metrics and final weights)."""
    from loomrl.algorithms import workflows

    overrides = (f"algo.name={algo}", "algo.kl_coef=0", "seed=5")
    lean = RLTrainer(tiny_cfg(tmp_path / "lean", *overrides))
    assert "ref_inf" not in {m.name for m in lean.workflow} and "ref" not in lean.executor.roles
    assert "ref_logp" not in lean.workflow["advantages"].inputs
    lean.run()
    monkeypatch.setattr(workflows, "uses_reference", lambda algo: True)
    full = RLTrainer(tiny_cfg(tmp_path / "full", *overrides))
    assert "ref" in full.executor.roles
    full.run()
    kl_keys = ("kl/mean", "actor/kl_loss")
    records = [
        [{k: v for k, v in comparable(r).items() if k not in kl_keys} for r in read_records(tmp_path / run)]
        for run in ("lean", "full")
    ]
    assert records[0] == records[1]
    assert "kl/mean" in read_records(tmp_path / "full")[0] and "kl/mean" not in read_records(tmp_path / "lean")[0]
    assert same_weights(lean.executor.roles["actor"].model, snapshot(full.executor.roles["actor"].model))


def test_precision_auto_is_bf16_on_accelerators_and_fp32_on_cpu():
    from loomrl.role import resolve_dtype

    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("fp32", torch.device("cuda")) == torch.float32
    assert resolve_dtype("bf16", torch.device("cpu")) == torch.bfloat16


def test_sft_and_rm_in_bf16_follow_their_fp32_runs(tmp_path):
    """precision=bf16 for the SFT and reward-model stages: bf16 weights updated through fp32 master weights
    follow the fp32 run from the same seed, the SFT loss falls in both, and the checkpoints are written in bf16.

    "Follow" is held where it is a property of bf16 and not of the processor: over the first three steps (the
    same initial weights, rounded to bf16, and two updates) the mean loss is within 4 · 2^-8 (1.6%) of the fp32
    run's (bf16 keeps 8 significant bits; the forward pass's roundings average out rather than add). Further on,
    two runs trained at a learning rate of 3e-3 drift apart chaotically: by the end the reward model's losses of
    the two precisions differed by under 1% with AVX-512's bf16 kernels and by 5-15% with AVX2's, so the tails
    are not compared."""
    from loomrl.config.schema import SFTConfig
    from loomrl.train.sft import run_sft

    tail, first = {}, {}
    for precision in ("fp32", "bf16"):
        out = tmp_path / precision
        run_sft(
            load_config(
                SFTConfig,
                None,
                [
                    f"out_dir={out / 'sft'}",
                    "steps=30",
                    "batch_size=16",
                    "eval_prompts=4",
                    f"precision={precision}",
                    "device=cpu",
                ],
            ),
            progress=False,
        )
        run_rm(
            load_config(
                RMConfig,
                None,
                [
                    f"out_dir={out / 'rm'}",
                    "train_pairs=128",
                    "eval_pairs=8",
                    "epochs=3",
                    "batch_size=16",
                    "optim.lr=3e-3",
                    f"precision={precision}",
                    "device=cpu",
                ],
            ),
            progress=False,
        )
        for stage in ("sft", "rm"):
            losses = [json.loads(line)["loss"] for line in (out / stage / f"{stage}_metrics.jsonl").open()]
            tail[precision, stage] = sum(losses[-5:]) / 5
            first[precision, stage] = sum(losses[:3]) / 3
            if stage == "sft":
                assert tail[precision, stage] < 0.6 * sum(losses[:5]) / 5, (precision, losses)
            saved = json.loads((out / stage / "config.json").read_text())
            want = {"fp32": "float32", "bf16": "bfloat16"}[precision]
            assert (saved.get("dtype") or saved.get("torch_dtype")) == want
    for stage in ("sft", "rm"):
        assert first["bf16", stage] == pytest.approx(first["fp32", stage], rel=4 * 2**-8), first


def test_learning_rate_warms_up_then_decays_by_cosine_to_its_floor():
    from loomrl.algorithms.lr import learning_rate
    from loomrl.config.schema import OptimConfig

    constant = OptimConfig(lr=1e-3, warmup_steps=4)
    assert [learning_rate(constant, k, 100) for k in range(6)] == pytest.approx(
        [2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3]
    )
    assert learning_rate(OptimConfig(lr=1e-3), 0, 10) == 1e-3  # no warm-up: the full rate from the first step
    cosine = OptimConfig(lr=1e-3, warmup_steps=2, lr_schedule="cosine", min_lr_ratio=0.1)
    rates = [learning_rate(cosine, k, 13) for k in range(13)]
    assert rates[:2] == pytest.approx([5e-4, 1e-3])
    assert rates[2] == pytest.approx(1e-3) and rates[12] == pytest.approx(1e-4)  # from lr to the floor
    assert rates[7] == pytest.approx(0.55e-3)  # half-way through the decay: the mean of lr and the floor
    assert all(a > b for a, b in zip(rates[2:], rates[3:]))
    assert learning_rate(cosine, 50, 13) == pytest.approx(1e-4)  # steps past the planned end stay at the floor


def test_each_optimizer_step_uses_its_scheduled_learning_rate(tmp_path):
    """The logged lr of every iteration is the mean over its optimizer steps of the schedule (4 steps each)."""
    from loomrl.algorithms.lr import learning_rate

    trainer = RLTrainer(
        tiny_cfg(tmp_path, "algo.name=ppo", "loop.iterations=3", "algo.ppo_epochs=2", "algo.minibatches=2", *COSINE)
    )
    trainer.run()
    for record in read_records(tmp_path):
        for role in ("actor", "critic"):  # the actor warms up, the critic starts at its full rate
            optim = getattr(trainer.cfg, role).optim
            want = sum(learning_rate(optim, record["iteration"] * 4 + k, 12) for k in range(4)) / 4
            assert record[f"{role}/lr"] == pytest.approx(want, rel=1e-9), (role, record)
