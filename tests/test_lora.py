"""LoRA (``actor.lora`` / ``critic.lora``, :mod:`loomrl.models.lora`): adapters over a frozen base, the reference as
the actor's base, adapter-only movement and checkpoints, the exported forms, and every plan equal to the reference
executor.

Equivalence is held to the tolerances of tests/test_runtime.py (same samples; losses within 1e-4 relative, fp32):
a LoRA model runs the same operations as a plain one plus the adapters' small products, summed in another order
on other plans exactly as the base's are. The actor's learning rate is 0.002: Adam normalises each update, and
the adapters start where lora_B is zero, so their first steps turn differences of summation order into whole
steps; at 0.01 a 1e-6 relative difference after two iterations became 3e-3 in the third, the same on unrelated
plans (FSDP actor, tensor-parallel critic), at 0.002 every loss stays within 1e-5 (measured).
"""

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

import loomrl
from loomrl.algorithms.workflows import build_workflow
from loomrl.checkpoint.store import export_checkpoint, latest_checkpoint, load_checkpoint
from loomrl.config.schema import LoraConfig, OptimConfig, TrainConfig
from loomrl.config.tools import load_config
from loomrl.errors import CheckpointError, ConfigError
from loomrl.models.lora import adapters_off, has_adapters, merge_adapters, moving_parameters
from loomrl.models.presets import model_config
from loomrl.models.tokenizer import build_char_tokenizer
from loomrl.models.zoo import build_causal_lm, parameter_shapes
from loomrl.plan import ClusterSpec, separate
from loomrl.plan.model_shape import ModelShape
from loomrl.plan.shards import tp_dim
from loomrl.planner.inputs import inputs_from_config
from loomrl.planner.simulation.simulator import simulate
from loomrl.role import build_model
from loomrl.role.spec import RoleSpec
from loomrl.rollout.kv_cache import SlotKVCache, causal_slot_mask
from loomrl.rollout.lean_forward import lean_logits, supports_lean_forward
from loomrl.train.rl import RLTrainer
from test_runtime import BF16_TOLERANCE, FUSED_TRAIN_2, _assert_equivalent

LORA = LoraConfig(r=4, alpha=8.0)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _spec(lora=LORA, **kw):
    return RoleSpec("actor", "llama-1m", "actor.model", seed=3, optim=OptimConfig(), lora=lora, **kw)


def _ids():
    return torch.randint(4, 48, (3, 10), generator=torch.Generator().manual_seed(0))


