"""Checkpoints: exact round trip of weights, optimizer and RNG; HF loadability; pruning; crash safety; the
manifest's checks of every file; no non-finite state on disk."""

import hashlib
import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

from loomrl.checkpoint.store import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    remove_leftovers,
    save_checkpoint,
    verify_checkpoint,
)
from loomrl.errors import LoomError
from loomrl.train.evaluation import resolve_target


def tiny_llama(seed: int) -> transformers.LlamaForCausalLM:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
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
    ckpt = save_checkpoint(tmp_path, 2, {"actor": model}, tiny_tokenizer(), {"actor": opt}, {"data_position": 17})
    train_steps(model, opt, sched, 3, seed=2)  # reference: keep training without the round trip

    fresh, fresh_opt, fresh_sched = make_run(seed=99)  # different init, so a no-op load would fail
    state = load_checkpoint(ckpt, {"actor": fresh}, {"actor": fresh_opt})
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
    ckpt = save_checkpoint(tmp_path, 3, {"actor": model, "critic": critic}, tiny_tokenizer(), {"actor": opt}, {})
    loaded = transformers.AutoModelForCausalLM.from_pretrained(ckpt / "actor")
    assert torch.equal(loaded.model.embed_tokens.weight, model.model.embed_tokens.weight)
    tok = transformers.AutoTokenizer.from_pretrained(ckpt / "critic")
    assert tok("abc")["input_ids"] == [2, 3, 4]
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "actor",
        "critic",
        "manifest.json",
        "optimizers.pt",
        "rng.pt",
        "state.json",
    ]


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


# --- integrity: the manifest, non-finite state, crashes -------------------------------------------------


def _one_line(info: pytest.ExceptionInfo) -> str:
    message = str(info.value)
    assert message and "\n" not in message, message
    return message


def test_manifest_lists_every_other_file_with_its_size_and_sha256(tmp_path):
    model, opt, _ = make_run()
    ckpt = save_checkpoint(tmp_path, 1, {"actor": model}, tiny_tokenizer(), {"actor": opt}, {})
    listed = json.loads((ckpt / "manifest.json").read_text())["files"]
    on_disk = sorted(p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file())
    assert sorted(listed) == [name for name in on_disk if name != "manifest.json"]
    for name, entry in listed.items():
        data = (ckpt / name).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name


def test_one_corrupted_byte_of_the_weights_is_named_and_nothing_is_loaded(tmp_path):
    model, opt, _ = make_run()
    ckpt = save_checkpoint(tmp_path, 1, {"actor": model}, None, {"actor": opt}, {})
    weights = ckpt / "actor" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit, same size: only the checksum can tell
    weights.write_bytes(bytes(data))
    fresh, fresh_opt, _ = make_run(seed=5)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(ckpt, {"actor": fresh}, {"actor": fresh_opt})
    message = _one_line(info)
    assert str(weights) in message and "SHA-256" in message
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items()), "a damaged checkpoint loaded"


def test_a_missing_or_truncated_file_is_named(tmp_path):
    model, opt, _ = make_run()
    ckpt = save_checkpoint(tmp_path, 1, {"actor": model}, None, {"actor": opt}, {})
    (ckpt / "rng.pt").unlink()
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(ckpt, {"actor": model}, {"actor": opt})
    assert f"{ckpt / 'rng.pt'}: missing" in _one_line(info)
    ckpt = save_checkpoint(tmp_path, 2, {"actor": model}, None, {"actor": opt}, {})
    config = ckpt / "actor" / "config.json"
    config.write_text(config.read_text()[:-5])
    with pytest.raises(CheckpointError) as info:
        verify_checkpoint(ckpt)
    assert str(config) in _one_line(info) and "bytes" in str(info.value)


def test_a_checkpoint_saved_before_manifests_still_loads_with_a_warning(tmp_path):
    model, opt, _ = make_run()
    ckpt = save_checkpoint(tmp_path, 1, {"actor": model}, None, {"actor": opt}, {"data_position": 3})
    (ckpt / "manifest.json").unlink()
    fresh, fresh_opt, _ = make_run(seed=5)
    with pytest.warns(UserWarning, match="unverified"):
        state = load_checkpoint(ckpt, {"actor": fresh}, {"actor": fresh_opt})
    assert state["data_position"] == 3
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))


