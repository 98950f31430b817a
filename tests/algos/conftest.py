import pytest
import torch


def pad(rows: list[list[float]], width: int | None = None, fill: float = 0.0):
    """Ragged rows -> (padded float64 [B, T], bool mask [B, T])."""
    width = width or max(len(r) for r in rows)
    x = torch.full((len(rows), width), fill, dtype=torch.float64)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, r in enumerate(rows):
        x[i, : len(r)] = torch.tensor(r, dtype=torch.float64)
        mask[i, : len(r)] = True
    return x, mask


def unpad(x: torch.Tensor, mask: torch.Tensor) -> list[list[float]]:
    return [x[i][mask[i]].tolist() for i in range(x.shape[0])]


@pytest.fixture
def ragged():
    """Six responses of lengths 1..5 with random token rewards, in three groups of two."""
    g = torch.Generator().manual_seed(0)
    lengths = [3, 1, 5, 2, 4, 4]
    rows = [torch.randn(n, generator=g, dtype=torch.float64).tolist() for n in lengths]
    return rows, torch.tensor([7, 7, 3, 3, 9, 9])
