"""Drawn torch models on exact data, and the single-process training they must equal bit for bit.

The grammar (`nets()`): an optional token embedding (its call has no grad-requiring input and
saves none of its params: the core's waiting and reads-none paths), then blocks called in a
drawn order, then a head:

    Layer     a square Linear of width d (d odd or even, 1-5: padded shards)
    Branch    two Layers, relu(a(x)) + b(x): one module calling two children
    Experts   a leaf module (fz3.set_leaf_modules) of two Linear experts; a row goes to the
              first when its first feature is positive, so an expert may see no row on a rank
              (its grad is zero-filled there) and the leaf's params are reduced together
    head      Linear(d, k); tied to the embedding when k equals the vocabulary

A block may be called twice (its params reused in one pass), or never (its params get no
grad), a Layer's weight may be shared with an earlier Layer's (one Parameter in two modules),
and any param may be frozen.

Exact data: weights and inputs are small integers (-1, 0, 1), every nonlinearity is relu, the
loss is the output's sum, SGD's rate a power of two, and W x gas is 1, 2 or 4. Each rank's grads
are then integers far below 2^24, their sum over ranks and micro-steps is exact in any order, and
its one division by W x gas is exact too: so fz3 (any carrier, bucket size, prefetch or overlap)
and plain PyTorch must agree bit for bit on every loss of the window, the parameters after the
optimizer step and the loss of the next forward (which runs on the updated values; past it the
values stop being exact, and the order of a sum would show in the last bits).

The optimizer is SGD or AdamW with weight decay. AdamW's update is not exact, but it is
elementwise: on equal grads it moves each element of a shard as it moves that element of the
whole param, so the comparison stays bitwise, and it tells a param without a grad (None: not
stepped) from one with a zero grad (decayed, its moments moved): [Note: no grad, no step].
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F

LR = 2.0 ** -4
ROWS = 2  # per rank and micro-step


@dataclass(frozen=True)
class NetSpec:
    width: int
    vocab: int  # 0: no embedding (float inputs)
    blocks: tuple[str, ...]  # "layer" | "branch" | "experts"
    order: tuple[int, ...]  # the blocks' calls in forward, a block may repeat
    shared: tuple[tuple[int, int], ...]  # (later layer, earlier layer): weight shared
    head: int  # output features
    tied: bool  # head.weight is the embedding's (head == vocab)
    frozen: tuple[str, ...]  # param names with requires_grad False
    seed: int
    optimizer: str = "sgd"  # of OPTIMIZERS


class Layer(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return self.lin(x)


class Branch(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.a, self.b = Layer(d), Layer(d)

    def forward(self, x):
        return F.relu(self.a(x)) + self.b(x)


class Experts(nn.Module):
    """A leaf: two experts, each row routed by the sign of its first feature."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(2))

    def forward(self, x):
        first = x[:, 0] > 0
        out = torch.zeros_like(x)
        for e, rows in ((0, first), (1, ~first)):
            if rows.any():
                out = out.index_put((rows.nonzero()[:, 0],), self.experts[e](x[rows]))
        return out


BLOCKS = {"layer": Layer, "branch": Branch, "experts": Experts}
OPTIMIZERS = {"sgd": lambda params: torch.optim.SGD(params, lr=LR),
              "adamw": lambda params: torch.optim.AdamW(params, lr=LR, weight_decay=0.25)}


class Net(nn.Module):
    def __init__(self, spec: NetSpec) -> None:
        super().__init__()
        d = spec.width
        self.spec = spec
        self.emb = nn.Embedding(spec.vocab, d) if spec.vocab else None
        self.blocks = nn.ModuleList(BLOCKS[kind](d) for kind in spec.blocks)
        self.head = nn.Linear(d, spec.head)
        g = torch.Generator().manual_seed(spec.seed)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randint(-1, 2, p.shape, generator=g).to(p.dtype))
        for later, earlier in spec.shared:
            self.blocks[later].lin.weight = self.blocks[earlier].lin.weight
        if spec.tied:
            self.head.weight = self.emb.weight
        for name, p in self.named_parameters():
            if name in spec.frozen:
                p.requires_grad_(False)

    def forward(self, x):
        if self.emb is not None:
            x = self.emb(x)
        for i in self.spec.order:
            x = F.relu(self.blocks[i](x))
        return self.head(x)


