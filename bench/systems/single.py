"""Single process: the whole global batch in one rank (world_size 1), no wrapper."""
from systems.common import Plain, make_model


def build(rank: int, world: int, spec: dict) -> Plain:
    model = make_model(spec["model"])
    return Plain(model, model)
