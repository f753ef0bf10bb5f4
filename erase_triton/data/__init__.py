"""Data: MovieLens-100k as a CTR task, a synthetic Criteo-shaped generator, real English text."""
from .movielens import DataError, load_movielens
from .synthetic import synthetic_criteo
from .tabular import CTRData, batches
from .text import load_text

__all__ = ["CTRData", "DataError", "batches", "load_movielens", "load_text", "synthetic_criteo"]
