"""Sharded checkpoints (loomrl.checkpoint.shards): exact round trips, pieces placed from any layout, the export's
from_pretrained form, damaged and missing shards named in one line, old checkpoints still resuming."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from loomrl.checkpoint.optim_state import FullOptimizerState
from loomrl.checkpoint.shards import WHOLE, _overlaps, load_role_shards, read_role
from loomrl.checkpoint.store import (
    CheckpointError,
    export_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    save_sharded_checkpoint,
    verify_checkpoint,
)
from loomrl.errors import DataError
from loomrl.models.zoo import check_model_spec
from loomrl.parallel.zero import ZeroAdamW
from test_checkpoint import _one_line, make_run, tiny_llama, tiny_tokenizer, train_steps


def test_a_sharded_round_trip_continues_bitwise_identically(tmp_path):
    model, opt, sched = make_run()
    train_steps(model, opt, sched, 2, seed=1)
    ckpt = save_sharded_checkpoint(tmp_path, 2, {"actor": (model, opt)}, tiny_tokenizer(), {"data_position": 17})
    train_steps(model, opt, sched, 3, seed=2)

    fresh, fresh_opt, fresh_sched = make_run(seed=99)
    state = load_checkpoint(ckpt, {"actor": fresh}, {"actor": FullOptimizerState(fresh, fresh_opt)})
    assert state == {"iteration": 2, "data_position": 17}
    train_steps(fresh, fresh_opt, fresh_sched, 3, seed=2)
    for (name, ref), (_, got) in zip(model.named_parameters(), fresh.named_parameters()):
        assert torch.equal(ref, got), name
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "actor",
        "index.json",
        "manifest.json",
        "rng.pt",
        "state.json",
        "tokenizer",
    ]


def test_bf16_master_weights_are_saved_beside_the_rounded_weights(tmp_path):
    model = tiny_llama(0).to(torch.bfloat16)
    opt = ZeroAdamW(model.named_parameters(), None, lr=1e-2, betas=(0.9, 0.999), weight_decay=0.0)
    ids = torch.arange(16).view(2, 8)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    ckpt = save_sharded_checkpoint(tmp_path, 1, {"actor": (model, opt)}, None, {})
    weights, optim = read_role(ckpt, "actor")
    assert all(w.dtype == torch.bfloat16 for w in weights.values())
    assert optim["state"] and all(st["master"].dtype == torch.float32 for st in optim["state"].values())
    want = opt.full_state_dict()  # the full form the old checkpoints held
    assert optim["state"].keys() == want["state"].keys()
    for name, st in want["state"].items():
        for key, value in st.items():
            assert torch.equal(optim["state"][name][key], value), (name, key)


def _pieces_of(full: torch.Tensor, intervals: list) -> torch.Tensor:
    return torch.cat([full.reshape(-1)[lo:hi] for lo, hi in intervals]) if intervals else full.new_zeros(0)


def test_pieces_written_under_a_layout_are_placed_whole_again(tmp_path):
    """Shard files as dp2 × tp2 ranks write them (ZeRO-1 flat blocks of the moments, tensor-parallel slices,
    replicated norms written by tp rank 0 only) are assembled into the full tensors by the reader."""
    from safetensors.torch import save_file

    from loomrl.checkpoint.shards import FORMAT, _duplicate
    from loomrl.plan.layout import Layout
    from loomrl.plan.shards import shard_intervals

    model = tiny_llama(3)
    full = {n: p.detach() for n, p in model.named_parameters()}
    moments = {n: torch.randn_like(p) for n, p in full.items()}
    layout = {"dp": 2, "tp": 2, "pp": 1, "reverse": False}
    files = {}
    (tmp_path / "actor").mkdir()
    for rank in range(4):
        place = {"layout": layout, "rank": rank, "weights_split": "none", "state_split": "flat"}
        tensors, shapes = {}, {}
        for kind, source, split in (("weights", full, "none"), ("exp_avg", moments, "flat")):
            for name, tensor in source.items():
                intervals = shard_intervals(name, tensor.shape, Layout(**layout), rank, 2, split)
                if intervals and not _duplicate(name, place, split):
                    tensors[f"{kind}/{name}"] = _pieces_of(tensor, intervals).clone()
                    shapes[f"{kind}/{name}"] = list(tensor.shape)
        rel = f"actor/r{rank}.safetensors"
        save_file(tensors, tmp_path / rel)
        files[rel] = {
            **place,
            "num_layers": 2,
            "tensors": shapes,
            "params": list(full),
            "trainable": list(full),
            "steps": {n: 3.0 for n in full},
        }
    (tmp_path / "index.json").write_text(
        json.dumps(
            {
                "format": FORMAT,
                "roles": {
                    "actor": {
                        "class": "LlamaForCausalLM",
                        "param_groups": [{"lr": 0.1, "betas": [0.9, 0.99]}],
                        "files": files,
                    }
                },
            }
        )
    )
    weights, optim = read_role(tmp_path, "actor")
    assert weights.keys() == full.keys() and all(torch.equal(weights[n], full[n]) for n in full)
    assert all(torch.equal(optim["state"][n]["exp_avg"], moments[n]) for n in full)
    assert optim["param_groups"][0]["betas"] == (0.9, 0.99) and float(optim["state"]["lm_head.weight"]["step"]) == 3
    stage, _ = read_role(tmp_path, "actor", ["model.layers.1.mlp.down_proj.weight"])  # a pipeline stage's share
    assert list(stage) == ["model.layers.1.mlp.down_proj.weight"]

    fresh = tiny_llama(4)  # one process holding the whole role reads just as well from those shards
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1.0)
    load_role_shards(tmp_path, "actor", fresh, fresh_opt, WHOLE)
    assert all(torch.equal(p, full[n]) for n, p in fresh.named_parameters())
    assert all(torch.equal(fresh_opt.state[p]["exp_avg"], moments[n]) for n, p in fresh.named_parameters())
    assert fresh_opt.param_groups[0]["lr"] == 0.1 and fresh_opt.param_groups[0]["betas"] == (0.9, 0.99)
    assert {float(st["step"]) for st in fresh_opt.state.values()} == {3.0}


def test_overlapping_runs_of_two_shards():
    """Elements 2-3 and 8-9 are in both: at 2 and 4 of mine, at 0 and 6 of theirs; a run contiguous in both
    lists is one."""
    assert _overlaps([(0, 4), (8, 12)], [(2, 10)]) == [(2, 0, 2), (4, 6, 2)]
    assert _overlaps([(0, 4), (4, 6)], [(0, 6)]) == [(0, 0, 6)]
    assert _overlaps([(0, 2)], [(2, 4)]) == []


def test_the_export_loads_with_from_pretrained_and_the_cli_writes_it(tmp_path):
    model, opt, sched = make_run()
    train_steps(model, opt, sched, 1, seed=1)
    ckpt = save_sharded_checkpoint(tmp_path / "run", 1, {"actor": (model, opt)}, tiny_tokenizer(), {})
    out = export_checkpoint(ckpt, "actor")
    assert out == ckpt / "hf" / "actor"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
    assert transformers.AutoTokenizer.from_pretrained(out)("abc")["input_ids"] == [2, 3, 4]
    verify_checkpoint(ckpt)  # the export lies outside the manifest
    with pytest.raises(DataError, match="loomrl export CHECKPOINT --role ROLE") as info:
        check_model_spec(str(ckpt / "actor"))  # shards, not a model to start a run from
    _one_line(info)
    check_model_spec(str(out))

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "loomrl.cli",
            "export",
            str(tmp_path / "run"),
            "--role",
            "actor",
            "--out",
            str(tmp_path / "exported"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().endswith(str(tmp_path / "exported"))
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    bad = subprocess.run(
        [sys.executable, "-m", "loomrl.cli", "export", str(ckpt), "--role", "critic"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "role 'critic'" in bad.stderr, bad.stderr


def _saved(tmp_path):
    model, opt, sched = make_run()
    train_steps(model, opt, sched, 1, seed=1)
    return save_sharded_checkpoint(tmp_path, 1, {"actor": (model, opt)}, None, {})


def test_a_flipped_byte_of_a_shard_is_named_and_nothing_is_loaded(tmp_path):
    ckpt = _saved(tmp_path)
    shard = ckpt / "actor" / "optim-r00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    fresh, fresh_opt, _ = make_run(seed=5)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(ckpt, {"actor": fresh}, {"actor": FullOptimizerState(fresh, fresh_opt)})
    assert str(shard) in _one_line(info) and "SHA-256" in str(info.value)
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items()), "a damaged checkpoint loaded"


def test_a_missing_shard_is_named(tmp_path):
    ckpt = _saved(tmp_path)
    shard = ckpt / "actor" / "weights-r00000.safetensors"
    shard.unlink()
    with pytest.raises(CheckpointError) as info:
        verify_checkpoint(ckpt)
    assert f"{shard}: missing" in _one_line(info)
    (ckpt / "manifest.json").unlink()  # unverified: the index still tells what is missing
    with pytest.warns(UserWarning, match="unverified"), pytest.raises(CheckpointError) as info:
        load_checkpoint(ckpt, {"actor": make_run()[0]}, {})
    assert str(shard) in _one_line(info)


def test_non_finite_pieces_are_refused_before_anything_is_written(tmp_path):
    model, opt, sched = make_run()
    train_steps(model, opt, sched, 1, seed=1)
    good = save_sharded_checkpoint(tmp_path, 1, {"actor": (model, opt)}, None, {})
    with torch.no_grad():
        opt.state[model.lm_head.weight]["exp_avg"][0, 0] = float("nan")
    with pytest.raises(CheckpointError) as info:
        save_sharded_checkpoint(tmp_path, 2, {"actor": (model, opt)}, None, {}, keep_last=1)
    assert "actor optimizer state 'lm_head.weight.exp_avg' holds NaN or inf" in _one_line(info)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["iter_000001", "latest"]
    assert latest_checkpoint(tmp_path) == good


def test_a_run_resumes_a_full_checkpoint_and_continues_sharded(tmp_path):
    """A run whose checkpoints were written whole (as before sharded checkpoints) resumes, and its next
    checkpoints are sharded; the metrics are those of the uninterrupted run."""
    from loomrl.train.rl import RLTrainer
    from test_rl import tiny_cfg

    common = ("algo.name=ppo", "loop.save_every=1", "loop.eval_every=0")
    RLTrainer(tiny_cfg(tmp_path / "whole", *common, "loop.iterations=2")).run()
    RLTrainer(tiny_cfg(tmp_path / "parts", *common, "loop.iterations=1", "checkpoint.format=full")).run()
    assert (tmp_path / "parts" / "checkpoints" / "iter_000000" / "optimizers.pt").is_file()
    RLTrainer(tiny_cfg(tmp_path / "parts", *common, "loop.iterations=2")).run(resume=True)
    assert (tmp_path / "parts" / "checkpoints" / "iter_000001" / "index.json").is_file()
    whole, parts = (
        [json.loads(line) for line in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
        for d in ("whole", "parts")
    )
    loss = [k for k in whole[-1] if k.endswith("loss")]
    assert len(loss) > 1 and {k: parts[-1][k] for k in loss} == {k: whole[-1][k] for k in loss}
    critic = export_checkpoint(tmp_path / "parts" / "checkpoints" / "iter_000001", "critic")
    assert transformers.AutoModelForSequenceClassification.from_pretrained(critic).config.num_labels == 1


@pytest.mark.usefixtures("ray_session")
def test_a_worker_killed_during_a_sharded_save_leaves_the_checkpoint_before(tmp_path):
    """Worker 1 (it owns half of the FSDP and ZeRO-1 shards) is killed with SIGKILL once worker 0 has begun the
    save after iteration 1: the run recovers from iteration 0's checkpoint, computes the reference run, and the
    unfinished save's directory is gone by the end."""
    import signal

    from loomrl.run_dir import RunDir
    from loomrl.train.rl import RLTrainer
    from test_recovery import LOSS_KEYS, SAMPLE_KEYS, _cfg, _lines

    common = ("loop.iterations=3", "loop.save_every=1")
    RLTrainer(_cfg(tmp_path, "ref", *common, "runtime.executor=reference")).run()
    trainer = RLTrainer(
        _cfg(
            tmp_path,
            "run",
            *common,
            "runtime.executor=ray",
            "runtime.devices=2",
            "runtime.max_failures=1",
            "runtime.layouts={actor: {sharding: fsdp}, critic: {sharding: zero}}",
        )
    )
    executor, waits, begun = trainer.executor, [], []
    original = executor._wait

    def wait(refs, what, role, ranks=None):
        out = original(refs, what, role, ranks)
        if what == "checkpoint save" and trainer.running == 1:
            waits.append(what)
            if len(waits) == 2:  # worker 0 has made the save's .tmp- directory; worker 1 has written nothing yet
                begun.append(Path(out[0]))
                os.kill(executor.pids[1], signal.SIGKILL)
        return out

    executor._wait = wait
    trainer.run()
    (failure,) = _lines(RunDir(tmp_path / "run").failures)
    assert (failure["iteration"], failure["resumes_after"]) == (1, 0)
    assert "worker 1 died during checkpoint save" in failure["error"], failure
    assert begun and begun[0].name.startswith("iter_000001.tmp-") and not begun[0].exists()
    root = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["iter_000001", "iter_000002", "latest"]
    verify_checkpoint(root / "iter_000002")
    got, expected = _lines(tmp_path / "run" / "metrics.jsonl"), _lines(tmp_path / "ref" / "metrics.jsonl")
    assert [m["iteration"] for m in got] == [0, 1, 2]
    for it, (a, b) in enumerate(zip(got, expected)):
        for key in SAMPLE_KEYS:
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), (it, key)
        for key in LOSS_KEYS:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (it, key, a[key], b[key])


