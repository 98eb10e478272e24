"""A pretrained model's details through whole runs: a checkpoint imported from GGUF (tied embeddings, a byte-level
BPE tokenizer whose bos opens its ChatML template, several eos ids in its generation config) trains with PPO and a
critic initialised from it, colocated, separated, stream-fused and pipeline-fused on two devices (the tied
embedding then held by the actor's first and last pipeline stage) the same run as the reference executor, and
the trained policy exports to a directory plain ``from_pretrained`` loads, generation config included."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from gguf_files import write_tiny_llama
from loomrl.checkpoint.store import export_checkpoint, latest_checkpoint
from loomrl.config.schema import TrainConfig
from loomrl.config.tools import load_config
from loomrl.models.pretrained import import_gguf
from loomrl.train.rl import RLTrainer
from test_runtime import FUSED_TRAIN_2, _assert_equivalent

pytest.importorskip("gguf", reason="the gguf package reads GGUF files (make install installs it)")
pytestmark = pytest.mark.usefixtures("ray_session")

EOS_IDS = [2, 0]
"""The imported model's generation config ends a sample at <|im_end|> or <|endoftext|>."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny GGUF model imported, as a plain checkpoint directory with two eos ids in its generation config."""
    root = tmp_path_factory.mktemp("pretrained")
    imported = import_gguf(write_tiny_llama(root / "tiny.gguf"), root / "imported")
    plain = root / "model"
    shutil.copytree(imported, plain)
    generation = GenerationConfig.from_pretrained(plain)
    generation.eos_token_id = EOS_IDS
    generation.save_pretrained(plain)
    return plain


def _run(tmp_path, model_dir, name, *extra):
    cfg = load_config(
        TrainConfig,
        None,
        [
            f"run_dir={tmp_path / name}",
            "seed=5",
            "task.name=arith",
            f"actor.model={model_dir}",
            "algo.name=ppo",
            "algo.kl_coef=0.05",
            "algo.minibatches=2",
            "rollout.prompts_per_iter=8",
            "rollout.max_new_tokens=6",
            "rollout.temperature=1.0",
            "actor.optim.lr=0.001",
            "critic.optim.lr=0.001",
            "loop.iterations=2",
            "loop.eval_every=0",
            "loop.save_every=0",
            "loop.eval_prompts=8",
            "loop.progress=false",
            "report.html=false",
            "runtime.threads=1",
            "runtime.timeout_s=120",
            "runtime.executor=reference",
            *extra,
        ],
    )
    return cfg


def _metrics(tmp_path, name):
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, model_dir):
    tmp_path = tmp_path_factory.mktemp("ref")
    RLTrainer(_run(tmp_path, model_dir, "ref")).run()
    return tmp_path / "ref", _metrics(tmp_path, "ref")


def test_the_trained_policy_exports_to_what_from_pretrained_loads(reference, model_dir, tmp_path):
    run_dir, metrics = reference
    assert len(metrics) == 2 and math.isfinite(metrics[-1]["critic/value_loss"])
    out = export_checkpoint(latest_checkpoint(run_dir), "actor", tmp_path / "exported")
    model = AutoModelForCausalLM.from_pretrained(out)
    start = AutoModelForCausalLM.from_pretrained(model_dir)
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert not torch.equal(model.model.embed_tokens.weight, start.model.embed_tokens.weight)  # it was trained
    assert GenerationConfig.from_pretrained(out).eos_token_id == EOS_IDS
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template == AutoTokenizer.from_pretrained(model_dir).chat_template
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], tokenize=False)
    ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
    assert torch.isfinite(model(input_ids=ids).logits).all()


@pytest.mark.parametrize(
    "plan",
    ["colocate", "separate", "colocate; stream_fusion=migrate_at:0.5,migrate_to:1,chunk:2", FUSED_TRAIN_2],
    ids=["colocate", "separate", "stream_fused", "pipeline_fused"],
)
def test_every_placement_trains_the_pretrained_model_as_the_reference_does(tmp_path, model_dir, reference, plan):
    """The same metrics, and the same trained weights in the checkpoint (written from whatever layout trained
    them: pipeline stages write the tied embedding once)."""
    cfg = _run(tmp_path, model_dir, "ray", "runtime.executor=ray", "runtime.devices=2")
    RLTrainer(dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, plan=plan))).run()
    _assert_equivalent(_metrics(tmp_path, "ray"), reference[1])
    got, want = (
        AutoModelForCausalLM.from_pretrained(export_checkpoint(latest_checkpoint(run), "actor", tmp_path / name))
        for run, name in ((tmp_path / "ray", "got"), (reference[0], "want"))
    )
    assert got.lm_head.weight is got.model.embed_tokens.weight
    want_state = want.state_dict()
    assert max((p - want_state[n]).abs().max().item() for n, p in got.state_dict().items()) < 1e-5
