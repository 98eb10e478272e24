"""Multi-turn rollouts in a training run: episodes with an environment train alike on the reference executor and
on two Ray devices; observation tokens count for nothing in the losses."""

import json
import textwrap

import pytest
import torch

from loomrl.config.schema import TrainConfig
from loomrl.train.rl import RLTrainer
from test_runtime import _assert_equivalent, _cfg

ENV = textwrap.dedent(
    """
    from loomrl.envs import StepResult


    class Echo:
        '''Two turns: the first answer is acknowledged ('ok') and rewarded a little for its length; the second is
        scored by the digits it shares, position by position, with the row's answer, and a little for its length
        (so rewards vary, and are earned at both turns).'''

        def reset(self, row):
            self.turns, self.answer = 0, row["answer"]
            return [{"role": "user", "content": row["prompt"]}]

        def step(self, text):
            self.turns += 1
            if self.turns < 2:
                reply = [{"role": "user", "content": " ok:"}]
                return StepResult(reply, 0.05 * len(text), False, {"chars": float(len(text))})
            same = sum(a == b for a, b in zip(text, self.answer)) / len(self.answer)
            return StepResult([], same + 0.1 * len(text), True, {"chars": float(len(text))})
    """
)


@pytest.fixture
def env_file(tmp_path):
    path = tmp_path / "echo_env.py"
    path.write_text(ENV)
    return f"{path}:Echo"


def _episode_args(env_file):
    return (
        f"rollout.env.name={env_file}",
        "rollout.env.max_turns=3",
        "rollout.env.turn_tokens=5",
        "rollout.max_new_tokens=16",
        "algo.name=grpo",
        "algo.group_size=4",
        "rollout.prompts_per_iter=4",
    )


def _run(tmp_path, name, *extra):
    RLTrainer(_cfg(tmp_path, name, *extra)).run()
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.usefixtures("ray_session")
@pytest.mark.parametrize("algo, credit", [("grpo", "episode"), ("ppo", "episode"), ("grpo", "turn")])
def test_multi_turn_training_on_two_devices_matches_the_reference(tmp_path, env_file, algo, credit):
    """GRPO's groups are episodes of one row; PPO's critic and GAE see the same masks; turn credit's earned
    rewards travel with the batch."""
    args = (*_episode_args(env_file), f"algo.name={algo}", f"rollout.env.credit={credit}")
    reference = _run(tmp_path, "ref", *args)
    assert all(r["episode/turns"] > 1 and r["episode/observed_tokens"] > 0 for r in reference)
    assert all(0 < r["episode/chars"] for r in reference)
    got = _run(tmp_path, "ray", *args, "runtime.executor=ray", "runtime.devices=2")
    _assert_equivalent(got, reference)
    for a, b in zip(got, reference):
        assert a["episode/turns"] == b["episode/turns"] and a["episode/observed_tokens"] == b["episode/observed_tokens"]


@pytest.mark.parametrize("objective", ["ppo", "gspo"])
@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_observation_tokens_contribute_nothing_to_the_policy_loss_or_the_kl(objective, loss_agg):
    """Whatever an episode's observation positions hold (log-probs, advantages, reference), the actor's loss and
    its gradient over the sampled tokens are the same, and the observations get no gradient."""
    from loomrl.algorithms import losses as L

    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0, 1, 0, 0], [1, 0, 1, 1, 1, 0, 0, 0, 0, 0]], dtype=torch.float32)
    cols = {k: torch.randn(2, 10) for k in ("logp", "old", "adv", "ref")}

    def loss_and_grad(c):
        logp = c["logp"].clone().requires_grad_(True)
        loss, _ = L.policy_objective(objective)(logp, c["old"], c["adv"], mask, 0.2, None, loss_agg, None)
        loss = loss + 0.1 * L.kl_penalty_loss(logp, c["ref"], mask, "k3", loss_agg)
        loss.backward()
        return loss.detach(), logp.grad

    base_loss, base_grad = loss_and_grad(cols)
    hidden = mask == 0
    perturbed = {k: torch.where(hidden, torch.randn(2, 10) * 50, v) for k, v in cols.items()}
    loss, grad = loss_and_grad(perturbed)
    assert torch.equal(loss, base_loss) and torch.equal(grad, base_grad)
    assert (grad[hidden] == 0).all() and (grad[~hidden] != 0).any()


@pytest.mark.parametrize(
    "args, message",
    [
        (("rollout.env.name=calculater",), r"^rollout\.env\.name: environment 'calculater': not a built-in"),
        (("rollout.env.name=guess", "reward.source=model", "reward.model=llama-1m"), r"reward\.source.*rollout\.env"),
        (("rollout.env.name=guess", "algo.name=remax"), r"algo\.name.*'remax' does not combine with rollout\.env"),
        (("rollout.env.at_budget=cut",), r"rollout\.env\.at_budget"),
    ],
)
def test_a_bad_environment_setting_is_one_line_naming_the_field(tmp_path, args, message):
    from loomrl.errors import LoomError

    with pytest.raises(LoomError, match=message) as err:
        RLTrainer(_cfg(tmp_path, "bad", *args))
    assert "\n" not in str(err.value)


