"""PEFT LoRA on a sharded frozen base (issue #50, point 5): peft.get_peft_model on a tiny
LlamaForCausalLM (adapters on q_proj and v_proj, the base frozen), trained through fz3 on 2
thread ranks against the same PEFT model on one process (each rank's half of the batch, the loss
/ 2, one SGD step a window).

    parity     every micro-step's loss and every adapter weight after the last step; the frozen
               base is unchanged
    memory     the optimizer holds state only for the adapters (SGD with momentum: one buffer
               per trained param, none for the base)
    checkpoint save_checkpoint(exclude_frozen_parameters=True) holds the adapters and their
               optimizer state only: it consolidates to the adapters, and a fresh model with the same
               base loads them back bit for bit
    export     engine.full_params yields the merged model (PEFT's merge_and_unload of the one-process
               model: its names, its values), the adapters merged per layer on the way out and the
               base left unmerged
Tested against peft 0.22.0 (the `post` extra).
"""
from __future__ import annotations

import pytest
import torch

peft = pytest.importorskip("peft")

from fz3 import launch  # noqa: E402
from gpt import markov_batch  # noqa: E402

pytestmark = pytest.mark.timeout(300)

STEPS = 3


def _model():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(1)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                        tie_word_embeddings=False, attn_implementation="eager"))
    torch.manual_seed(2)  # the adapters' B nonzero ("gaussian"), so the first step moves A too
    return get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                                           init_lora_weights="gaussian"))


def _sgd(model):
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5, momentum=0.9)


def _fz3(rank: int, world: int, path: str) -> dict:
    import fz3
    model = _model()
    engine = fz3.initialize(model, _sgd(model), fz3.Config(param_persistence_threshold=0))
    losses = []
    for i in range(STEPS):
        x, _ = markov_batch(i, batch=4, seq=12, vocab=64)
        mine = x[rank * 2:(rank + 1) * 2]
        loss = engine(input_ids=mine, labels=mine).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    trained = {id(p) for p in model.parameters() if p.requires_grad}
    state = engine.full_state_dict()
    exported = {n: t.clone() for n, t in engine.full_params(bucket_bytes=64 * 32 * 4)}
    engine.save_checkpoint(path, tag="adapters", exclude_frozen_parameters=True)
    # a fresh run: the same base (as from_pretrained would give it), new adapters; the load brings
    # the trained adapters and their optimizer state back
    again = _model()
    torch.manual_seed(9)
    for name, p in again.named_parameters():
        if "lora" in name:
            p.data.normal_()
    fresh = fz3.initialize(again, _sgd(again), fz3.Config(param_persistence_threshold=0))
    fresh.load_checkpoint(path, tag="adapters")
    return {"losses": losses, "state": state, "buffers": len(engine.optimizer.state),
            "masters_trained": sum(1 for _ in trained), "exported": exported, "after": engine.full_state_dict(),
            "reloaded": fresh.full_state_dict(), "optimizer": engine.full_optimizer_state_dict(),
            "optimizer_reloaded": fresh.full_optimizer_state_dict()}


def test_lora_on_a_sharded_frozen_base_trains_as_peft_on_one_process(tmp_path):
    outs = launch.run_threads(_fz3, 2, args=(str(tmp_path / "ckpt"),))
    model = _model()
    base = {k: v.clone() for k, v in model.state_dict().items() if "lora" not in k}
    opt = _sgd(model)
    want = []
    for i in range(STEPS):
        x, _ = markov_batch(i, batch=4, seq=12, vocab=64)
        opt.zero_grad()
        row = []
        for r in range(2):
            loss = model(input_ids=x[r * 2:(r + 1) * 2], labels=x[r * 2:(r + 1) * 2]).loss
            (loss / 2).backward()
            row.append(loss.item())
        opt.step()
        want.append(row)
    for r, o in enumerate(outs):
        torch.testing.assert_close(torch.tensor(o["losses"]), torch.tensor([w[r] for w in want]), rtol=1e-5, atol=1e-6)
        adapters = [k for k in o["state"] if "lora" in k]
        assert len(adapters) == 8
        for k, v in model.state_dict().items():
            torch.testing.assert_close(o["state"][k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}\n{m}")
            if k in base:
                assert torch.equal(o["state"][k], base[k]), k  # the frozen base never moves
        assert o["buffers"] == len(adapters) == o["masters_trained"]  # momentum for the adapters only
    # full_params: the merged model under the base model's names, the base itself left unmerged
    merged = model.merge_and_unload().state_dict()
    got = outs[0]["exported"]
    assert list(got) == list(merged), (list(got)[:4], list(merged)[:4])
    for k, v in merged.items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}\n{m}")
    assert all(torch.equal(outs[0]["after"][k], v) for k, v in outs[0]["state"].items())
    # the checkpoint of the adapters alone: a fresh model with the same base loads them bit for bit
    o = outs[0]
    assert all(torch.equal(o["reloaded"][k], v) for k, v in o["state"].items())
    assert all(torch.equal(a, b) for a, b in zip(o["optimizer_reloaded"]["state"][0].values(),
                                                 o["optimizer"]["state"][0].values()))
    from fz3.consolidate import fp32_state_dict
    kept = fp32_state_dict(str(tmp_path / "ckpt"), tag="adapters")[0]
    assert sorted(kept) == sorted(k for k in o["state"] if "lora" in k)  # the adapters alone
