"""megamoe.route (softmax / noaux_tc) against the float64 torch oracle: ids identical (order
included), weights within one fp32 ulp. The CPU kernel is the library's reference router; the
CUDA kernel (Hopper) is the GPU router, which must select exactly as the reference does.
"""

import pytest

from support import megamoe, requires_hopper, torch
import nvfp4_oracle as oracle

CONFIGS = {
    "qwen3_softmax": dict(E=128, top_k=8, method="softmax", renormalize=True),
    "softmax_no_renorm": dict(E=60, top_k=4, method="softmax", renormalize=False),
    "deepseek_v3_noaux": dict(E=256, top_k=8, method="noaux_tc", n_group=8, topk_group=4,
                              routed_scaling_factor=2.5, bias=True),
    "noaux_one_group_no_bias": dict(E=64, top_k=6, method="noaux_tc", routed_scaling_factor=1.5),
    "noaux_no_renorm": dict(E=32, top_k=3, method="noaux_tc", n_group=4, topk_group=2,
                            renormalize=False, bias=True),
}


def make_inputs(cfg, T, ties=False):
    E = cfg["E"]
    if ties:  # a handful of values: most selections are decided by the lower index
        logits = torch.randint(-2, 3, (T, E)).float() * 0.5
        bias = (torch.randint(0, 2, (E,)).float() * 0.25) if cfg.get("bias") else None
    else:
        logits = torch.randn(T, E) * torch.exp(torch.empty(T, 1).uniform_(-1.5, 2.0))
        bias = (torch.randn(E) * 0.05) if cfg.get("bias") else None
    kwargs = {k: v for k, v in cfg.items() if k not in ("E", "bias")}
    return logits, bias, kwargs


def check_against_oracle(weights, ids, logits, bias, kwargs, seed):
    want_w, want_ids = oracle.route(logits, bias=bias, **kwargs)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    bad = (ids.cpu().long() != want_ids).any(dim=1).nonzero().flatten()
    assert bad.numel() == 0, (
        f"seed {seed}: ids differ in {bad.numel()} rows, first row {bad[0].item()}: "
        f"got {ids[bad[0]].tolist()}, oracle {want_ids[bad[0]].tolist()}")
    ulp = torch.nextafter(want_w, torch.full_like(want_w, torch.inf)) - want_w
    err = (weights.cpu() - want_w).abs()
    assert bool((err <= ulp).all()), f"seed {seed}: weights off by up to {float((err / ulp).max())} ulp"


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("ties", [False, True], ids=["random", "ties"])
def test_cpu_route_matches_oracle(name, ties, seed):
    logits, bias, kwargs = make_inputs(CONFIGS[name], 97, ties)
    weights, ids = megamoe.route(logits, e_score_correction_bias=bias, **kwargs)
    check_against_oracle(weights, ids, logits, bias, kwargs, seed)


@requires_hopper
@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("ties", [False, True], ids=["random", "ties"])
@pytest.mark.parametrize("T", [1, 17, 1000])
def test_cuda_route_matches_oracle(name, ties, T, seed):
    logits, bias, kwargs = make_inputs(CONFIGS[name], T, ties)
    weights, ids = megamoe.route(logits.cuda(), e_score_correction_bias=None if bias is None
                                 else bias.cuda(), **kwargs)
    assert weights.is_cuda and ids.is_cuda
    check_against_oracle(weights, ids, logits, bias, kwargs, seed)


def test_fake_route_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        w, ids = megamoe.route(torch.empty(5, 64), top_k=6)
        assert w.shape == (5, 6) and w.dtype == torch.float32
        assert ids.shape == (5, 6) and ids.dtype == torch.int32


def test_opcheck_cpu_route(seed):
    torch.library.opcheck(megamoe.ops.route.default, (torch.randn(7, 32),),
                          {"top_k": 4, "method": "noaux_tc", "n_group": 4, "topk_group": 2,
                           "e_score_correction_bias": torch.randn(32)})


@requires_hopper
def test_opcheck_cuda_route(seed):
    torch.library.opcheck(megamoe.ops.route.default, (torch.randn(7, 32, device="cuda"),),
                          {"top_k": 4})


BAD = [
    (dict(router_logits=torch.randn(4, 8).half(), top_k=2), TypeError, "router_logits has dtype Half"),
    (dict(router_logits=torch.randn(8), top_k=2), ValueError, "expected 2 dimensions"),
    (dict(router_logits=torch.randn(8, 4).t(), top_k=2), ValueError, "not contiguous"),
    (dict(router_logits=torch.randn(4, 8), top_k=0), ValueError, "top_k is 0"),
    (dict(router_logits=torch.randn(4, 8), top_k=9), ValueError, "top_k is 9"),
    (dict(router_logits=torch.randn(4, 8), top_k=2, method="sigmoid"), ValueError, "method 'sigmoid'"),
    (dict(router_logits=torch.randn(4, 8), top_k=2, e_score_correction_bias=torch.zeros(8)),
     ValueError, "softmax top-k routing, which takes none"),
    (dict(router_logits=torch.randn(4, 8), top_k=2, method="noaux_tc",
          e_score_correction_bias=torch.zeros(7)), ValueError, "e_score_correction_bias has shape [7]"),
    (dict(router_logits=torch.randn(4, 8), top_k=2, method="noaux_tc", n_group=3), ValueError, "n_group"),
    (dict(router_logits=torch.randn(4, 8), top_k=2, method="noaux_tc", n_group=2, topk_group=3),
     ValueError, "topk_group"),
    (dict(router_logits=torch.randn(4, 8), top_k=5, method="noaux_tc", n_group=2, topk_group=1),
     ValueError, "kept groups"),
    (dict(router_logits=torch.randn(4, 8), top_k=2, routed_scaling_factor=0.0), ValueError,
     "routed_scaling_factor"),
    (dict(router_logits=torch.tensor([[0.0, float("nan")]]), top_k=1), ValueError, "must be finite"),
]


@pytest.mark.parametrize("kwargs, error, text", BAD, ids=[b[2] for b in BAD])
def test_route_rejects_bad_input(kwargs, error, text):
    kwargs = dict(kwargs)
    logits = kwargs.pop("router_logits")
    with pytest.raises(error) as info:
        megamoe.ops.route(logits, **kwargs)
    assert text in str(info.value), f"expected '{text}' in: {info.value}"


@requires_hopper
def test_cuda_route_rejects_bias_on_another_device():
    with pytest.raises(ValueError, match="e_score_correction_bias is on cpu"):
        megamoe.ops.route(torch.randn(4, 8, device="cuda"), top_k=2, method="noaux_tc",
                          e_score_correction_bias=torch.zeros(8))
