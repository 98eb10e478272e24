"""Offloading a frozen role's weights to host memory between its calls (loomrl/runtime/offload.py)."""

import torch

from loomrl.models.tokenizer import build_char_tokenizer
from loomrl.models.zoo import build_value_model
from loomrl.parallel.pipeline import split_stages
from loomrl.runtime.offload import HostCopy


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
