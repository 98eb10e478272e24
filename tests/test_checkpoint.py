"""Checkpoints: exact round trip of weights, optimizer and RNG; HF loadability; pruning; crash safety."""

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

from loomrl.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint
from loomrl.errors import LoomError


def tiny_llama(seed: int) -> transformers.LlamaForCausalLM:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(config)


def tiny_tokenizer() -> transformers.PreTrainedTokenizerFast:
    vocab = {"<unk>": 0, "<pad>": 1, **{ch: i + 2 for i, ch in enumerate("abcdefghij")}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>")


def train_steps(model, opt, sched, n: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        ids = torch.randint(0, 32, (2, 8), generator=gen)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()


def make_run(seed: int = 0):
    model = tiny_llama(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    return model, opt, sched


def test_round_trip_continues_bitwise_identically(tmp_path):
    model, opt, sched = make_run()
    train_steps(model, opt, sched, 2, seed=1)
    ckpt = save_checkpoint(tmp_path, 2, {"actor": model}, tiny_tokenizer(), {"actor": opt},
                           {"data_position": 17}, schedulers={"actor": sched})
    train_steps(model, opt, sched, 3, seed=2)  # reference: keep training without the round trip

    fresh, fresh_opt, fresh_sched = make_run(seed=99)  # different init, so a no-op load would fail
    state = load_checkpoint(ckpt, {"actor": fresh}, {"actor": fresh_opt}, schedulers={"actor": fresh_sched})
    assert state == {"iteration": 2, "data_position": 17}
    train_steps(fresh, fresh_opt, fresh_sched, 3, seed=2)

    for (name, ref), (_, got) in zip(model.named_parameters(), fresh.named_parameters()):
        assert torch.equal(ref, got), name
    assert fresh_sched.get_last_lr() == sched.get_last_lr()


def test_rng_restored(tmp_path):
    model, opt, _ = make_run()
    torch.manual_seed(123)
    random.seed(5)
    np.random.seed(6)
    ckpt = save_checkpoint(tmp_path, 1, {"actor": model}, None, {"actor": opt}, {})
    expected = (torch.rand(4), random.random(), np.random.rand())
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    load_checkpoint(ckpt, {}, {})
    assert torch.equal(torch.rand(4), expected[0])
    assert random.random() == expected[1]
    assert np.random.rand() == expected[2]


def test_role_dir_is_a_plain_hf_checkpoint(tmp_path):
    model, opt, _ = make_run()
    critic = tiny_llama(1)
    ckpt = save_checkpoint(tmp_path, 3, {"actor": model, "critic": critic}, tiny_tokenizer(),
                           {"actor": opt}, {})
    loaded = transformers.AutoModelForCausalLM.from_pretrained(ckpt / "actor")
    assert torch.equal(loaded.model.embed_tokens.weight, model.model.embed_tokens.weight)
    tok = transformers.AutoTokenizer.from_pretrained(ckpt / "critic")
    assert tok("abc")["input_ids"] == [2, 3, 4]
    assert sorted(p.name for p in ckpt.iterdir()) == ["actor", "critic", "optimizers.pt", "rng.pt", "state.json"]


def test_keep_last_prunes_older_and_latest_points_at_newest(tmp_path):
    model, opt, _ = make_run()
    for it in (10, 20, 30):
        save_checkpoint(tmp_path, it, {"actor": model}, None, {"actor": opt}, {}, keep_last=2)
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["iter_000020", "iter_000030"]
    assert (root / "latest").read_text().strip() == "iter_000030"
    assert latest_checkpoint(tmp_path) == root / "iter_000030"


def test_resave_same_iteration_replaces_it(tmp_path):
    model, opt, _ = make_run()
    save_checkpoint(tmp_path, 5, {"actor": model}, None, {"actor": opt}, {"v": 1})
    ckpt = save_checkpoint(tmp_path, 5, {"actor": model}, None, {"actor": opt}, {"v": 2})
    assert json.loads((ckpt / "state.json").read_text())["v"] == 2
    assert [p.name for p in (tmp_path / "checkpoints").iterdir() if p.is_dir()] == ["iter_000005"]


def test_crash_mid_write_is_ignored(tmp_path):
    model, opt, _ = make_run()
    good = save_checkpoint(tmp_path, 1, {"actor": model}, None, {"actor": opt}, {})
    root = tmp_path / "checkpoints"
    partial = root / "iter_000002.tmp-4242"  # what a process killed during save_checkpoint leaves
    (partial / "actor").mkdir(parents=True)
    (partial / "state.json").write_text("{}")
    assert latest_checkpoint(tmp_path) == good
    (root / "latest").write_text("garbage\x00")  # corrupt pointer: fall back to scanning
    assert latest_checkpoint(tmp_path) == good
    (root / "latest").unlink()
    assert latest_checkpoint(tmp_path) == good


def test_no_checkpoint_yet(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    (tmp_path / "checkpoints").mkdir()
    assert latest_checkpoint(tmp_path) is None


def test_missing_or_corrupt_checkpoint_raises_one_line(tmp_path):
    model, opt, _ = make_run()
    with pytest.raises(LoomError, match="not a complete checkpoint"):
        load_checkpoint(tmp_path / "nope", {"actor": model}, {"actor": opt})
    ckpt = save_checkpoint(tmp_path, 1, {"actor": model}, None, {"actor": opt}, {})
    with pytest.raises(CheckpointError, match="critic"):
        load_checkpoint(ckpt, {"critic": model}, {})
    (ckpt / "optimizers.pt").write_bytes(b"truncated")
    with pytest.raises(CheckpointError, match="optimizers.pt") as info:
        load_checkpoint(ckpt, {}, {"actor": opt})
    assert "\n" not in str(info.value)
    (ckpt / "actor" / "model.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(CheckpointError, match="actor"):
        load_checkpoint(ckpt, {"actor": model}, {})


def test_non_json_state_fails_before_writing(tmp_path):
    model, opt, _ = make_run()
    with pytest.raises(TypeError):
        save_checkpoint(tmp_path, 1, {"actor": model}, None, {"actor": opt}, {"bad": object()})
    assert not (tmp_path / "checkpoints").exists()
    assert not Path(tmp_path / "checkpoints" / "latest").exists()
