"""Speculative decoding: drafters propose tokens, the target verifies them in one forward pass.

Drafters (prompt lookup, a draft model, Medusa heads) are interchangeable behind one seam; the
verification rule keeps the target's output distribution exact whatever the drafter proposes.
"""