def _perturbed(model):
    """The adapters moved off their start (lora_B is zero there: a fresh LoRA model computes its base)."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in moving_parameters(model):
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def test_fresh_adapters_compute_the_base_and_only_they_train(tok):
    plain = build_model(_spec(lora=None), tok, torch.device("cpu"), torch.float32)
    lora = build_model(_spec(), tok, torch.device("cpu"), torch.float32)
    assert has_adapters(lora) and not has_adapters(plain)
    with torch.no_grad():
        assert torch.equal(plain(_ids()).logits, lora(_ids()).logits)
    trained = [n for n, p in lora.named_parameters() if p.requires_grad]
    assert trained == [n for n, _ in moving_parameters(lora)]
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    # 7 projections per layer, two matrices each
    assert len(trained) == 2 * 7 * lora.config.num_hidden_layers
    # every process draws the same adapters from the role's seed
    again = build_model(_spec(), tok, torch.device("cpu"), torch.float32)
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(moving_parameters(lora), moving_parameters(again)))


def test_bf16_keeps_the_adapters_in_fp32(tok):
    model = build_model(_spec(), tok, torch.device("cpu"), torch.bfloat16)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert all(d == torch.float32 for n, d in dtypes.items() if ".lora_" in n)
    assert all(d == torch.bfloat16 for n, d in dtypes.items() if ".lora_" not in n)


def test_adapters_off_computes_the_base(tok):
    base = build_model(_spec(lora=None), tok, torch.device("cpu"), torch.float32)
    model = _perturbed(build_model(_spec(), tok, torch.device("cpu"), torch.float32))
    with torch.no_grad():
        on = model(_ids()).logits
        assert not torch.allclose(on, base(_ids()).logits)
        with adapters_off(model):
            assert torch.equal(model(_ids()).logits, base(_ids()).logits)
        assert torch.equal(model(_ids()).logits, on)  # restored
    assert all(p.requires_grad for _, p in moving_parameters(model))


def test_the_lean_forward_adds_the_adapters(tok):
    model = _perturbed(build_model(_spec(), tok, torch.device("cpu"), torch.float32)).eval()
    assert supports_lean_forward(model)
    ids = _ids()
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    mask = causal_slot_mask(pos, ids.shape[1], model.dtype)
    rows = torch.arange(3)

    def cache():
        c = SlotKVCache(3, 16)
        c.bind(rows.tolist(), pos, ids.shape[1])
        return c

    lean = lean_logits(model, ids, pos, mask, cache())
    with torch.no_grad():
        own = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache(), use_cache=True)
    torch.testing.assert_close(lean, own.logits, rtol=1e-5, atol=1e-5)


def test_merging_folds_the_adapters_into_a_plain_model(tok):
    model = _perturbed(build_model(_spec(), tok, torch.device("cpu"), torch.float32))
    with torch.no_grad():
        before = model(_ids()).logits
        merged = merge_adapters(model)
        assert not has_adapters(merged)
        assert type(merged.model.layers[0].self_attn.q_proj) is torch.nn.Linear
        torch.testing.assert_close(merged(_ids()).logits, before, rtol=1e-5, atol=1e-5)


def test_tensor_parallelism_splits_the_adapter_on_the_split_side():
    p = "model.layers.0."
    assert tp_dim(p + "self_attn.q_proj.base_layer.weight") == 0
    assert tp_dim(p + "self_attn.q_proj.lora_A.default.weight") is None
    assert tp_dim(p + "self_attn.q_proj.lora_B.default.weight") == 0
    assert tp_dim(p + "mlp.down_proj.base_layer.weight") == 1
    assert tp_dim(p + "mlp.down_proj.lora_A.default.weight") == 1
    assert tp_dim(p + "mlp.down_proj.lora_B.default.weight") is None


def test_only_the_adapters_move(tok):
    """What reallocation, shadow sync, plan changes and checkpoints move of a LoRA role: its adapters, a small
    fraction of the model (r = 4 on a 1M-parameter model of hidden size 64)."""
    full, layers, tied = parameter_shapes("llama-1m", tok, value=False)
    moved, same, _ = parameter_shapes("llama-1m", tok, value=False, lora=LORA)
    assert layers == same and not tied  # the zoo unties its embeddings
    assert moved and all(".lora_A." in n or ".lora_B." in n for n in moved)
    numel = lambda shapes: sum(torch.Size(s).numel() for s in shapes.values())  # noqa: E731
    assert numel(full) > 10 * numel(moved)


def test_a_lora_actors_reference_is_its_base():
    base = load_config(TrainConfig, None, ["actor.lora.r=4", "algo.kl_coef=0.1"])
    copy = dataclasses.replace(
        base, actor=dataclasses.replace(base.actor, lora=dataclasses.replace(LORA, reference="copy"))
    )
    assert base.reference_role == "actor" and copy.reference_role == "ref"
    workflow = build_workflow(base.algo, base.rollout, base.reward, base.reference_role)
    assert workflow["ref_inf"].role == "actor" and "ref" not in workflow.roles()


@pytest.mark.parametrize(
    "override,message",
    [
        ("actor.lora.r=-1", "actor.lora.r"),
        ("actor.lora.target_modules=[qproj]", "'qproj' is not a projection (valid: q_proj"),
        ("actor.lora.target_modules=[]", "actor.lora.target_modules: is empty"),
        ("actor.lora.reference=none", "actor.lora.reference"),
        ("critic.lora.r=4 checkpoint.format=full", "checkpoint.format: 'full' writes whole models; critic.lora"),
    ],
)
def test_bad_lora_settings_name_the_field(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_config(TrainConfig, None, override.split())


# ----------------------------------------------------------------------------------------------- runs


def _cfg(tmp_path, name, *extra):
    return load_config(
        TrainConfig,
        None,
        [
            f"run_dir={tmp_path / name}",
            "seed=3",
            "rollout.prompts_per_iter=8",
            "rollout.max_new_tokens=6",
            "loop.iterations=3",
            "loop.eval_every=0",
            "loop.save_every=0",
            "loop.eval_prompts=8",
            "loop.progress=false",
            "report.html=false",
            "runtime.threads=1",
            "runtime.timeout_s=120",
            "algo.minibatches=2",
            "algo.ppo_epochs=2",
            "algo.kl_coef=0.1",
            "actor.optim.lr=0.002",
            "actor.lora.r=8",
            "critic.lora.r=4",
            "runtime.executor=reference",
            *extra,
        ],
    )


def _metrics(tmp_path, name, *extra):
    RLTrainer(_cfg(tmp_path, name, *extra)).run()
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = tmp_path_factory.mktemp("lora")
    return path, _metrics(path, "ref")


def test_the_base_as_reference_gives_a_frozen_copys_run(tmp_path, reference):
    """The reference call on the actor's base (adapters off) against a separate frozen copy of the base: the same
    log-probs, so the same run, KL included."""
    _, ref = reference
    copy = _metrics(tmp_path, "copy", "actor.lora.reference=copy")
    assert [r["kl/mean"] for r in copy] == [r["kl/mean"] for r in ref]
    assert ref[-1]["kl/mean"] != 0.0  # the adapters trained away from the base
    _assert_equivalent(copy, ref, rel=0, abs_=0)


def test_the_checkpoint_holds_the_adapters_and_the_exports_load(reference, tmp_path):
    """The checkpoint holds the adapters (and the critic's head) with their optimizer state, nothing of the base;
    the merged export loads with plain transformers and the adapter export with peft, both computing the run's
    trained actor (its greedy answers)."""
    path, _ = reference
    ckpt = latest_checkpoint(path / "ref")
    index = json.loads((ckpt / "index.json").read_text())["roles"]
    for role in ("actor", "critic"):
        names = {k.split("/", 1)[1] for d in index[role]["files"].values() for k in d["tensors"]}
        assert names and all(".lora_" in n or n.startswith("score.") for n in names), role
        assert index[role]["adapters"]["lora"]["r"] == (8 if role == "actor" else 4)
    merged = AutoModelForCausalLM.from_pretrained(export_checkpoint(ckpt, "actor"))
    adapter_dir = export_checkpoint(ckpt, "actor", form="adapter")
    tok = AutoTokenizer.from_pretrained(adapter_dir)
    peft = PeftModel.from_pretrained(build_causal_lm("llama-1m", tok, 3), adapter_dir)
    trained = build_model(_spec(lora=LoraConfig(r=8)), tok, torch.device("cpu"), torch.float32)
    load_checkpoint(ckpt, {"actor": trained}, {}, restore_rng=False)
    base = build_causal_lm("llama-1m", tok, 3)
    ids = _ids()
    with torch.no_grad():
        want = trained(ids).logits
        assert not torch.allclose(want, base(ids).logits, atol=1e-3)
        for got in (merged(ids).logits, peft(ids).logits):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            assert torch.equal(got.argmax(-1), want.argmax(-1))
    with pytest.raises(CheckpointError, match="value model; a PEFT adapter form exists for language models only"):
        export_checkpoint(ckpt, "critic", tmp_path / "c", form="adapter")


def test_a_lora_run_resumes_exactly(tmp_path, reference):
    _, ref = reference
    RLTrainer(_cfg(tmp_path, "r", "loop.iterations=1")).run()
    RLTrainer(_cfg(tmp_path, "r")).run(resume=True)
    got = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    _assert_equivalent(got, ref, rel=0, abs_=0)


@pytest.mark.usefixtures("ray_session")
@pytest.mark.parametrize(
    "layout",
    [
        ("runtime.devices=2", "runtime.layouts={actor: {sharding: fsdp}, critic: {tp: 2}}"),
        ("runtime.devices=2", "runtime.layouts={actor: {tp: 2}, critic: {pp: 2}}"),
        ("runtime.devices=2", "runtime.plan=separate:1"),
        ("runtime.devices=4", "runtime.layouts={actor: {pp: 2, tp: 2}}"),
        ("runtime.devices=2", "runtime.plan=colocate; stream_fusion=migrate_at:0.5,migrate_to:1,chunk:2"),
        ("runtime.devices=2", f"runtime.plan={FUSED_TRAIN_2}"),
        ("runtime.devices=2", "runtime.plan=interleave", "runtime.layouts={actor: {sharding: zero}}"),
    ],
    ids=[
        "fsdp_critic_tp2",
        "actor_tp2_critic_pp2",
        "separate",
        "actor_pp2tp2",
        "stream_fused",
        "pipeline_fused",
        "interleave_zero",
    ],
)
def test_lora_plans_compute_the_reference_run(tmp_path, reference, layout):
    """PPO with LoRA actor and critic and a KL to the actor's base on the Ray runtime: FSDP, ZeRO-1, tensor and
    pipeline parallel training, generation on its own device (its shadow synced with adapters only), interleaved
    calls, stream fusion (the base's reference log-probs among the fused inference calls) and pipeline fusion
    (both LoRA models in one bidirectional pipeline), each the reference run."""
    _, ref = reference
    got = _metrics(tmp_path, "ray", "runtime.executor=ray", *layout)
    _assert_equivalent(got, ref)


@pytest.mark.usefixtures("ray_session")
def test_a_lora_checkpoint_resumes_on_another_layout(tmp_path, reference):
    """Reference → Ray tp2 → reference, one iteration each: the adapters and their optimizer state move between
    layouts through the checkpoint."""
    _, ref = reference
    RLTrainer(_cfg(tmp_path, "x", "loop.iterations=1")).run()
    RLTrainer(
        _cfg(
            tmp_path,
            "x",
            "loop.iterations=2",
            "runtime.executor=ray",
            "runtime.devices=2",
            "runtime.layouts={actor: {tp: 2}}",
        )
    ).run(resume=True)
    RLTrainer(_cfg(tmp_path, "x")).run(resume=True)
    got = [json.loads(line) for line in (tmp_path / "x" / "metrics.jsonl").read_text().splitlines()]
    _assert_equivalent(got, ref)


def test_the_planner_prices_what_lora_trains_and_moves():
    """A LoRA actor as the cost model and simulator see it (7B on 8 H100s): the reference call on the actor's base,
    Adam and gradients for the adapters only, a backward without weight gradients, the shadow synced with the
    adapters, and copies that keep the base."""
    cluster = ClusterSpec.parse("h100:8")
    common = ["actor.model=qwen2.5-7b", "algo.name=grpo", "algo.kl_coef=0.1", "rollout.prompts_per_iter=64"]
    full, lora = (
        inputs_from_config(load_config(TrainConfig, None, [*common, *extra]), cluster)
        for extra in ([], ["actor.lora.r=16"])
    )
    assert "ref" in full.workflow.roles() and "ref" not in lora.workflow.roles()
    shape = lora.shapes["actor"]
    assert shape.trained_params == shape.adapter_params and 0 < shape.adapter_params < shape.params / 100
    plan = separate(lora.workflow, cluster)
    train, gen = plan["actor_train"], plan["actor_gen"]
    full_cost, lora_cost = full.cost_model(), lora.cost_model()
    assert lora_cost.static_memory("actor", train, True) < 0.2 * full_cost.static_memory("actor", train, True)
    assert lora_cost.static_memory("actor", train, False) == pytest.approx(
        full_cost.static_memory("actor", train, False), rel=0.01
    )  # the base is all of the weights
    assert lora_cost.realloc_time("actor", train, gen) < full_cost.realloc_time("actor", train, gen) / 20
    train_mfc = lora.workflow["actor_train"]
    assert lora_cost.mfc_time(train_mfc, train) < 0.8 * full_cost.mfc_time(full.workflow["actor_train"], train)
    assert lora_cost.copy_keeps_base("actor") and not full_cost.copy_keeps_base("actor")
    assert simulate(plan, lora.workflow, lora_cost, lora.memory_per_device).feasible


def test_the_planners_adapter_shapes_are_peft_s(tok):
    """What the planner prices as moving (:meth:`ModelShape.moving_shapes`) is what the runtime moves: the names
    and shapes of peft's adapters on the real model."""
    lora = LoraConfig(r=8, target_modules=("q_proj", "v_proj", "down_proj"))
    for arch in ("llama-1m", "qwen2-1m"):
        moved, _, _ = parameter_shapes(arch, tok, value=False, lora=lora)
        shape = ModelShape.from_config(model_config(arch, tok)).with_lora(lora.r, lora.target_modules)
        assert shape.moving_shapes() == moved
        assert shape.adapter_params == sum(math.prod(s) for s in moved.values())


@pytest.mark.usefixtures("ray_session")
def test_a_lora_run_whose_plan_changes_is_the_reference_run(tmp_path, reference):
    """Colocated with an FSDP actor, then separate, then interleaved: each change moves the adapters and their
    optimizer state (the new layouts build their base where they are placed), and the run is the reference run."""
    _, ref = reference
    cfg = _cfg(
        tmp_path,
        "change",
        "runtime.executor=ray",
        "runtime.devices=2",
        "runtime.layouts={actor: {sharding: fsdp}}",
        "runtime.verify_reallocation=true",
    )
    changes = {1: "separate:1", 2: "interleave"}
    RLTrainer(dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, plan_changes=changes))).run()
    got = [json.loads(line) for line in (tmp_path / "change" / "metrics.jsonl").read_text().splitlines()]
    _assert_equivalent(got, ref)