def test_eval_of_a_run_checks_its_actor_against_the_manifest(tmp_path):
    model, opt, _ = make_run()
    ckpt = save_checkpoint(tmp_path, 1, {"actor": model}, None, {"actor": opt}, {})
    (tmp_path / "config.yaml").write_text("{}\n")
    assert resolve_target(tmp_path).model == ckpt / "actor"
    (ckpt / "optimizers.pt").write_bytes(b"damaged")  # eval reads the actor only: not its concern
    assert resolve_target(tmp_path).model == ckpt / "actor"
    (ckpt / "actor" / "model.safetensors").write_bytes(b"damaged")
    for target in (tmp_path, ckpt):
        with pytest.raises(CheckpointError, match="model.safetensors"):
            resolve_target(target)


@pytest.mark.parametrize("where", ["weight", "optimizer"])
def test_non_finite_state_is_never_saved_and_the_previous_checkpoint_stays(tmp_path, where):
    model, opt, sched = make_run()
    train_steps(model, opt, sched, 1, seed=1)
    good = save_checkpoint(tmp_path, 1, {"actor": model}, None, {"actor": opt}, {})
    with torch.no_grad():
        if where == "weight":
            model.model.norm.weight[3] = float("nan")
        else:
            opt.state[model.lm_head.weight]["exp_avg"][0, 0] = float("inf")
    with pytest.raises(CheckpointError) as info:
        save_checkpoint(tmp_path, 2, {"actor": model}, None, {"actor": opt}, {}, keep_last=1)
    message = _one_line(info)
    assert "NaN or inf" in message
    if where == "weight":
        assert "actor weight 'model.norm.weight'" in message
    else:
        assert "actor optimizer state" in message and "exp_avg" in message
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["iter_000001", "latest"]
    assert latest_checkpoint(tmp_path) == good
    load_checkpoint(good, {}, {})


def test_leftovers_of_crashed_saves_are_removed_by_the_next_save(tmp_path):
    model, opt, _ = make_run()
    save_checkpoint(tmp_path, 1, {"actor": model}, None, {"actor": opt}, {})
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    root = tmp_path / "checkpoints"
    for name in (
        f"iter_000002.tmp-{dead.stdout.strip()}",
        f"iter_000000.stale-{dead.stdout.strip()}",
        f"iter_000002.tmp-{os.getpid()}x",
    ):
        (root / name / "actor").mkdir(parents=True)
    (root / f"latest.tmp-{dead.stdout.strip()}").write_text("iter_000002\n")
    save_checkpoint(tmp_path, 3, {"actor": model}, None, {"actor": opt}, {})
    assert sorted(p.name for p in root.iterdir()) == [
        "iter_000001",
        f"iter_000002.tmp-{os.getpid()}x",
        "iter_000003",
        "latest",
    ]


def test_a_resume_removes_the_leftovers_of_dead_writers(tmp_path):
    """A run resumed after a save was cut short may write no checkpoint again: the resume itself removes them."""
    model, opt, _ = make_run()
    save_checkpoint(tmp_path, 1, {"actor": model}, None, {"actor": opt}, {})
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    root = tmp_path / "checkpoints"
    for name in (f"iter_000000.stale-{dead.stdout.strip()}", f"iter_000002.tmp-{os.getpid()}"):
        (root / name / "actor").mkdir(parents=True)
    remove_leftovers(tmp_path)
    assert sorted(p.name for p in root.iterdir()) == ["iter_000001", f"iter_000002.tmp-{os.getpid()}", "latest"]


