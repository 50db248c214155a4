"""fz3.Init: models built already sharded (issue #11).

    python -m pytest tests/test_init.py -rA

One fz3.launch.run per world size (2, 3) runs every case in the same ranks:

    gpt       nanoGPT's GPT (custom init over named_parameters after the blocks are built, tied
              embedding): the params equal an unsharded build under the same seed, bit for
              bit; two training steps equal an engine built from the unsharded model
    seeds     every rank seeded differently: the params are rank 0's unsharded build
    habits    what real constructors do: a subclass changing its parent's weight after
              super().__init__ (through .data), view writes (`w[0].zero_()`), read-modify-write
              (`mul_`), copy.deepcopy of a built block, a class defined inside the block,
              model.apply(fn) and a new param after construction (still inside the block), a
              tied param, 0-d and tiny params, a frozen param, a bf16 module; equal to the same
              code run without Init
    memory    8 blocks, each param re-initialized by the parent (OPEN_BYTES = 0): the bytes of
              full params alive never exceed one block plus one param (the whole model without
              Init); a head whose weight is replaced to tie it is never sharded
    hf        LlamaForCausalLM(config) (Hugging Face's post_init) equals the unsharded build
    errors    built for another group; cast outside the block (model.double()); classes
              unwrapped after the block; a write to a placeholder outside the block fails
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from fz3 import launch

pytestmark = pytest.mark.timeout(300)
EXACT = dict(rtol=0, atol=0)


class ScaledLinear(nn.Linear):
    """Changes its parent's weight after super().__init__, and adds a param of its own."""

    def __init__(self, n: int, m: int) -> None:
        super().__init__(n, m)
        self.weight.data.mul_(0.5)
        self.gain = nn.Parameter(torch.randn(m))


class Habits(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(13, 6)
        with torch.no_grad():
            self.emb.weight[0].zero_()  # a view write to a built child's param
        self.lin = ScaledLinear(6, 7)
        self.blocks = nn.ModuleList([nn.Linear(7, 7)])
        self.blocks.append(copy.deepcopy(self.blocks[0]))
        with torch.no_grad():
            self.blocks[1].weight.mul_(2)  # read-modify-write
        self.head = nn.Linear(6, 13, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.scale = nn.Parameter(torch.tensor(1.5))  # 0-d
        self.tiny = nn.Parameter(torch.randn(2))  # fewer elements than ranks at W = 3
        self.frozen = nn.Parameter(torch.randn(5, 3), requires_grad=False)
        self.low = nn.Linear(3, 4).to(torch.bfloat16)
        self.lin.weight.data.normal_(0, 0.1)  # through .data, after the child was built


class TiedHead(nn.Module):
    """A head built, then its weight replaced by the embedding's (GPT-2, Hugging Face's tying)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(13, 6)
        self.head = nn.Linear(6, 13, bias=False)
        self.head.weight = self.emb.weight


def _closes_building_tied_head() -> int:
    """How many params fz3.Init shards while TiedHead is built: 1 (the dropped head weight,
    closed only late, dies full: [Note: the last module built is closed late])."""
    import fz3
    import fz3.build.init as init_mod
    count, close = [0], init_mod.Init.close

    def counting(self, p):
        count[0] += 1
        close(self, p)

    init_mod.Init.close = counting
    try:
        with fz3.Init():
            TiedHead()
    finally:
        init_mod.Init.close = close
    return count[0]


def _build_habits() -> nn.Module:
    class Inner(nn.Module):  # defined while the block runs: wrapped through __init_subclass__
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 3))

    model = Habits()
    model.inner = Inner()

    def fn(m: nn.Module) -> None:
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.uniform_(m.bias, -0.1, 0.1)

    model.apply(fn)
    model.late = nn.Parameter(torch.randn(3, 3))
    return model


class Stack(nn.Module):
    """8 blocks of 4 x 64 KiB; the parent re-initializes every param (nanoGPT style)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(128, 128), nn.Linear(128, 128)) for _ in range(8))
        for p in self.parameters():
            nn.init.normal_(p, std=0.02)


def _full_bytes(params: list[nn.Parameter]) -> int:
    """Bytes of the distinct storages of `params` (a placeholder's storage is one element)."""
    seen = {}
    for p in params:
        st = p.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _memory_case() -> dict:
    import fz3
    import fz3.build.init as init_mod
    params: list[nn.Parameter] = []
    peak = [0]

    def on_param(module, name, param):  # at every registration: bytes of full params alive
        if param is not None:
            params.append(param)
        with init_mod._ACTIVE[0].quiet() if init_mod._ACTIVE else torch.no_grad():
            peak[0] = max(peak[0], _full_bytes(params))

    handle = torch.nn.modules.module.register_module_parameter_registration_hook(on_param)
    saved, init_mod.OPEN_BYTES = init_mod.OPEN_BYTES, 0
    try:
        with fz3.Init():
            model = Stack()
        after = _full_bytes(params)
    finally:
        handle.remove()
        init_mod.OPEN_BYTES = saved
    block = sum(p.numel() * 4 for p in model.blocks[0].parameters())
    whole = sum(p.numel() * 4 for p in model.parameters())
    return {"peak": peak[0], "after": after, "block": block, "param": 128 * 128 * 4, "whole": whole}


