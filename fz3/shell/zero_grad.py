"""The user's zero_grad() reaches fz3: the model's and the optimizer's, as well as the engine's.

    netD.zero_grad()          nn.Module.zero_grad of the engine's model     GradsZeroed, then
    optimizer.zero_grad()     the optimizer fz3.initialize bound            torch's own
    engine.zero_grad()        (surface.py)

fz3 keeps the grads of an accumulation window in its partitions, not in `.grad`, so torch's
zero_grad would clear nothing of them: the grads a GAN's generator backward leaves in the
discriminator would reach the discriminator's next step, where plain PyTorch's
`netD.zero_grad()` drops them. The two instances the engine was given get a `zero_grad` of
their own that first tells the core (GradsZeroed: [Note: zero_grad in a window],
fz3/core/grad/epilogue.py), then runs torch's. Only those two objects change, never their
classes: another model or optimizer in the process is left as it was. `restore` puts torch's
back.
"""
from __future__ import annotations

import weakref
from typing import Callable


def install(engine, objects) -> list[Callable[[], None]]:
    """Give each of `objects` (the model, the optimizer) a zero_grad that sends GradsZeroed to
    `engine` first. -> the undo of each."""
    ref = weakref.ref(engine)
    undo = []
    for obj in objects:
        if obj is None or "zero_grad" in vars(obj):
            continue  # a zero_grad of the user's own on the instance is left alone
        torch_zero_grad = obj.zero_grad  # the class's, bound

        def zero_grad(*args, _torch=torch_zero_grad, **kwargs):
            e = ref()
            if e is not None:
                e.grads_zeroed()
            return _torch(*args, **kwargs)

        zero_grad.__doc__ = torch_zero_grad.__doc__
        vars(obj)["zero_grad"] = zero_grad
        undo.append(lambda obj=obj, fn=zero_grad: vars(obj).get("zero_grad") is fn and vars(obj).pop("zero_grad"))
    return undo