CRASH_SERVER = textwrap.dedent('''
    """Saves iteration 1 of a run per trial, then forks a child saving iteration 2 (weights + 0.5) and kills
    it with SIGKILL: where a hook pauses it, or after a random delay."""
    import json, os, random, shutil, signal, sys, threading, time
    from pathlib import Path
    import torch, tqdm, transformers, transformers.modeling_utils
    import loomrl.checkpoint.store as ck
    import loomrl.checkpoint.shards as shards

    torch.set_num_threads(1)
    # tqdm (save_pretrained's progress bars) locks a semaphore shared with forked children, which a child killed
    # while holding it would leave locked for good: a lock of this process only, and no monitor thread
    tqdm.tqdm.set_lock(threading.RLock())
    tqdm.tqdm.monitor_interval = 0
    transformers.utils.logging.disable_progress_bar()
    base, points, random_trials = Path(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
    sharded = sys.argv[4] == "sharded"

    def pause(marker, tag):
        marker.write_text(tag)
        time.sleep(600)

    def hook(owner, name, marker, tag, match, partial=None):
        original = getattr(owner, name)
        def wrapper(*args, **kwargs):
            if match(*args):
                if partial is not None:
                    partial(*args)
                pause(marker, tag)
            return original(*args, **kwargs)
        setattr(owner, name, wrapper)

    def nth_call(n):
        calls = [0]
        def match(*args):
            calls[0] += 1
            return calls[0] == n
        return match

    def delete_one_file(path, *rest):
        next(p for p in Path(path).rglob("*") if p.is_file()).unlink()

    HOOKS = {
        "weights": (transformers.modeling_utils, "safe_save_file", lambda *a: True, None),
        "optimizers": (torch, "save", nth_call(1), None),
        "rng": (torch, "save", nth_call(2), None),
        "state": (ck, "_write_text_synced", lambda f, t: Path(f).name == "state.json", None),
        "manifest": (ck, "_write_text_synced", lambda f, t: Path(f).name == "manifest.json", None),
        "rename": (os, "replace", lambda src, dst: Path(dst).name == "iter_000002", None),
        "latest": (os, "replace", lambda src, dst: Path(dst).name == "latest", None),
        "prune": (shutil, "rmtree", lambda path, *r, **k: ".stale-" in str(path), delete_one_file),
    }
    if sharded:  # the weights' shard, then the optimizer's; rng.pt is then the only torch.save
        HOOKS.update({"weights": (shards, "save_file", nth_call(1), None),
                      "optimizers": (shards, "save_file", nth_call(2), None),
                      "rng": (torch, "save", nth_call(1), None)})

    def save(run, iteration, model, opt):
        if sharded:
            ck.save_sharded_checkpoint(run, iteration, {"actor": (model, opt)}, None, {"tag": iteration}, keep_last=1)
        else:
            ck.save_checkpoint(run, iteration, {"actor": model}, None, {"actor": opt}, {"tag": iteration}, keep_last=1)

    def model_and_optimizer():
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, max_position_embeddings=64))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ids = torch.arange(16).view(2, 8)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        return model, opt

    rng = random.Random(0)
    trials = [(p, None) for p in points] + [(None, i) for i in range(random_trials)]
    for k, (point, _) in enumerate(trials):
        run = base / f"trial_{k}"
        model, opt = model_and_optimizer()
        sums = {1: sum(float(p.detach().double().sum()) for p in model.parameters())}
        sums[2] = sums[1] + 0.5 * sum(p.numel() for p in model.parameters())
        start = time.perf_counter()
        save(run, 1, model, opt)
        took = time.perf_counter() - start
        marker = run / "paused"
        pid = os.fork()
        if pid == 0:
            try:
                if point is not None:
                    owner, name, match, partial = HOOKS[point]
                    hook(owner, name, marker, point, match, partial)
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(0.5)
                save(run, 2, model, opt)
            finally:
                os._exit(0)
        if point is not None:
            deadline = time.monotonic() + 60
            while not marker.exists() and time.monotonic() < deadline and os.waitpid(pid, os.WNOHANG) == (0, 0):
                time.sleep(0.01)
        else:
            time.sleep(rng.uniform(0, 1.5 * took))
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        print(json.dumps({"run": str(run), "point": point, "paused": marker.exists(), "sums": sums}), flush=True)
''')

CRASH_POINTS = ["weights", "optimizers", "rng", "state", "manifest", "rename", "latest", "prune"]


