"""CTR data container and a seeded mini-batch iterator."""
from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class CTRData:
    """dense float [N, n_dense], sparse long [N, n_sparse] (field-local ids), label float [N]."""

    dense: torch.Tensor
    sparse: torch.Tensor
    label: torch.Tensor
    cardinalities: list[int]

    def __len__(self) -> int:
        return self.label.shape[0]

    def slice(self, idx) -> "CTRData":
        return CTRData(self.dense[idx], self.sparse[idx], self.label[idx], self.cardinalities)

    def to(self, device) -> "CTRData":
        return CTRData(self.dense.to(device), self.sparse.to(device), self.label.to(device), self.cardinalities)


def batches(data: CTRData, batch_size: int, generator: torch.Generator, drop_last: bool = True):
    """Endless shuffled epochs of (dense, sparse, label) mini-batches."""
    n = len(data)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if batch_size > n:
        raise ValueError(f"batch_size ({batch_size}) is larger than the data ({n} rows)")
    while True:
        perm = torch.randperm(n, generator=generator)
        stop = n - batch_size + 1 if drop_last else n
        for i in range(0, stop, batch_size):
            idx = perm[i:i + batch_size].to(data.label.device)
            yield data.dense[idx], data.sparse[idx], data.label[idx]
