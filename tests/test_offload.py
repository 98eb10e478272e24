"""Offloading a frozen role's weights to host memory between its calls (loomrl/runtime/offload.py)."""

import torch

from loomrl.models.tokenizer import build_char_tokenizer
from loomrl.models.zoo import build_value_model
from loomrl.parallel.pipeline import split_stages
from loomrl.runtime.offload import HostCopy, bind_view, release_storage


def test_release_frees_the_device_copy_and_restore_brings_the_same_weights_back():
    model = build_value_model("llama-1m", build_char_tokenizer(), seed=0).eval()
    ids = torch.randint(3, 20, (2, 7))
    with torch.no_grad():
        before = model(input_ids=ids).logits
    params = {name: p for name, p in model.named_parameters()}
    copy = HostCopy(model)
    full = copy.device_bytes()
    assert full == sum(p.numel() * p.element_size() for p in model.parameters())
    copy.release()
    assert copy.device_bytes() == 0 and not copy.resident
    copy.restore()
    copy.restore()  # resident already: nothing happens
    assert copy.device_bytes() == full
    assert all(p is params[name] for name, p in model.named_parameters())  # the same tensors, refilled
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, before)


def test_a_pipeline_stage_offloads_only_what_it_holds():
    model = build_value_model("llama-1m", build_char_tokenizer(), seed=0)
    stage = split_stages(model, 1, 2)
    copy = HostCopy(stage.model)
    assert set(copy.host) == {name for name, _ in stage.model.named_parameters()}
    assert not any(name.startswith("model.layers.0.") for name in copy.host)
    copy.release()
    copy.restore()
    assert all(torch.equal(p.detach(), copy.host[name]) for name, p in stage.model.named_parameters())


def test_a_copy_bound_to_views_of_the_training_weights_is_released_without_freeing_them():
    """A reallocated copy whose shards are spans of the training shards holds views of them (bind_view);
    releasing it points those parameters at placeholders (shape kept) and never frees the training weights."""
    tok = build_char_tokenizer()
    train, copy = build_value_model("llama-1m", tok, seed=0).eval(), build_value_model("llama-1m", tok, seed=1).eval()
    ids = torch.randint(3, 20, (2, 7))
    with torch.no_grad():
        want = train(input_ids=ids).logits
    params = dict(copy.named_parameters())
    shapes = {name: p.shape for name, p in params.items()}
    flat = {name: p.detach().reshape(-1) for name, p in train.named_parameters()}
    for name, p in params.items():
        bind_view(p, flat[name].view(p.shape))
    with torch.no_grad():
        assert torch.equal(copy(input_ids=ids).logits, want)
    release_storage(copy, views=frozenset(params))
    assert all(
        p is params[n] and p.shape == shapes[n] and p.untyped_storage().nbytes() <= p.element_size()
        for n, p in copy.named_parameters()
    )
    with torch.no_grad():  # the training weights are untouched, and a copy can be bound again
        assert torch.equal(train(input_ids=ids).logits, want)
        for name, p in params.items():
            bind_view(p, flat[name].view(p.shape))
        assert torch.equal(copy(input_ids=ids).logits, want)


def _bind_a_dtensor_parameter(rank: int) -> bool:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    param = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 3), mesh, [Replicate()]))
    source = torch.arange(24, dtype=torch.float32)
    bind_view(param, source[12:].view(4, 3))  # the DTensor's own local tensor now views the source
    ok = torch.equal(param.full_tensor().detach(), source[12:].view(4, 3))
    model = torch.nn.Module()
    model.weight = param
    release_storage(model, views=frozenset({"weight"}))
    return ok and param.shape == (4, 3) and torch.equal(source, torch.arange(24, dtype=torch.float32))


def test_bind_view_points_a_dtensors_local_shard_at_the_view():
    from loomrl.parallel.spawn import run_world

    assert run_world(_bind_a_dtensor_parameter, 1, timeout_s=120) == [True]


def test_a_trained_roles_state_leaves_and_returns_and_training_goes_on_as_if_it_never_left():
    """A trained role offloaded during generation (TrainingState): weights, gradients and Adam's moments are
    copied to the host and freed, then restored; the next optimizer step matches a model that never moved."""
    from loomrl.runtime.offload import TrainingState

    tok = build_char_tokenizer()
    models = [build_value_model("llama-1m", tok, seed=0) for _ in range(2)]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    ids = torch.randint(3, 20, (2, 7))

    def step(model, opt):
        opt.zero_grad()
        model(input_ids=ids).logits.float().pow(2).mean().backward()
        opt.step()

    for model, opt in zip(models, opts):
        step(model, opt)  # the optimizer now holds its moments
    moved = TrainingState(models[1], opts[1])
    full = moved.device_bytes()
    moments = sum(t.numel() * t.element_size() for s in opts[1].state.values() for t in s.values() if t.dim())
    assert full >= sum(p.numel() * p.element_size() for p in models[1].parameters()) + moments
    moved.release()
    assert moved.device_bytes() == 0 and not moved.resident
    moved.release()  # offloaded already: nothing happens
    moved.restore()
    assert moved.device_bytes() == full and moved.resident
    for model, opt in zip(models, opts):
        step(model, opt)
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters()):
        assert torch.equal(a, b), name