def _error(fn) -> str:
    """The RuntimeError fn raises, or 'no error'."""
    try:
        fn()
    except RuntimeError as e:
        return str(e)
    return "no error"


def _compare(model_init: nn.Module, reference: nn.Module) -> list[str]:
    """Names whose values or dtypes differ, after fz3.initialize on the Init-built model."""
    import fz3
    engine = fz3.initialize(model_init, torch.optim.SGD(model_init.parameters(), lr=0.1), fz3.Config())
    full = engine.full_state_dict()
    return [k for k, v in reference.state_dict().items()
            if k not in full or full[k].dtype != torch.float32 or not torch.equal(full[k], v.float())]


def _train(engine, steps: int, rank: int, world: int) -> tuple[list[float], dict]:
    from gpt import loss_fn, markov_batch
    losses = []
    for i in range(steps):
        x, y = markov_batch(i, batch=6, seq=8, vocab=64)
        per = 6 // world
        loss = loss_fn(engine(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, engine.full_state_dict()


def _cases(rank: int, world: int) -> dict:
    import torch.distributed as dist

    import fz3
    from gpt import GPT, GPTConfig
    out = {}
    cfg = GPTConfig(vocab=64, d_model=32, n_head=4, n_layer=2, seq=8)

    # gpt: equal values, equal training
    torch.manual_seed(0)
    reference = GPT(cfg)
    torch.manual_seed(0)
    with fz3.Init():
        model = GPT(cfg)
    out["gpt_placeholder"] = [tuple(p.stride()) for p in model.parameters() if p.dim() == 2][:1]
    out["gpt_numel"] = (sum(p.numel() for p in model.parameters()), sum(p.numel() for p in reference.parameters()))
    engine = fz3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), fz3.Config())
    out["gpt_differ"] = [k for k, v in reference.state_dict().items()
                         if not torch.equal(engine.full_state_dict()[k], v)]
    plain = fz3.initialize(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2), fz3.Config())
    (l1, p1), (l2, p2) = _train(engine, 2, rank, world), _train(plain, 2, rank, world)
    out["gpt_train"] = (l1 == l2, [k for k in p1 if not torch.equal(p1[k], p2[k])])

    # seeds: rank 0's values win
    torch.manual_seed(100)
    reference = GPT(cfg)
    torch.manual_seed(100 + rank)
    with fz3.Init():
        model = GPT(cfg)
    out["seeds_differ"] = _compare(model, reference)

    # habits
    torch.manual_seed(1)
    reference = _build_habits()
    torch.manual_seed(1)
    with fz3.Init():
        model = _build_habits()
    out["habits_low_dtype"] = str(model.low.weight.dtype)
    out["habits_differ"] = _compare(model, reference)

    out["memory"] = _memory_case()
    out["tied_closes"] = _closes_building_tied_head()

    # hf
    from transformers import LlamaConfig, LlamaForCausalLM
    hf_cfg = LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    torch.manual_seed(2)
    reference = LlamaForCausalLM(hf_cfg)
    torch.manual_seed(2)
    with fz3.Init():
        model = LlamaForCausalLM(hf_cfg)
    out["hf_differ"] = _compare(model, reference)

    # errors
    def initialize(model):
        return lambda: fz3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), fz3.Config())

    errors = {}
    groups = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    with fz3.Init(group=groups[rank]):
        model = nn.Linear(4, 4)
    errors["group"] = _error(initialize(model))
    with fz3.Init():
        model = nn.Linear(4, 4)
    model.double()
    errors["cast"] = _error(initialize(model))
    with fz3.Init():
        model = nn.Linear(4, 4)
    errors["write"] = _error(lambda: nn.init.normal_(model.weight))
    errors["unwrapped"] = (nn.Linear.__init__.__qualname__, "__init_subclass__" in nn.Module.__dict__,
                           hasattr(nn.Linear.__init__, "__wrapped__"))
    out["errors"] = errors
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=["W2", "W3"])
def results(request):
    return request.param, launch.run(_cases, world_size=request.param, timeout=280)


