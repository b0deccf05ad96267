"""Speculative decoding: drafters propose tokens, the target verifies them in one forward pass.

Drafters (prompt lookup, a draft model, Medusa heads) are interchangeable behind one seam
(spec/speculator.py) and propose a Draft, a chain or a tree of tokens; the verification rule
(spec/verify.py) keeps the model's output distribution exact whatever tokens a drafter proposes.
"""
