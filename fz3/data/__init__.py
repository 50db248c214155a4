"""fz3's data plane: pure tensor functions (layout, gather, reduce, partition writes, casts).

No hidden in-place mutation of inputs, so torch.func transforms (grad, vmap, functional_call)
work through them. Interpreters call them; fz3.func states a whole ZeRO-3 step with them.
"""
