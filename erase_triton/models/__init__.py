"""Models built from blocks and LocalHeads: the same code runs e2e, sequential and erase."""
from .mlp import MLPChain
from .transformer import TinyTransformer

__all__ = ["MLPChain", "TinyTransformer"]
