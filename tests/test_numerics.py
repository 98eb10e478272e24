"""Numerical faults in training: a NaN or inf loss or gradient norm skips the optimizer step or stops the run
(``train.on_nonfinite``), alike on every rank of the step; the option reaches both executors' roles."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist

from loomrl.algorithms.context import OpContext, Role
from loomrl.algorithms.ops import train_loop
from loomrl.errors import TrainingError
from loomrl.models.tokenizer import build_char_tokenizer
from loomrl.models.zoo import build_causal_lm
from loomrl.parallel.pipeline import split_stages
from loomrl.parallel.pipeline_runner import PipelineRunner
from loomrl.parallel.spawn import run_world
from loomrl.role import ModelPasses, make_role, role_specs
from loomrl.workflow.batch import Batch

PROMPTS = [[1, 5, 6, 7], [1, 8, 9], [1, 10, 11, 12, 13], [1, 14]]
RESPONSES = [[20, 21, 2], [22, 2], [23, 24, 25], [26, 27, 28, 2]]
ITERATION = 4


def _batch() -> Batch:
    return Batch(
        list(range(len(PROMPTS))),
        {"prompt_ids": [list(p) for p in PROMPTS], "response_ids": [list(r) for r in RESPONSES]},
    )


class FaultyLoss:
    """A loss over the role's logits whose calls in ``bad`` (0-based, one call per step here) are faulty:
    ``nan`` (NaN loss and gradients), ``nan_loss_only`` (a NaN loss whose gradients are finite: log of a negative
    number) or ``nan_grad_only`` (a finite loss, 0, whose gradients are NaN: sqrt at 0)."""

    def __init__(self, kind: str = "nan", bad: tuple[int, ...] = ()) -> None:
        self.kind, self.bad, self.calls = kind, set(bad), 0

    def __call__(self, mb: Batch, out: torch.Tensor, packed: tuple) -> tuple[torch.Tensor, dict]:
        call, self.calls = self.calls, self.calls + 1
        mean = out.float().pow(2).mean()
        if call not in self.bad:
            loss = mean
        elif self.kind == "nan":
            loss = mean * float("nan")
        elif self.kind == "nan_loss_only":
            loss = torch.log(-mean.exp())
        else:
            loss = (out.float() * 0).sqrt().sum()
        return loss, {"test/loss": float(loss.detach())}


def _model() -> torch.nn.Module:
    return build_causal_lm("llama-1m", build_char_tokenizer(), seed=0)


def _role(model: torch.nn.Module, on_nonfinite: str, engine: ModelPasses | None = None) -> Role:
    return Role(
        "actor",
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        grad_clip=1.0,
        passes=engine or ModelPasses(model),
        on_nonfinite=on_nonfinite,
    )


def _context(role: Role, steps: int, rows: tuple[int, ...] = (0, 1, 2, 3), weight: float = 1.0) -> OpContext:
    tok = build_char_tokenizer()
    return OpContext(
        role,
        0,
        ITERATION,
        tok.pad_token_id,
        tok.eos_token_id,
        str,
        train_steps=tuple((rows, weight) for _ in range(steps)),
    )


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# --- one process ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["nan", "nan_loss_only", "nan_grad_only"])
def test_a_skipped_step_leaves_weights_and_optimizer_state_as_if_it_never_ran(kind):
    """Steps [ok, faulty, ok] end exactly where [ok, ok] does: the faulty step changed nothing, not even Adam's
    moments or step count; it is counted and warned about, and its statistics are left out."""
    faulty = _role(_model(), "skip")
    with pytest.warns(RuntimeWarning, match=f"actor: non-finite .* at iteration {ITERATION}, optimizer step 1;"):
        got = train_loop(_context(faulty, 3), _batch(), FaultyLoss(kind, bad=(1,)))["stats"]
    clean = _role(_model(), "skip")
    want = train_loop(_context(clean, 2), _batch(), FaultyLoss())["stats"]
    assert got["actor/skipped_steps"] == 1.0
    assert {k: v for k, v in got.items() if k != "actor/skipped_steps"} == want
    assert all(math.isfinite(v) for v in got.values())
    for name, value in _weights(clean.model).items():
        assert torch.equal(faulty.model.state_dict()[name], value), name
    steps = {float(s["step"]) for s in faulty.optimizer.state.values()}
    assert steps == {2.0}, "Adam counted the skipped step"


def test_every_step_skipped_leaves_the_initial_weights():
    role = _role(_model(), "skip")
    before = _weights(role.model)
    with pytest.warns(RuntimeWarning):
        stats = train_loop(_context(role, 2), _batch(), FaultyLoss("nan", bad=(0, 1)))["stats"]
    assert stats == {"actor/skipped_steps": 2.0}
    assert all(torch.equal(role.model.state_dict()[k], v) for k, v in before.items())
    assert not role.optimizer.state


@pytest.mark.parametrize("kind", ["nan", "nan_loss_only", "nan_grad_only"])
def test_stop_raises_one_line_naming_role_iteration_and_step_before_stepping(kind):
    role = _role(_model(), "stop")
    with pytest.raises(TrainingError) as info:
        train_loop(_context(role, 3), _batch(), FaultyLoss(kind, bad=(1,)))
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"actor: non-finite {'gradient norm' if kind == 'nan_grad_only' else 'loss'}")
    assert f"iteration {ITERATION}, optimizer step 1;" in message and "train.on_nonfinite=stop" in message
    once = _role(_model(), "stop")
    train_loop(_context(once, 1), _batch(), FaultyLoss())
    for name, value in _weights(once.model).items():  # step 0 taken, the faulty step 1 not
        assert torch.equal(role.model.state_dict()[name], value), name


def test_the_option_reaches_the_roles_both_executors_build():
    """Both executors build their trained roles with make_role from the run's RoleSpecs (the Ray workers get
    them in their WorkerSpec), which carry train.on_nonfinite."""
    from loomrl.config.schema import TrainConfig
    from loomrl.config.tools import load_config
    from loomrl.data.sources import build_task

    cfg = load_config(TrainConfig, None, ["train.on_nonfinite=stop"])
    specs = role_specs(cfg, ["actor", "critic", "ref"])
    assert specs["actor"].on_nonfinite == specs["critic"].on_nonfinite == "stop"
    model = build_causal_lm("llama-1m", build_char_tokenizer(), seed=0)
    role = make_role(specs["actor"], model, build_task(cfg.task), ModelPasses(model), trainable=True)
    assert role.on_nonfinite == "stop"
    assert role_specs(load_config(TrainConfig, None, []), ["actor"])["actor"].on_nonfinite == "skip"


# --- ranks agree ----------------------------------------------------------------------------------------


def _ranks_body(rank: int) -> dict[str, Any]:
    """Data parallelism: only rank 0's loss is faulty (NaN with finite gradients, the case a norm check alone
    misses); a pipeline: only the last stage computes the loss. Every rank must skip (or stop) the same step."""
    torch.manual_seed(0)
    group = dist.group.WORLD
    out: dict[str, Any] = {}
    for mode in ("skip", "stop"):
        model = _model()
        role = _role(model, mode, ModelPasses(model, dp_group=group))
        rows = (0, 1) if rank == 0 else (2, 3)
        loss = FaultyLoss("nan_loss_only", bad=(1,) if rank == 0 else ())
        out[f"dp_{mode}"] = _run(role, _context(role, 3, rows, weight=0.5), loss)
    for mode in ("skip", "stop"):
        runner = PipelineRunner(split_stages(_model(), rank, 2), group, rank, 2)
        stage = runner.stage.model
        role = _role(stage, mode, ModelPasses(stage, pipeline=runner))
        out[f"pp_{mode}"] = _run(role, _context(role, 3), FaultyLoss("nan_loss_only", bad=(1,)))
    return out


def _run(role: Role, ctx: OpContext, loss: FaultyLoss) -> dict[str, Any]:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        try:
            stats = train_loop(ctx, _batch(), loss)["stats"]
            error = None
        except TrainingError as exc:
            stats, error = {}, str(exc)
    adam_steps = sorted({float(s["step"]) for s in role.optimizer.state.values()})
    checksum = sum(float(p.detach().double().sum()) for p in role.model.parameters())
    return {"skipped": stats.get("actor/skipped_steps"), "error": error, "adam_steps": adam_steps, "checksum": checksum}


def test_data_parallel_ranks_and_pipeline_stages_skip_or_stop_together():
    ranks = run_world(_ranks_body, 2, timeout_s=240)
    dp0, dp1 = ranks[0]["dp_skip"], ranks[1]["dp_skip"]
    assert dp0["skipped"] == dp1["skipped"] == 0.5, "each rank reports its share of the skipped step"
    assert dp0["adam_steps"] == dp1["adam_steps"] == [2.0]
    assert dp0["checksum"] == dp1["checksum"], "the data-parallel replicas drifted apart"
    for rank in ranks:
        assert rank["dp_stop"]["error"] is not None and "optimizer step 1" in rank["dp_stop"]["error"]
        assert rank["dp_stop"]["adam_steps"] == [1.0]
        assert rank["pp_skip"]["skipped"] == 1.0 and rank["pp_skip"]["adam_steps"] == [2.0]
        assert rank["pp_stop"]["error"] is not None and rank["pp_stop"]["adam_steps"] == [1.0]
    assert ranks[1]["pp_stop"]["error"].startswith("actor: non-finite loss")  # the stage that has the loss


# --- a whole run -----------------------------------------------------------------------------------------


def _nan_policy_loss(monkeypatch) -> None:
    from loomrl.algorithms import losses

    real = losses.policy_loss

    def nan_loss(*args, **kwargs):
        loss, stats = real(*args, **kwargs)
        return loss * float("nan"), stats

    monkeypatch.setattr(losses, "policy_loss", nan_loss)


def test_a_run_whose_actor_loss_is_nan_skips_every_actor_step_or_stops(tmp_path, monkeypatch):
    from loomrl.train.rl import RLTrainer
    from test_rl import read_records, snapshot, tiny_cfg

    _nan_policy_loss(monkeypatch)
    trainer = RLTrainer(tiny_cfg(tmp_path / "skip", "algo.name=grpo", "loop.iterations=1"))
    actor = trainer.executor.roles["actor"].model
    before = snapshot(actor)
    with pytest.warns(RuntimeWarning, match="actor: non-finite loss"):
        trainer.run()
    assert all(torch.equal(p, before[name]) for name, p in actor.named_parameters())
    record = read_records(tmp_path / "skip")[-1]
    assert record["actor/skipped_steps"] == 2.0  # algo.minibatches=2, ppo_epochs=1
    trainer = RLTrainer(tiny_cfg(tmp_path / "stop", "algo.name=grpo", "train.on_nonfinite=stop"))
    with pytest.raises(TrainingError, match=r"^actor: non-finite loss .* at iteration 0, optimizer step 0;"):
        trainer.run()