def test_a_tied_embedding_on_two_pipeline_stages_is_written_once_and_placed_on_both(tmp_path):
    """A tied model trained as two pipeline stages: the first stage writes the shared matrix, the last stage's
    copy is left out, and a resuming last stage (or one whole process) reads it from the first stage's file."""
    from loomrl.checkpoint.shards import INDEX_FILE, merge_index, role_pieces, write_role_shards
    from loomrl.parallel.pipeline import split_stages

    def tied(seed: int) -> transformers.LlamaForCausalLM:
        model = tiny_llama(seed)
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.get_input_embeddings().weight
        return model

    full = {n: p.detach().clone() for n, p in tied(3).named_parameters()}
    layout = {"dp": 1, "tp": 1, "pp": 2, "reverse": False}
    places = [{"layout": layout, "rank": r, "weights_split": "none", "state_split": "none"} for r in range(2)]
    results = []
    for rank, place in enumerate(places):
        stage = split_stages(tied(3), rank, 2)
        opt = torch.optim.AdamW(stage.parameters(), lr=0.1)
        pieces = role_pieces(stage.model, opt, place, torch.float32)
        assert ("weights/model.embed_tokens.weight" in pieces["weights"]) == (rank == 0)
        results.append(write_role_shards(tmp_path, "actor", stage.model, opt, place, pieces))
    (tmp_path / INDEX_FILE).write_text(json.dumps(merge_index({"actor": results})))
    weights, _ = read_role(tmp_path, "actor")
    assert weights.keys() == full.keys() and all(torch.equal(weights[n], full[n]) for n in full)

    last = split_stages(tied(4), 1, 2)
    load_role_shards(tmp_path, "actor", last.model, torch.optim.AdamW(last.parameters(), lr=0.1), places[1])
    assert last.model.lm_head.weight is last.model.model.embed_tokens.weight  # still one weight
    assert all(torch.equal(p, full[n]) for n, p in last.named_parameters())
    whole = tied(5)
    load_role_shards(tmp_path, "actor", whole, None, WHOLE)
    assert all(torch.equal(p, full[n]) for n, p in whole.named_parameters())
