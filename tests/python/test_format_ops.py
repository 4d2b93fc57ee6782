"""quantize_nvfp4 / dequantize_nvfp4 against the torch oracles of the NVFP4 format (docs/design.md §2).

CPU tests run wherever the package is installed; the CUDA variants need a Hopper GPU.
"""

import pytest

from support import megamoe, requires_hopper, torch
import nvfp4_oracle as oracle

ops = megamoe.ops


def every_code_and_scale():
    """codes [127, 256]: every byte value in every row; scales [127, 32]: row r uses ue4m3 code r
    (0x00..0x7E: zero, the subnormals 0x01..0x07 and every normal value up to 448)."""
    codes = torch.arange(256, dtype=torch.uint8).repeat(127, 1)
    scales = torch.arange(127, dtype=torch.uint8).unsqueeze(1).repeat(1, 32)
    return codes, scales.view(torch.float8_e4m3fn)


@pytest.mark.parametrize("global_scale", [1.0, 0.0123, 3.0e-6])
def test_dequantize_cpu_every_code_and_scale_matches_oracle(global_scale):
    codes, scales = every_code_and_scale()
    got = megamoe.dequantize_nvfp4(codes, scales, global_scale)
    want = oracle.dequantize(codes, scales, global_scale).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == (127, 512)
    mismatch = (got.view(torch.int16) != want.view(torch.int16)).nonzero()
    assert mismatch.numel() == 0, f"{mismatch.shape[0]} elements differ, first at {mismatch[:5].tolist()}"


@requires_hopper
@pytest.mark.parametrize("global_scale", [1.0, 0.0123, 3.0e-6])
def test_dequantize_cuda_equals_cpu_bitwise(global_scale):
    codes, scales = every_code_and_scale()
    cpu = megamoe.dequantize_nvfp4(codes, scales, global_scale)
    gpu = megamoe.dequantize_nvfp4(codes.cuda(), scales.cuda(), global_scale).cpu()
    assert torch.equal(gpu.view(torch.int16), cpu.view(torch.int16))


def test_dequantize_stacked_uses_each_experts_global_scale(seed):
    codes = torch.randint(0, 256, (3, 8, 32), dtype=torch.uint8)
    scales = torch.randint(0, 0x7F, (3, 8, 4), dtype=torch.uint8)
    globals_ = torch.tensor([0.5, 2.0, 0.037])
    got = ops.dequantize_nvfp4(codes, scales, globals_)
    for e in range(3):
        want = ops.dequantize_nvfp4(codes[e], scales[e], globals_[e])
        assert torch.equal(got[e].view(torch.int16), want.view(torch.int16)), f"expert {e}, seed {seed}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_cpu_matches_modelopt_recipe_oracle(seed, dtype):
    # Rows of very different magnitudes, some all-zero blocks, some exact ties of the e2m1 grid.
    w = torch.randn(48, 128) * torch.exp(torch.empty(48, 1).uniform_(-6, 6))
    w[3, 16:32] = 0.0
    w[5, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2)
    w = w.to(dtype)
    codes, scales, s2 = megamoe.quantize_nvfp4(w)
    want_codes, want_scales, want_s2 = oracle.quantize_modelopt(w.float())
    assert codes.dtype == torch.uint8 and codes.shape == (48, 64)
    assert scales.dtype == torch.float8_e4m3fn and scales.shape == (48, 8)
    assert s2.dtype == torch.float32 and s2.shape == ()
    assert s2.item() == want_s2.item(), f"seed {seed}"
    assert torch.equal(scales.view(torch.uint8), want_scales.view(torch.uint8)), f"seed {seed}"
    bad = (codes != want_codes).nonzero()
    assert bad.numel() == 0, f"seed {seed}: codes differ at {bad[:5].tolist()}"


def test_quantize_stacked_is_per_expert(seed):
    w = torch.randn(4, 32, 64) * torch.tensor([1.0, 10.0, 0.01, 3.0]).reshape(4, 1, 1)
    codes, scales, s2 = megamoe.quantize_nvfp4(w)
    assert codes.shape == (4, 32, 32) and scales.shape == (4, 32, 4) and s2.shape == (4,)
    for e in range(4):
        c, s, g = megamoe.quantize_nvfp4(w[e])
        assert torch.equal(codes[e], c) and torch.equal(scales[e].view(torch.uint8), s.view(torch.uint8))
        assert s2[e].item() == g.item(), f"expert {e}, seed {seed}"


def test_quantize_then_dequantize_is_close(seed):
    w = torch.randn(64, 256)
    codes, scales, s2 = megamoe.quantize_nvfp4(w)
    back = megamoe.dequantize_nvfp4(codes, scales, s2).float()
    # e2m1 has 1 mantissa bit: relative error per element up to 1/4 of a block's scale step.
    assert oracle.rel_l2(back, w) < 0.12, f"seed {seed}"


