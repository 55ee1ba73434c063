"""The bottom layer: protocol types, block hashing, discovery, event plane and request plane.

Nothing here imports from the rest of Weir.
"""
