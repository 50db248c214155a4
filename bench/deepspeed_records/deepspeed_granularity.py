"""Which modules real DeepSpeed 0.19.8's stage3_module_granularity_threshold makes leaf modules,
on the models of tests/support/granularity_models.py, at thresholds around every granularity
they have; written for tests/test_granularity.py to hold fz3 to:

    bench/.env/bin/python bench/deepspeed_records/deepspeed_granularity.py \
        --out tests/data/deepspeed_granularity_0.19.8.json

DeepSpeed decides this in DeepSpeedZeRoOffload.__init__ (runtime/zero/parameter_offload.py):
`_set_z3_leaf_modules_by_threshold` walks the module tree with `_get_granularity_recursively`
and `_set_leaf_by_threshold_preorder`, reading each param's `ds_numel` and marking leaves with
`set_z3_leaf_module`. Those methods are run here as DeepSpeed runs them, on a stand-in holding
the attributes they use (no engine, no process group), with `ds_numel` set to each param's numel
as zero.Init would (and the table DeepSpeed prints on rank 0 silenced: it needs a process
group). Per model: each module's granularity (by its first name), and per threshold
the leaves (their first names, in the order chosen) and the smallest granularity with its class.
"""
import argparse
import json
import os
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [ROOT, os.path.join(ROOT, "examples")]

import deepspeed  # noqa: E402
from deepspeed.runtime.zero import parameter_offload  # noqa: E402
from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload  # noqa: E402
from deepspeed.utils import z3_leaf_module  # noqa: E402

from tests.support.granularity_models import MODELS  # noqa: E402

parameter_offload.print_rank_0 = lambda *args, **kwargs: None  # its table print asks for a process group


def choose(model, threshold: int) -> dict:
    for p in model.parameters():
        p.ds_numel = p.numel()
    for m in model.modules():
        if hasattr(m, "_z3_leaf"):
            del m._z3_leaf
    me = types.SimpleNamespace(min_granularity_value=sys.maxsize, min_granularity_layer=None, granularity_info=set(),
                               z3_leaf_layers=[])
    for name in ("_get_granularity_recursively", "_set_leaf_by_threshold_preorder",
                 "_set_z3_leaf_modules_by_threshold"):
        setattr(me, name, types.MethodType(getattr(DeepSpeedZeRoOffload, name), me))
    me._set_z3_leaf_modules_by_threshold(model, threshold)
    first = {id(m): n for n, m in model.named_modules()}
    assert all(z3_leaf_module(m) for m in me.z3_leaf_layers)
    return {"threshold": threshold, "leaves": [first[id(m)] for m in me.z3_leaf_layers],
            "smallest": me.min_granularity_value, "smallest_class": me.min_granularity_layer}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(ROOT, "tests", "data", "deepspeed_granularity_0.19.8.json"))
    args = ap.parse_args()
    out = {"deepspeed": deepspeed.__version__, "models": {}}
    for name, build in MODELS.items():
        model = build()
        base = choose(model, 1)
        granularity = {n: m.ds_model_granularity for n, m in model.named_modules()}
        values = sorted({v for v in granularity.values() if v != sys.maxsize})
        thresholds = sorted({t for v in values for t in (v - 1, v, v + 1) if t > 0} | {10 ** 9})
        out["models"][name] = {"granularity": granularity, "choices": [base if t == 1 else choose(model, t)
                                                                       for t in thresholds]}
        print(name, len(values), "granularities;", len(thresholds), "thresholds")
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