@requires_hopper
def test_quantize_cuda_equals_cpu(seed):
    w = torch.randn(2, 64, 128, dtype=torch.bfloat16)
    cpu = megamoe.quantize_nvfp4(w)
    gpu = megamoe.quantize_nvfp4(w.cuda())
    for a, b in zip(cpu, gpu):
        assert b.is_cuda
        assert torch.equal(a.view(torch.uint8) if a.dtype != torch.float32 else a,
                           b.cpu().view(torch.uint8) if b.dtype != torch.float32 else b.cpu())


def test_fake_kernels_give_shapes_and_dtypes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        codes, scales, s2 = ops.quantize_nvfp4(torch.empty(3, 64, 128))
        assert codes.shape == (3, 64, 64) and codes.dtype == torch.uint8
        assert scales.shape == (3, 64, 8) and scales.dtype == torch.float8_e4m3fn
        assert s2.shape == (3,) and s2.dtype == torch.float32
        out = ops.dequantize_nvfp4(codes, scales, s2)
        assert out.shape == (3, 64, 128) and out.dtype == torch.bfloat16


def test_opcheck_cpu_ops():
    w = torch.randn(16, 64)
    # test_schema cannot compare float8 outputs (SchemaCheckMode multiplies them): skip it for
    # quantize, whose scales are float8; dequantize is checked fully with uint8 scales.
    torch.library.opcheck(ops.quantize_nvfp4.default, (w,),
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))
    codes, scales, s2 = ops.quantize_nvfp4(w)
    torch.library.opcheck(ops.dequantize_nvfp4.default, (codes, scales.view(torch.uint8), s2))


@pytest.mark.parametrize("args, error, text", [
    ((torch.randn(4, 40),), ValueError, "multiple of the NVFP4 block size 16"),
    ((torch.randn(64),), ValueError, "expected [N, K] or stacked experts"),
    ((torch.randint(0, 5, (4, 32)),), TypeError, "has dtype Long"),
    ((torch.full((2, 16), float("nan")),), ValueError, "element [0, 0] is nan"),
])
def test_quantize_rejects_bad_input(args, error, text):
    with pytest.raises(error) as info:
        ops.quantize_nvfp4(*args)
    assert text in str(info.value), str(info.value)


def test_dequantize_rejects_bad_input():
    codes = torch.zeros(4, 16, dtype=torch.uint8)
    scales = torch.zeros(4, 2, dtype=torch.uint8)
    one = torch.tensor(1.0)
    cases = [
        ((codes.float(), scales, one), TypeError, "weight has dtype Float"),
        ((codes, scales[:, :1], one), ValueError, "weight_scale has shape [4, 1]"),
        ((codes, scales.to(torch.int32), one), TypeError, "weight_scale has dtype Int"),
        ((codes, scales, torch.ones(2)), ValueError, "weight_scale_2 has shape [2]"),
        ((torch.zeros(4, 7, dtype=torch.uint8), scales, one), ValueError,
         "not a multiple of the NVFP4 block size"),
        ((codes.t(), scales, one), ValueError, "not contiguous"),
        ((codes, torch.full((4, 2), 0x7F, dtype=torch.uint8), one), ValueError, "0x7F"),
        ((codes, scales, torch.tensor(0.0)), ValueError, "global_scale"),
    ]
    for args, error, text in cases:
        with pytest.raises(error) as info:
            ops.dequantize_nvfp4(*args)
        assert text in str(info.value), f"expected '{text}' in: {info.value}"


def test_fake_fused_moe_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        out = ops.fused_moe_nvfp4(
            torch.empty(5, 128, dtype=torch.bfloat16), torch.empty(8, 128, 64, dtype=torch.uint8),
            torch.empty(8, 128, 8, dtype=torch.float8_e4m3fn), torch.empty(8, 2),
            torch.empty(8, 128, 32, dtype=torch.uint8),
            torch.empty(8, 128, 4, dtype=torch.float8_e4m3fn), torch.empty(8),
            torch.empty(5, 2), torch.empty(5, 2, dtype=torch.int32), handle=1)
        assert out.shape == (5, 128) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("routing", ["topk", "logits", "router"])
def test_module_forward_traces_as_one_graph(routing):
    """torch.export (dynamo, full graph, fake tensors) of NVFP4MoE.forward: the ops trace through
    their fake kernels, with no GPU and no kernel launched."""
    module = megamoe.NVFP4MoE(128, 64, 8, 2, shared_intermediate_size=64, method="noaux_tc",
                              n_group=4, topk_group=2, device="cpu")
    module._handle_id = 7  # tracing only: a prepared layer's id is a constant of the graph
    x = torch.randn(2, 5, 128).to(torch.bfloat16)
    args = {"topk": (x, torch.rand(2, 5, 2), torch.randint(0, 8, (2, 5, 2), dtype=torch.int32)),
            "logits": (x, torch.randn(10, 8)), "router": (x,)}[routing]
    program = torch.export.export(module, args)
    called = {n.target for n in program.graph.nodes if n.op == "call_function"}
    assert torch.ops.megamoe.fused_moe_nvfp4.default in called
    assert (torch.ops.megamoe.route.default in called) == (routing != "topk")
    out = [n for n in program.graph.nodes if n.op == "output"][0].args[0][0].meta["val"]
    assert out.shape == (2, 5, 128) and out.dtype == torch.bfloat16
