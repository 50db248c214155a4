"""`module.state_dict()` of a sharded model (fz3/shell/state_dict.py): outside
`fz3.gathered_parameters` an error naming engine.full_state_dict() and gathered_parameters, never
the empty tensors of params that are not gathered; inside, the full values, so Hugging Face's
save_pretrained writes a folder from_pretrained loads, and fails loudly outside.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from fz3 import launch

pytestmark = pytest.mark.timeout(300)


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2))


def _plain(rank: int, world: int) -> dict:
    import fz3
    model = build()
    engine = fz3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            fz3.Config(param_persistence_threshold=10))  # the LayerNorm persists
    errors = []
    try:
        model.state_dict()  # right after initialize: nothing gathered, not even persistent params
    except RuntimeError as e:
        errors.append(str(e))
    engine.backward(engine(torch.ones(3, 8)).sum())
    engine.step()
    try:
        engine.module.state_dict()  # after a step: the persistent params are whole, the rest not
    except RuntimeError as e:
        errors.append(str(e))
    with fz3.gathered_parameters(engine.module):
        inside = {k: v.clone() for k, v in engine.module.state_dict().items()}
    variables = model.state_dict(keep_vars=True)  # the Parameters themselves: names and identity
    assert all(variables[f"{i}.weight"] is model[i].weight for i in (0, 2))
    return {"errors": errors, "inside": inside, "full": engine.full_state_dict()}


def test_state_dict_outside_gathered_parameters_is_an_error_and_inside_the_full_values():
    outs = launch.run_threads(_plain, 2)
    for out in outs:
        first, after_step = out["errors"]
        assert "param '0.weight' is not gathered" in first, first
        assert "engine.full_state_dict()" in first and "fz3.gathered_parameters" in first, first
        assert "param '0.weight' is not gathered" in after_step, after_step
        assert out["inside"].keys() == out["full"].keys()
        for k, v in out["full"].items():
            assert out["inside"][k].shape == v.shape and torch.equal(out["inside"][k], v), k


def _hf(rank: int, world: int, folder: str) -> dict:
    import fz3
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    model = LlamaForCausalLM(cfg)
    engine = fz3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                            fz3.Config(param_persistence_threshold=0))  # nothing stays gathered
    ids = torch.arange(8).reshape(1, 8) % 64
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    error = None
    if rank == 0:
        try:
            model.save_pretrained(folder + "/outside")
        except RuntimeError as e:
            error = str(e)
    with fz3.gathered_parameters(model):
        if rank == 0:
            model.save_pretrained(folder + "/inside")
    return {"error": error, "full": engine.full_state_dict()}


def test_hugging_face_save_pretrained_works_inside_gathered_parameters(tmp_path):
    pytest.importorskip("transformers")
    import os
    from transformers import LlamaForCausalLM
    outs = launch.run_threads(_hf, 2, args=(str(tmp_path),))
    assert "is not gathered" in outs[0]["error"] and "fz3.gathered_parameters" in outs[0]["error"]
    assert not os.path.exists(tmp_path / "outside" / "model.safetensors")
    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "inside")
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, outs[0]["full"][k]), k