@st.composite
def nets(draw, max_blocks: int = 3) -> NetSpec:
    d = draw(st.integers(1, 5))
    vocab = draw(st.sampled_from([0, 0, 3, 7]))
    blocks = tuple(draw(st.lists(st.sampled_from(["layer", "layer", "branch", "experts"]),
                                 min_size=1, max_size=max_blocks)))
    order = list(range(len(blocks)))
    if draw(st.booleans()):  # one block called twice
        i = draw(st.integers(0, len(blocks) - 1))
        order.insert(order.index(i) + 1, i)
    if len(blocks) > 1 and draw(st.booleans()):  # one block never called: no grad for its params
        dropped = draw(st.integers(0, len(blocks) - 1))
        order = [i for i in order if i != dropped]
    layers = [i for i, kind in enumerate(blocks) if kind == "layer"]
    shared = ()
    if len(layers) >= 2 and draw(st.booleans()):
        shared = ((layers[-1], layers[0]),)
    head = draw(st.sampled_from([1, 2, 3] + ([vocab] if vocab else [])))
    tied = bool(vocab) and head == vocab and draw(st.booleans())
    names = [n for n, _ in Net(NetSpec(d, vocab, blocks, tuple(order), shared, head, tied, (), 0))
             .named_parameters()]
    # not inside a leaf of experts: a frozen expert makes whether the leaf's call needs grad depend
    # on the rows each rank routes, so ranks could diverge (test_interpreters_differential.py,
    # [Note: a leaf whose call needs no grad])
    names = [n for n in names if ".experts." not in n]
    frozen = tuple(sorted(draw(st.sets(st.sampled_from(names), max_size=2)))) if names and draw(st.booleans()) else ()
    return NetSpec(d, vocab, blocks, tuple(order), shared, head, tied, frozen, draw(st.integers(0, 1000)),
                   draw(st.sampled_from(sorted(OPTIMIZERS))))


SIZES = st.sampled_from([0, 1, 7, 30, 10**9])


@st.composite
def setups(draw, stages: tuple[int, ...] = (3, 3, 2, 1, 0)) -> tuple[int, dict, dict]:
    """(world size, Config fields, Options fields), with W x gas in {1, 2, 4} (exact division), at
    a ZeRO stage of `stages`: the same exact data give the same bits at stages 0-3. The engine's
    teeth (property_tests/test_engine_teeth.py) hunt at stage 3 alone, where params are freed."""
    world, gas = draw(st.sampled_from([(1, 1), (1, 2), (2, 1), (2, 2), (4, 1)]))
    contiguous = draw(st.booleans())
    config = dict(param_persistence_threshold=draw(st.sampled_from([0, 5, 10**5])),
                  prefetch_bucket_size=draw(SIZES), max_live_parameters=draw(st.sampled_from([0, 20, 10**9])),
                  max_reuse_distance=draw(SIZES), reduce_bucket_size=draw(st.sampled_from([1, 16, 100, 10**9])),
                  overlap_comm=draw(st.booleans()), gradient_accumulation_steps=gas,
                  contiguous_gradients=contiguous, reduce_scatter=not contiguous or draw(st.booleans()),
                  stage=draw(st.sampled_from(stages)))  # every stage the same bits (stage.py)
    carriers = st.sampled_from(["p2p", "all_reduce", "native"])
    options = dict(gloo_all_gather=draw(carriers), gloo_reduce_scatter=draw(carriers))
    return world, config, options