@pytest.mark.parametrize("form", ["full", "sharded"])
def test_a_save_killed_at_any_point_leaves_a_loadable_checkpoint(tmp_path, form):
    """SIGKILL at each step of a save (and after random delays), whole or sharded: the chosen checkpoint is
    complete, passes its manifest, and holds the weights of its own iteration; no partial directory is ever
    chosen."""
    from loomrl.checkpoint.optim_state import FullOptimizerState
    from loomrl.checkpoint.store import save_sharded_checkpoint

    proc = subprocess.run(
        [sys.executable, "-c", CRASH_SERVER, str(tmp_path), json.dumps(CRASH_POINTS), "4", form],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    trials = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(trials) == len(CRASH_POINTS) + 4
    for trial in trials:
        run, point = Path(trial["run"]), trial["point"]
        if point is not None:
            assert trial["paused"], f"the save never reached {point}"
        chosen = latest_checkpoint(run)
        assert chosen is not None and chosen.name in ("iter_000001", "iter_000002"), (point, chosen)
        expected = {"weights": 1, "optimizers": 1, "rng": 1, "state": 1, "manifest": 1, "rename": 1, "prune": 2}
        if point in expected:
            assert chosen.name == f"iter_00000{expected[point]}", (point, chosen)
        if point in ("weights", "optimizers", "rng", "state", "manifest", "rename"):
            assert any(".tmp-" in p.name for p in (run / "checkpoints").iterdir()), "the partial save is gone"
        fresh, fresh_opt, _ = make_run(seed=7)
        optimizer = FullOptimizerState(fresh, fresh_opt) if form == "sharded" else fresh_opt
        state = load_checkpoint(chosen, {"actor": fresh}, {"actor": optimizer})
        assert state["tag"] == state["iteration"] == int(chosen.name[-1]), (point, state)
        total = sum(float(p.detach().double().sum()) for p in fresh.parameters())
        assert total == pytest.approx(trial["sums"][str(state["iteration"])], rel=1e-9, abs=1e-6), point
        if form == "sharded":
            save_sharded_checkpoint(run, 3, {"actor": (fresh, fresh_opt)}, None, {"tag": 3}, keep_last=1)
        else:
            save_checkpoint(run, 3, {"actor": fresh}, None, {"actor": fresh_opt}, {"tag": 3}, keep_last=1)
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["iter_000003", "latest"], point


def test_checkpoint_keep_last_and_its_old_name_loop_keep_checkpoints(tmp_path):
    from loomrl.config.schema import TrainConfig
    from loomrl.config.tools import dump_yaml, load_config
    from loomrl.errors import ConfigError

    assert load_config(TrainConfig, None, []).checkpoint.keep_last == 2
    old_run = tmp_path / "config.yaml"  # what runs wrote before checkpoint.keep_last existed
    old_run.write_text("loop:\n  keep_checkpoints: 5\n")
    with pytest.warns(FutureWarning, match="old name of checkpoint.keep_last"):
        cfg = load_config(TrainConfig, old_run)
    assert cfg.checkpoint.keep_last == 5 and cfg.loop.keep_checkpoints is None
    assert "keep_last: 5" in dump_yaml(cfg)
    with pytest.raises(ConfigError) as info:
        load_config(TrainConfig, old_run, ["checkpoint.keep_last=3"])
    assert "loop.keep_checkpoints: 5 conflicts with checkpoint.keep_last 3" in _one_line(info)
    with pytest.raises(ConfigError, match="checkpoint.keep_last: 0 is out of range"):
        load_config(TrainConfig, None, ["checkpoint.keep_last=0"])


def test_a_run_keeps_checkpoint_keep_last_checkpoints(tmp_path):
    from loomrl.train.rl import RLTrainer
    from test_rl import tiny_cfg

    run_dir = tmp_path / "run"
    RLTrainer(
        tiny_cfg(
            run_dir,
            "algo.name=grpo",
            "loop.iterations=3",
            "loop.save_every=1",
            "loop.eval_every=0",
            "checkpoint.keep_last=1",
        )
    ).run()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["iter_000002", "latest"]
    verify_checkpoint(run_dir / "checkpoints" / "iter_000002")
