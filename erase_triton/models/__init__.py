"""Models built from blocks and LocalHeads: the same code runs e2e, sequential and erase."""
from .ctr import CTRConfig, CTRModel
from .mlp import MLPChain
from .transformer import TinyTransformer

__all__ = ["CTRConfig", "CTRModel", "MLPChain", "TinyTransformer"]