def batch(spec: NetSpec, step: int, world: int) -> torch.Tensor:
    """The global batch of micro-step `step`: ROWS rows per rank, small integers (or token ids)."""
    g = torch.Generator().manual_seed(10_000 + step)
    if spec.vocab:
        return torch.randint(0, spec.vocab, (ROWS * world,), generator=g)
    return torch.randint(-1, 2, (ROWS * world, spec.width), generator=g).float()


def rank_rows(x: torch.Tensor, rank: int) -> torch.Tensor:
    return x[ROWS * rank:ROWS * (rank + 1)]


def leaf_classes(spec: NetSpec) -> list[type]:
    return [Experts] if "experts" in spec.blocks else []


def train_rank(rank: int, world: int, spec: NetSpec, config: dict, options: dict | None = None) -> dict:
    """One rank's run under fz3 (a process rank or a thread rank): one accumulation window, the
    optimizer step, then one more forward. -> losses (the window's), state (fp32, full), after."""
    import fz3
    net = Net(spec)
    if leaf_classes(spec):
        fz3.set_leaf_modules(net, leaf_classes(spec))
    engine = fz3.initialize(net, OPTIMIZERS[spec.optimizer](net.parameters()), fz3.Config(**config),
                            options=fz3.Options(**(options or {})))
    gas, losses = config.get("gradient_accumulation_steps", 1), []
    for i in range(gas):
        loss = engine(rank_rows(batch(spec, i, world), rank)).sum()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    state = engine.full_state_dict()
    with torch.no_grad():
        after = engine(rank_rows(batch(spec, gas, world), rank)).sum().item()
    return {"losses": losses, "state": state, "after": after}


def reference(spec: NetSpec, world: int, gas: int) -> dict:
    """The same in one process: every rank's rows in turn, grads summed by autograd, divided once
    by W x gas, one optimizer step. -> losses[micro-step][rank], state, after[rank]."""
    net = Net(spec)
    params = [p for p in net.parameters() if p.requires_grad]
    losses = []
    for i in range(gas):
        x = batch(spec, i, world)
        row = []
        for r in range(world):
            loss = net(rank_rows(x, r)).sum()
            loss.backward()
            row.append(loss.item())
        losses.append(row)
    for p in params:
        if p.grad is not None:
            p.grad /= world * gas
    OPTIMIZERS[spec.optimizer](params).step()
    with torch.no_grad():
        x = batch(spec, gas, world)
        after = [net(rank_rows(x, r)).sum().item() for r in range(world)]
    return {"losses": losses, "state": net.state_dict(), "after": after}


def assert_bitwise(outs: list[dict], ref: dict) -> None:
    """Every rank's losses and next forward, and rank 0's consolidated state, equal the reference's
    exactly (state: torch.equal, names as the model's state_dict)."""
    for r, out in enumerate(outs):
        want = [step[r] for step in ref["losses"]]
        assert out["losses"] == want, f"rank {r}: losses {out['losses']} != {want}"
        assert out["after"] == ref["after"][r], f"rank {r}: next forward {out['after']} != {ref['after'][r]}"
    state = outs[0]["state"]
    assert state.keys() == ref["state"].keys(), (sorted(state), sorted(ref["state"]))
    for name, want in ref["state"].items():
        got = state[name]
        assert got.dtype == want.dtype and torch.equal(got, want), \
            f"{name}: max |diff| {(got.double() - want.double()).abs().max().item()}\n got {got}\nwant {want}"


def check_on_threads(spec: NetSpec, world: int, config: dict, options: dict | None = None) -> None:
    """fz3 on `world` thread ranks equals the reference bit for bit (AssertionError if not)."""
    from fz3 import launch
    outs = launch.run_threads(train_rank, world, args=(spec, config, options), timeout_s=120)
    assert_bitwise(outs, reference(spec, world, config.get("gradient_accumulation_steps", 1)))