def test_gpt_equals_unsharded_build_and_trains_the_same(results):
    world, outs = results
    for rank, out in enumerate(outs):
        assert out["gpt_placeholder"] == [(0, 0)], f"rank {rank}: a built param is not a placeholder"
        assert out["gpt_numel"][0] == out["gpt_numel"][1], "shapes are kept"
        assert out["gpt_differ"] == [], f"rank {rank}: {out['gpt_differ']}"
        same_losses, differ = out["gpt_train"]
        assert same_losses and differ == [], f"rank {rank}: training differs {differ}"


def test_ranks_seeded_differently_get_rank0s_values(results):
    for rank, out in enumerate(results[1]):
        assert out["seeds_differ"] == [], f"rank {rank}: {out['seeds_differ']}"


def test_constructor_habits_equal_the_same_code_without_init(results):
    for rank, out in enumerate(results[1]):
        assert out["habits_differ"] == [], f"rank {rank}: {out['habits_differ']}"
        assert out["habits_low_dtype"] == "torch.bfloat16"


def test_construction_never_holds_more_than_a_block(results):
    for rank, out in enumerate(results[1]):
        m = out["memory"]
        assert m["peak"] <= m["block"] + m["param"] + 4096, f"rank {rank}: {m}"
        assert m["peak"] < m["whole"] / 2, f"rank {rank}: {m}"
        assert m["after"] < 4096, f"rank {rank}: full params left after the block {m}"
        assert out["tied_closes"] == 1, f"rank {rank}: the dropped head weight was sharded too"


def test_hugging_face_llama_equals_unsharded_build(results):
    for rank, out in enumerate(results[1]):
        assert out["hf_differ"] == [], f"rank {rank}: {out['hf_differ']}"


def test_misuse_is_an_error(results):
    world, outs = results
    for rank, out in enumerate(outs):
        e = out["errors"]
        assert f"rank 0 of 1, but fz3.initialize runs rank {rank} of {world}" in e["group"], e
        assert "'weight'" in e["cast"] and "outside the Init block" in e["cast"], e
        assert "single memory location" in e["write"] or "overlap" in e["write"], e
        assert e["unwrapped"] == ("Linear.__init__", False, False), e


def test_init_needs_a_process_group():
    import fz3
    with pytest.raises(RuntimeError, match="torch.distributed initialised first"):
        with fz3.Init():
            nn.Linear(2, 2)
    assert not hasattr(nn.Linear.__init__, "__wrapped__")


def test_disabled_init_does_nothing():
    import fz3
    with fz3.Init(enabled=False):
        lin = nn.Linear(2, 2)
    assert lin.weight.stride() == (2, 1)


# ---- the meta-device path ------------------------------------------------------------------------

class Plain(nn.Module):
    """Modules whose default init is all there is (reset_parameters), a tied head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 8))
        self.head = nn.Linear(8, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(self.body(self.emb(x)))


def _meta(rank: int, world: int) -> dict:
    import fz3
    out = {}
    with torch.device("meta"):
        model = Plain()
    params_before = [id(p) for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(5)
    engine = fz3.initialize(model, opt, fz3.Config())
    out["same_objects"] = params_before == [id(p) for p in model.parameters()]
    out["tied"] = model.head.weight is model.emb.weight
    ref = Plain()  # the reference: each module's reset_parameters, in module order, same seed
    torch.manual_seed(5)
    for m in ref.modules():
        if m is not ref.head and hasattr(m, "reset_parameters") and list(m.parameters(recurse=False)):
            m.reset_parameters()
    out["differ"] = [k for k, v in ref.state_dict().items() if not torch.equal(engine.full_state_dict()[k], v)]
    x = torch.randint(11, (4, 3))
    loss = engine(x[rank * 2:(rank + 1) * 2]).square().mean()
    engine.backward(loss)
    engine.step()
    out["trained"] = bool(torch.isfinite(loss))
    errors = {}
    for case in ("buffer", "no_reset"):
        with torch.device("meta"):
            bad = nn.Sequential(nn.Linear(2, 2))
            if case == "buffer":
                bad.register_buffer("mask", torch.ones(3))
            else:
                bad.extra = nn.Parameter(torch.ones(3))
        errors[case] = _error(lambda: fz3.initialize(bad, torch.optim.SGD(bad.parameters(), lr=0.1), fz3.Config()))
    out["errors"] = errors
    return out


def test_meta_device_model_materializes_module_by_module():
    for rank, out in enumerate(launch.run(_meta, world_size=2, timeout=120)):
        assert out["same_objects"] and out["tied"], out
        assert out["differ"] == [], f"rank {rank}: {out['differ']}"
        assert out["trained"]
        assert "'mask' is on the meta device" in out["errors"]["buffer"], out["errors"]
        assert "'extra'" in out["errors"]["no_reset"] and "Sequential" in out["errors"]["no_reset"], out["errors"]
