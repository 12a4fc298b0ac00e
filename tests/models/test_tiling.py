"""usp.models.tiling: the tiles of a token loop; representative tiles only for fake tensors."""

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from usp.models.norm import rms_norm
from usp.models.tiling import representative, representative_tiles, tiles


def test_tiles_cover_the_rows_in_order():
    assert tiles(10, 4) == [slice(0, 4), slice(4, 8), slice(8, 10)]
    assert tiles(8, 4) == [slice(0, 4), slice(4, 8)]
    assert tiles(3, 4) == [slice(0, 3)]
    assert tiles(0, 4) == []
    assert tiles(10, 4, representative_only=True) == [slice(0, 4), slice(8, 10)]
    assert tiles(8, 4, representative_only=True) == [slice(0, 4), slice(4, 8)]


def test_representative_needs_the_mode_and_a_fake_tensor():
    real = torch.zeros(2)
    assert not representative(real)
    with representative_tiles():
        assert not representative(real)  # real tensors: every tile, always
        with FakeTensorMode():
            fake = torch.zeros(2)
            assert representative(fake)
    with FakeTensorMode():
        assert not representative(torch.zeros(2))  # fake, but outside the mode


def test_the_mode_changes_no_computed_value():
    """RMSNorm over 5 tiles, forward and backward, inside and outside the mode: the
    same bits (real tensors run every tile)."""
    torch.manual_seed(0)
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    weight = torch.randn(16, dtype=torch.float64)
    grad = torch.randn(2, 9, 16, dtype=torch.float64)

    def run():
        xs, ws = x.clone().requires_grad_(), weight.clone().requires_grad_()
        out = rms_norm(xs, ws, 1e-5, chunk_tokens=4)
        out.backward(grad)
        return out.detach(), xs.grad, ws.grad

    outside = run()
    with representative_tiles():
        inside = run()
    for a, b in zip(outside, inside):
        assert torch.equal(a, b)
