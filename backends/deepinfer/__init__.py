"""DeepInfer: Weir's bundled token engine.

The scheduler, block manager and sequence modules never import torch, so the mocker and
the router's replay can reuse them on machines without it.
"""
