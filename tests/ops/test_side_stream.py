"""SideStream: work on a side stream, joined back into the current one."""
from __future__ import annotations

import pytest
import torch

from sieve_attn.ops.side_stream import SideStream


def test_off_cuda_runs_at_once():
    calls = []
    with SideStream(torch.device("cpu")) as side:
        result = side.run(lambda x, scale: calls.append(1) or x * scale, torch.ones(3), scale=2.0)
        assert calls == [1]
    assert torch.equal(result, torch.full((3,), 2.0))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_current_stream_waits_for_the_side_work():
    device = torch.device("cuda")
    x = torch.randn(4096, 4096, device=device)
    main = torch.cuda.current_stream(device)
    product = torch.empty_like(x)  # allocated on the current stream, written on the side one
    with SideStream(device) as side:
        side.run(torch.matmul, x, x, out=product)
        assert torch.cuda.current_stream(device) == main
        side.join()
        # work queued on the current stream after join() sees the side stream's result
        assert torch.allclose(product, x @ x, rtol=1e-4, atol=1e-3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_an_exception_still_joins():
    device = torch.device("cuda")
    x = torch.randn(2048, 2048, device=device)
    product = torch.empty_like(x)
    with pytest.raises(RuntimeError, match="host failed"):
        with SideStream(device) as side:
            side.run(torch.matmul, x, x, out=product)
            raise RuntimeError("host failed")
    assert torch.allclose(product, x @ x, rtol=1e-4, atol=1e-3)
