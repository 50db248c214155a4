"""Drive the parameter core by hand: one mutable cell around the pure transitions.

For unit tests and examples that spell out exact effect sequences:

    d = Driver([("emb.w", 100), ("l1.w", 50)], [("", [], False), ("emb", [0], False),
               ("l1", [1], False), ("head", [0], False)], config=Config(...))
    d(reset_step)                      -> []
    d(fetch, 1, forward=True)          -> [AllGather(0, (0,), False, True), Wait(0)]
    d.statuses()                       -> "AN"   (A available, I in flight, N not available)

Every call runs check_state on the new state. `Driver.forward(program)` runs a nested list of
module calls the way the shell would.
"""
from __future__ import annotations

from typing import Callable, Sequence

from fz3.config.config import Config
from fz3.core.param.fetch import fetch
from fz3.core.ids import Status
from fz3.core.param.invariants import check_state
from fz3.core.param.release import release
from fz3.core.spec import build_spec
from fz3.core.param.state import initial_state

LETTER = {Status.NOT_AVAILABLE: "N", Status.INFLIGHT: "I", Status.AVAILABLE: "A"}


class Driver:
    def __init__(self, params: Sequence[tuple[str, int]], modules: Sequence[tuple[str, Sequence[int], bool]],
                 *, config: Config, world_size: int = 1) -> None:
        self.config = config
        self.spec = build_spec(params, modules, world_size=world_size,
                               persistence_threshold=config.param_persistence_threshold)
        self.st = initial_state(self.spec)

    def __call__(self, transition: Callable, *args: object, **kwargs: object) -> list:
        """Apply a transition `f(state, *args, config=..., **kwargs) -> (state, effects)`."""
        self.st, effects = transition(self.st, *args, config=self.config, **kwargs)
        check_state(self.st)
        return list(effects)

    def forward(self, calls: Sequence, *, inputs: int = 1) -> list[list]:
        """Run nested calls `[m, [child calls...]]` or `m` in forward, as the shell reports
        them: each fetch with `inputs` (0 or 1) grad-requiring inputs wrapped, each release with
        its outputs wrapped; -> the effects of each fetch and release."""
        out: list[list] = []
        for call in calls:
            m, children = (call, []) if isinstance(call, int) else call
            out.append(self(fetch, m, forward=True, grad_inputs=inputs))
            out += self.forward(children, inputs=inputs)
            out.append(self(release, m, grad_outputs=True))
        return out

    def statuses(self) -> str:
        return "".join(LETTER[s.status] for s in self.st.params)

    @property
    def live(self) -> int:
        return self.st.live_numel
