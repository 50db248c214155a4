"""Prototypes: ideas tried against fz3's real engine and measured, not part of the public API.

    prototype.whole_step   one whole training step compiled as one graph (issue #25 point 5)
"""