def test_the_lora_example_config_loads():
    cfg = load_config(TrainConfig, Path(loomrl.__file__).parent / "examples" / "smollm2" / "grpo_lora.yaml")
    assert cfg.actor.lora.r == 16 and cfg.reference_role == "actor"
    assert "ref_inf" not in build_workflow(cfg.algo, cfg.rollout, cfg.reward, cfg.reference_role)  # KL 0


@pytest.mark.usefixtures("ray_session")
def test_a_bf16_lora_run_matches_the_bf16_reference(tmp_path):
    """bf16 base, fp32 adapters: the runtime with an FSDP actor (its base sharded in fp32 and gathered as bf16, its
    adapters gathered in fp32, as they compute on one device) and a tensor-parallel generation copy (adapters
    moved in fp32) against the bf16 reference, within bf16's tolerance (tests/test_runtime.py), for two
    iterations. Why two: Adam's first steps move every element of lora_B by about ±lr whatever its gradient's
    size, so an element whose gradient is within bf16's rounding of zero steps either way, and the runs part
    faster than a full model's do: with a tensor-parallel generation copy the third iteration's KL differed by
    0.006 (lr 0.001; 0.0006 for the same plan without LoRA), beyond bf16's 0.005 (measured)."""
    bf16 = ("runtime.precision=bf16", "loop.iterations=2")
    ref = _metrics(tmp_path, "ref", *bf16)
    got = _metrics(
        tmp_path,
        "ray",
        *bf16,
        "runtime.executor=ray",
        "runtime.devices=2",
        "runtime.plan=actor_gen=0-1:tp2; actor_train=0-1:dp2fsdp; ref_inf=0-1:dp2; reward_inf=0-1:dp2; "
        "critic_inf=0-1:dp2; critic_train=0-1:dp2; advantages=0:dp1",
    )
    _assert_equivalent(got, ref, **BF16_TOLERANCE)