AGENT = textwrap.dedent(
    """
    import openai


    class EchoAgent:
        # the Echo environment's episode as an agent drives it: its own loop with the openai client

        def reset(self, row):
            self.answer = row["answer"]
            return [{"role": "user", "content": row["prompt"]}]

        def run(self, base_url, messages):
            client = openai.OpenAI(base_url=base_url, api_key="unused")
            for turn in range(2):
                reply = client.chat.completions.create(model="policy", messages=messages)
                text = reply.choices[0].message.content
                messages = messages + [{"role": "assistant", "content": text}, {"role": "user", "content": " ok:"}]
            return sum(a == b for a, b in zip(text, self.answer)) / len(self.answer)
    """
)


@pytest.fixture
def agent_file(tmp_path):
    path = tmp_path / "echo_agent.py"
    path.write_text(AGENT)
    return f"{path}:EchoAgent"


@pytest.mark.usefixtures("ray_session")
def test_an_agent_with_the_openai_client_trains_alike_on_two_devices_and_the_reference(tmp_path, agent_file):
    reference = _run(tmp_path, "ref", *_episode_args(agent_file))
    assert all(r["episode/turns"] == 2 and r["episode/observed_tokens"] > 0 for r in reference)
    got = _run(tmp_path, "ray", *_episode_args(agent_file), "runtime.executor=ray", "runtime.devices=2")
    _assert_equivalent(got, reference)


def test_a_prompt_file_needs_reward_functions_unless_an_environment_rewards_its_episodes(tmp_path):
    from loomrl.config.schema import EvalConfig
    from loomrl.config.tools import load_config
    from loomrl.errors import ConfigError

    file = ("task.name=file", f"task.prompt_file={tmp_path / 'p.jsonl'}")
    with pytest.raises(ConfigError, match=r"task\.reward_fn: .* or an environment \(rollout\.env\.name\)"):
        load_config(TrainConfig, None, list(file))
    assert load_config(TrainConfig, None, [*file, "rollout.env.name=guess"]).rollout.env.name == "guess"
    with pytest.raises(ConfigError, match=r"task\.reward_fn: task 'file' needs reward_fn \(or reward_fns\) to score"):
        load_config(EvalConfig, None, ["model=llama-1m", *file])


def test_a_demonstration_is_laid_out_as_a_sampled_episode_and_a_warm_start_learns_it(tmp_path):
    import json as jsonlib

    from loomrl.algorithms.episode_ops import demonstrations
    from loomrl.config.environment import EnvConfig
    from loomrl.config.schema import SFTConfig
    from loomrl.config.tools import load_config
    from loomrl.data.tasks import Example
    from loomrl.envs import Calculator
    from loomrl.models.tokenizer import build_char_tokenizer
    from loomrl.train.sft import run_sft

    tok = build_char_tokenizer()
    (ep,) = demonstrations(tok, EnvConfig(name="guess"), [Example("guess", "7", row={})])
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    eos = tok.eos_token_id
    # binary search 0..9 for 7: 4 (higher), 7
    assert ep.tokens == [*enc("4"), eos, *enc(" higher:"), *enc("7"), eos]
    assert ep.mask == [1, 1] + [0] * len(enc(" higher:")) + [1, 1] and ep.reward == 1.0 and ep.turns == 2
    assert ep.prompt == [tok.bos_token_id, *enc("guess 0 9:")]
    calc = Calculator()
    row = {"prompt": "What is 418 * 7? Reply with the number only.", "answer": "2926"}
    calc.reset(row)
    turns = calc.demonstrate(row)
    assert calc.step(turns[0]).messages == [{"role": "tool", "content": "2926"}] and calc.step(turns[1]).reward == 1
    rows = tmp_path / "guess.jsonl"
    rows.write_text("".join(jsonlib.dumps({"prompt": "guess", "answer": str(i % 10)}) + "\n" for i in range(200)))
    cfg = load_config(
        SFTConfig,
        None,
        [f"out_dir={tmp_path / 'sft'}", "task.name=file", f"task.prompt_file={rows}", "env.name=guess"]
        + ["steps=60", "batch_size=32", "eval_prompts=20", "max_new_tokens=24"],
    )
    summary = run_sft(cfg, progress=False)
    losses = [jsonlib.loads(x)["loss"] for x in (tmp_path / "sft" / "sft_metrics.jsonl").read_text().splitlines()]
    assert losses[-1] < 0.5 * losses[0] and "eval/turns" in summary


def test_turn_credit_carries_the_earned_rewards_from_the_episodes_to_the_advantages(tmp_path, env_file):
    from loomrl.algorithms.workflows import build_workflow

    for credit, carried in (("episode", False), ("turn", True)):
        cfg = _cfg(tmp_path, credit, *_episode_args(env_file), f"rollout.env.credit={credit}")
        flow = build_workflow(cfg.algo, cfg.rollout)
        assert ("earned_reward" in flow["actor_gen"].outputs) is carried
        assert ("earned_reward" in flow["advantages"].inputs) is carried


@pytest.mark.usefixtures("ray_session")
def test_multi_turn_training_at_staleness_one_matches_the_reference(tmp_path, env_file):
    """Episodes generated a policy version ahead on their own device (separate; async=1): the Ray run equals the
    reference's asynchronous run, the earned rewards of turn credit included."""
    args = (*_episode_args(env_file), "rollout.env.credit=turn", "runtime.plan=separate; async=1", "runtime.devices=2")
    reference = _run(tmp_path, "ref", *args)
    assert [r["async/staleness"] for r in reference] == [0.0, 1.0, 1.0]
    got = _run(tmp_path, "ray", *args, "runtime.executor=ray")
    _assert_equivalent(got, reference)
