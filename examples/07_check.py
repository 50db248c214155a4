"""07: check your own model before you train it with ZeRO-3: fz3.check (python -m fz3 check).

fz3.check trains the model under configs drawn around yours on 1, 2 and 3 ranks that are threads
of this process (the real engine: fz3.initialize, hooks, core, collectives) and, beside them, in
one process doing the same arithmetic, and compares every loss, every param after every step
and the buffers; it watches the live budget (I1) and the counters (I2), runs each example twice
(determinism) and compares the ranks' effect streams (divergence). A failure is shrunk to the
smallest config that still fails, printed as fz3.Config(...) to paste.

The model (`Net`) has what ZeRO-3 must get right:

  - a tied weight: the output head is the token embedding (one Parameter in two modules);
  - a returned param: `Gate.forward` returns its weight and the caller multiplies by it;
  - a data-dependent branch: `Router` sends each row to one of two experts by the sign of its
    first feature, so a rank may run one expert and not the other. Marked a leaf module
    (fz3.set_leaf_modules), it is one fetch unit every rank gathers and reduces whole.

1. fz3.check(build): passes on every example, bit for bit on 1 and 2 ranks.
2. The same model with the head tied by hand: it keeps the embedding's weight in a list and
   reads it from there, where fz3's hooks cannot see the read. While the weight is persistent
   (numel <= param_persistence_threshold: your config) it is always gathered and nothing shows;
   a drawn config that lets it be released fails, and the check names the param and shrinks the
   config to the one field that matters.

    python examples/07_check.py
    python -m fz3 check examples/07_check.py:build              # step 1 as a command: exit 0
    python -m fz3 check examples/07_check.py:build_tied_by_hand # step 2: exit 1
"""
import torch
from torch import nn
from torch.nn import functional as F

import fz3

VOCAB, D = 16, 8


class Gate(nn.Module):
    """Returns its param: the caller computes with it (fz3 registers it as the caller's)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, D))

    def forward(self) -> torch.Tensor:
        return self.weight


class Router(nn.Module):
    """Two experts; each row goes to one, by the sign of its first feature."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(D, D) for _ in range(2))

    def forward(self, x):  # (N, D)
        first = x[:, 0] > 0
        out = torch.zeros_like(x)
        for e, rows in ((0, first), (1, ~first)):
            if rows.any():  # the branch: which experts run depends on the data
                out = out.index_put((rows.nonzero()[:, 0],), self.experts[e](x[rows]))
        return out


class Net(nn.Module):
    def __init__(self, tied_by_hand: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, D)
        self.gate = Gate()
        self.router = Router()
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied: one Parameter
        self.tied_by_hand = [self.emb.weight] if tied_by_hand else None  # a list: not registered twice

    def forward(self, ids):  # (B, T)
        h = self.emb(ids)  # (B, T, D)
        h = h + self.router(h.reshape(-1, D)).reshape(h.shape)
        h = torch.tanh(h) * self.gate()
        if self.tied_by_hand is not None:
            return F.linear(h, self.tied_by_hand[0])  # (B, T, VOCAB), read past fz3's hooks
        return self.head(h)  # (B, T, VOCAB)


def loss_fn(model, ids):
    """Next-token cross entropy of a (B, T + 1) batch of token ids."""
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def batches():
    """Four global micro-batches of 6 sequences: 6 rows divide among 1, 2 and 3 ranks."""
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (6, 9), generator=g) for _ in range(4)]


def build():
    """fz3.check's build(): (model, example_batches, loss_fn)."""
    model = Net()
    fz3.set_leaf_modules(model, [Router])
    return model, batches(), loss_fn


def build_tied_by_hand():
    model = Net(tied_by_hand=True)
    fz3.set_leaf_modules(model, [Router])
    return model, batches(), loss_fn


if __name__ == "__main__":
    print("1. the model as written: tied head, returned param, routed experts in a leaf")
    report = fz3.check(build)
    print(report.summary())
    assert report.ok
    print("\n2. the head tied by hand, through a list")
    report = fz3.check(build_tied_by_hand)
    print(report.summary())
    shrunk = next(r.shrunk.example for r in report.results if r.shrunk is not None)
    print(f"\nthe smallest failing example: {shrunk.world_size} rank(s), {shrunk.steps} step(s), "
          f"{fz3.checking.draw.config_source(shrunk.config)}")
