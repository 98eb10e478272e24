"""The table of which features combine (:mod:`loomrl.plan.combinations`): every exclusion in it refuses a run that
has both features on, in one line naming the first's setting and the second feature, and neither feature alone is
refused by it."""

import pytest

from loomrl.algorithms.workflows import build_workflow
from loomrl.config.schema import TrainConfig
from loomrl.config.tools import load_config
from loomrl.errors import ConfigError
from loomrl.plan.combinations import EXCLUSIONS, FEATURES, check_combinations
from loomrl.train.rl import run_cluster, run_plan

ON = {
    "vllm": ("rollout.backend=vllm",),
    "stream_fusion": ("runtime.plan=colocate; stream_fusion=on",),
    "parallel_generation": ("runtime.layouts={actor: {tp: 2}}",),  # the default plan generates in it too
    "multi_turn": ("rollout.env.name=guess", "algo.name=grpo"),
    "lora_actor": ("actor.lora.r=4",),
    "asynchronous": ("runtime.plan=separate; async=1",),
    "partial_rollout": ("runtime.plan=separate; async=2,partial_rollout:on",),
    "dynamic_sampling": ("algo.name=grpo", "algo.dynamic_sampling.enabled=true"),
    "dynamic_placement": ("runtime.placement=dynamic",),
    "several_rollouts": ("algo.name=remax",),
}
"""Settings that turn each feature of the table on (on two devices)."""


def _features(*overrides: str) -> tuple[dict[str, bool], TrainConfig]:
    cfg = load_config(TrainConfig, None, ["runtime.devices=2", "runtime.executor=ray", *overrides])
    workflow = build_workflow(cfg.algo, cfg.rollout, cfg.reward, cfg.reference_role)
    plan = run_plan(cfg, workflow, run_cluster(cfg))
    return {k: f.on(cfg, workflow, plan) for k, f in FEATURES.items()}, (cfg, workflow, plan)


def test_every_feature_of_the_table_has_settings_that_turn_it_on():
    assert set(ON) == set(FEATURES)
    for key, overrides in ON.items():
        on, _ = _features(*overrides)
        assert on[key], key


@pytest.mark.parametrize("exclusion", EXCLUSIONS, ids=[f"{e.first}-{e.second}" for e in EXCLUSIONS])
def test_each_exclusion_refuses_the_pair_and_neither_alone(exclusion):
    first, second = FEATURES[exclusion.first], FEATURES[exclusion.second]
    on, run = _features(*ON[exclusion.first], *ON[exclusion.second])
    assert on[exclusion.first] and on[exclusion.second]
    with pytest.raises(ConfigError) as err:
        check_combinations(*run)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"{first.field}: not available with {second.name}")
    for key in (exclusion.first, exclusion.second):
        on, run = _features(*ON[key])
        others = [e for e in EXCLUSIONS if on[e.first] and on[e.second]]
        assert exclusion not in others
        if not others:
            check_combinations(*run)
