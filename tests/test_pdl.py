"""Programmatic dependent launch (kernels/pdl.py): a chain of PDL kernels captured in a CUDA graph, as a batch-1
decode step is, reads each input only once the kernel that wrote it has finished.

Each stage's output is checked against float64 of the inputs the stage should have seen: the previous stage's output
as it stands after the replay. A stage that read its input early (before the previous kernel finished) or wrote over
a buffer an earlier kernel was still reading would not match. Off the GPU, PDL is off and the launch is the plain
one (the interpreter runs these kernels in the other test modules).
"""
import pytest
import torch

# sets TRITON_INTERPRET=1 without CUDA, before a kernel module loads
from test_kernels import CUDA, INTERPRET
from test_skinny_gemm import rel_err

from picovllm.kernels.pdl import launch_options   # noqa: E402


def test_off_for_cpu_tensors():
    assert launch_options(torch.zeros(1)) == {"PDL": False}


def rms_norm64(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or INTERPRET, reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 4])
def test_chain_in_a_cuda_graph_reads_finished_inputs(rows, layers=6):
    from picovllm.kernels.activation import silu_and_mul
    from picovllm.kernels.argmax import argmax
    from picovllm.kernels.rmsnorm import rms_norm
    from picovllm.kernels.skinny_gemm import skinny_linear

    dev, dt, eps = "cuda", torch.bfloat16, 1e-6
    hidden, inter = 1024, 3072
    if torch.cuda.get_device_capability()[0] >= 9:
        assert launch_options(torch.zeros(1, device=dev)) == {"PDL": True, "launch_pdl": True}
    g = torch.Generator(device=dev).manual_seed(rows)
    norm_w = [1 + 0.1 * torch.randn(hidden, generator=g, device=dev) for _ in range(layers)]
    up = [(torch.randn(2 * inter, hidden, generator=g, device=dev) * hidden ** -0.5).to(dt) for _ in range(layers)]
    down = [(torch.randn(hidden, inter, generator=g, device=dev) * inter ** -0.5).to(dt) for _ in range(layers)]
    x0 = torch.randn(rows, hidden, generator=g, device=dev).to(dt)

    def step(x):
        outs, residual = [], None
        for i in range(layers):
            if residual is None:
                h, residual = rms_norm(x, norm_w[i], eps), x
            else:
                h, residual = rms_norm(x, norm_w[i], eps, residual)
            a = skinny_linear(h, up[i])
            s = silu_and_mul(a)
            x = skinny_linear(s, down[i])
            outs.append((h, residual, a, s, x))
        return outs, argmax(x.float())

    step(x0)                                    # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs, top = step(x0)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()

    x, residual = x0, None
    for i, (h, res, a, s, y) in enumerate(outs):
        summed = x if residual is None else (x.double() + residual.double()).to(dt)
        assert torch.equal(res, summed), f"layer {i}: residual"
        assert rel_err(h, rms_norm64(summed, norm_w[i], eps)) < 1e-2, f"layer {i}: norm"
        assert rel_err(a, h.double() @ up[i].double().T) < 1e-2, f"layer {i}: up"
        gate, u = a.double().chunk(2, -1)
        assert rel_err(s, gate * torch.sigmoid(gate) * u) < 1e-2, f"layer {i}: silu"
        assert rel_err(y, s.double() @ down[i].double().T) < 1e-2, f"layer {i}: down"
        x, residual = y, res
    assert torch.equal(top, x.float().argmax(-1))
