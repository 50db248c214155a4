"""The parameter half of the control plane: a param's NOT_AVAILABLE -> INFLIGHT -> AVAILABLE ->
NOT_AVAILABLE cycle, read in this order: state (the rows and the three primitive moves), fetch,
release, backward (the backward counts and external params), step (pass and step ends), trace
(the recorded order that drives prefetch), hold (gathered_parameters), invariants (I1, I2)."""
