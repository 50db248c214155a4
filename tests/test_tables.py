"""fz3/shell/tables.py: fetch units read off an nn.Module, leaf modules named by the config
(DeepSpeed's zero_optimization.leaf_module) and the persistence caps."""
from __future__ import annotations

import pytest
from torch import nn

from fz3.config.config import Config
from fz3.shell.tables import read_tables


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(4, 4)
        self.mlp = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.h = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(4, 2)


# A stand-in for a Hugging Face MoE block that DeepSpeed 0.19 makes a leaf by default
MixtralSparseMoeBlock = type("MixtralSparseMoeBlock", (Block,),
                             {"__module__": "transformers.models.mixtral.modeling_mixtral"})


def leaves(model: nn.Module, **cfg) -> dict[str, int]:
    """Leaf module name -> numel of its fetch unit."""
    spec = read_tables(model, world_size=2, config=Config(**cfg)).spec
    return {m.name: m.numel for m in spec.modules if m.is_leaf}


BLOCK = 4 * 4 + 4 + 4 * 8 + 8 + 8 * 4 + 4  # every param of a Block's subtree
MLP = 4 * 8 + 8 + 8 * 4 + 4


@pytest.mark.parametrize("cfg, expected", [
    ({}, {}),  # DeepSpeed's default classes are absent: no leaf, no error
    (dict(leaf_module_classes=("Block",)), {"h.0": BLOCK, "h.1": BLOCK}),  # bare class name
    (dict(leaf_module_classes=(f"{__name__}.Block",)), {"h.0": BLOCK, "h.1": BLOCK}),  # qualified
    (dict(leaf_module_names=("h.1",)), {"h.1": BLOCK}),
    (dict(leaf_module_name_suffixes=("mlp",)), {"h.0.mlp": MLP, "h.1.mlp": MLP}),
    (dict(leaf_module_names=("h.0",), leaf_module_name_suffixes=("1.mlp",)),
     {"h.0": BLOCK, "h.1.mlp": MLP}),
])
def test_config_names_leaf_modules(cfg, expected):
    assert leaves(Net(), **cfg) == expected


def test_deepspeed_default_classes_apply():
    """A model with a block DeepSpeed lists by default gets it as a leaf without any config."""
    net = Net()
    net.h[1] = MixtralSparseMoeBlock()
    assert leaves(net) == {"h.1": BLOCK}
    assert leaves(net, leaf_module_classes=()) == {}  # an explicit list replaces the default


@pytest.mark.parametrize("cfg, entry, has", [
    (dict(leaf_module_classes=("Blok",)), "'Blok'", "'Block', 'Linear', 'ModuleList', 'Net'"),
    (dict(leaf_module_classes=("other.module.Block",)), "'other.module.Block'", "'Block'"),
    (dict(leaf_module_names=("h.2",)), "'h.2'", "'h', 'h.0', 'h.0.attn'"),
    (dict(leaf_module_name_suffixes=("ffn",)), "'ffn'", "'h.1.mlp.1', 'head'"),
])
def test_an_entry_that_matches_nothing_is_an_error(cfg, entry, has):
    (field, _), = cfg.items()
    with pytest.raises(ValueError) as err:
        leaves(Net(), **cfg)
    message = str(err.value)
    assert f"Config.{field}" in message and entry in message and has in message, message


def test_config_leaves_hold_for_that_config_only():
    net = Net()
    assert leaves(net, leaf_module_names=("h.0",)) == {"h.0": BLOCK}
    assert leaves(net) == {}  # nothing was marked on the model


SMALL = [("h.0.attn.bias", 4), ("h.0.mlp.0.bias", 8), ("h.0.mlp.1.bias", 4), ("h.1.attn.bias", 4),
         ("h.1.mlp.0.bias", 8), ("h.1.mlp.1.bias", 4), ("head.weight", 8), ("head.bias", 2)]


@pytest.mark.parametrize("cap, persistent", [
    (None, SMALL),  # DeepSpeed's default (sys.maxsize): every param of numel <= 8
    (14, SMALL[:2] + SMALL[-1:]),  # 4 + 8 = 12; each next one overflows 14 and is skipped, but
                                   # the last (2) fits again: DeepSpeed skips, it does not stop
    (3, SMALL[-1:]),
    (0, []),
])
def test_model_persistence_threshold_caps_the_persistent_total(cap, persistent):
    """The params of numel <= 8 in parameter order, kept while their total stays <= the cap.
    DeepSpeed: DeepSpeedZeRoOffload.mark_persistent_parameters."""
    cfg = Config(param_persistence_threshold=8,
                 **({} if cap is None else dict(model_persistence_threshold=cap)))
    spec = read_tables(Net(), world_size=2, config=cfg).spec
    assert [(p.name, p.numel) for p in spec.params if p.persistent] == persistent
