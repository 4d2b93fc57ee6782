"""Tensor parallelism in torch (NVFP4MoE(tp_group=...), megamoe.tp_slice): the ranks' fp32
partials sum to the whole layer, a group of one is the layer bitwise, bad splits are refused. The
multi-GPU test starts one process per GPU and skips (visibly) where fewer than two are present, so
that a multi-GPU machine runs this file unchanged.
"""

import os

import pytest

from support import (free_port, megamoe, nccl_available, random_shared, random_stacked,
                     requires_hopper, torch)

pytestmark = requires_hopper

MAX_REL_L2 = 2e-3


def layer(E=8, H=256, I=256, k=2, shared_i=256):
    tensors = random_stacked(E, H, I)
    if shared_i:
        tensors.update({"shared_" + n: v for n, v in random_shared(H, shared_i).items()})
    tensors["router_weight"] = torch.randn(E, H) / H ** 0.5
    return tensors


def routing(T, E, k):
    ids = torch.rand(T, E).argsort(dim=1)[:, :k].to(torch.int32)
    w = torch.rand(T, k) + 0.05
    return (w / w.sum(dim=1, keepdim=True)).cuda(), ids.cuda()


def rel_l2(got, want):
    return (got.float() - want.float()).norm().item() / want.float().norm().item()


def partial_of(module, x, w, ids):
    """A module's fp32 output before rounding (what a tensor-parallel rank all-reduces)."""
    return module._experts(x, w, ids, module._prepared_handle(), fp32_output=True)


@pytest.mark.parametrize("R", [2, 4])
def test_rank_partials_sum_to_the_whole_layer(R, seed):
    E, H, I, k, T = 8, 256, 256 * 2, 2, 37
    tensors = layer(E, H, I, k, shared_i=512)
    whole = megamoe.NVFP4MoE.from_tensors(tensors, k, deterministic=True)
    x = torch.randn(T, H).to(torch.bfloat16).cuda()
    w, ids = routing(T, E, k)
    want = whole(x, w, ids)
    total = torch.zeros(T, H, dtype=torch.float32, device="cuda")
    for r in range(R):
        rank = megamoe.NVFP4MoE.from_tensors(megamoe.tp_slice(tensors, r, R), k, deterministic=True)
        assert rank.w13.shape == (E, 2 * I // R, H // 2)
        assert rank.w2.shape == (E, H, I // R // 2)
        assert rank.shared_w2_scale.shape == (H, 512 // R // 16)
        total += partial_of(rank, x, w, ids)  # rank order, as the all-reduce of a ring sums
    got = total.to(torch.bfloat16)
    assert torch.isfinite(got.float()).all()
    # The same sums associated differently (per rank, then over ranks): equal up to an ulp flip.
    err = rel_l2(got, want)
    assert err <= 1e-3, f"seed {seed}: Σ of {R} ranks' partials vs the whole layer: rel L2 {err:.3g}"


def test_partial_is_the_output_before_rounding(seed):
    # Deterministic: the atomic combine's fp32 sums may differ between two runs in the last bit.
    module = megamoe.NVFP4MoE.from_tensors(layer(), 2, deterministic=True)
    x = torch.randn(9, 256).to(torch.bfloat16).cuda()
    w, ids = routing(9, 8, 2)
    partial = partial_of(module, x, w, ids)
    assert partial.dtype == torch.float32
    assert torch.equal(partial.to(torch.bfloat16), module(x, w, ids)), f"seed {seed}"


def test_bad_splits_are_refused():
    tensors = layer(I=256, shared_i=256)
    for R, what in ((3, "intermediate_size = 256 does not split over 3"),
                    (8, "intermediate_size = 256 does not split over 8")):
        with pytest.raises(ValueError) as info:
            megamoe.tp_slice(tensors, 0, R)
        assert what in str(info.value), str(info.value)
    with pytest.raises(ValueError) as info:
        megamoe.tp_slice(tensors, 2, 2)
    assert "rank 2 of world size 2" in str(info.value)




@pytest.mark.skipif(not nccl_available(), reason="torch.distributed with NCCL is not available")
def test_group_of_one_is_the_layer(seed):
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.distributed.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}",
                                         rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        tensors = layer()
        plain = megamoe.NVFP4MoE.from_tensors(tensors, 2, deterministic=True)
        tp = megamoe.NVFP4MoE.from_tensors(tensors, 2, deterministic=True,
                                           tp_group=torch.distributed.group.WORLD)
        assert tp.tp_size == 1 and "tp_size=1" in repr(tp)
        x = torch.randn(13, 256).to(torch.bfloat16).cuda()
        w, ids = routing(13, 8, 2)
        assert torch.equal(tp(x, w, ids), plain(x, w, ids)), f"seed {seed}"
        assert torch.equal(tp(x), plain(x)), f"seed {seed}: the router path"
    finally:
        torch.distributed.destroy_process_group()


def _tp_rank(rank, world, port, seed, result):
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    torch.cuda.set_device(rank)
    torch.manual_seed(seed)  # every rank draws the same layer and inputs
    torch.distributed.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                         world_size=world, device_id=torch.device("cuda", rank))
    try:
        tensors = layer(E=8, H=256, I=256 * world, shared_i=256 * world)
        x = torch.randn(21, 256).to(torch.bfloat16).cuda()
        w, ids = routing(21, 8, 2)
        tp = megamoe.NVFP4MoE.from_tensors(tensors, 2, deterministic=True,
                                           tp_group=torch.distributed.group.WORLD)
        got = tp(x, w, ids)
        want = megamoe.NVFP4MoE.from_tensors(tensors, 2, deterministic=True)(x, w, ids)
        result[rank] = rel_l2(got, want)
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.skipif(not nccl_available(), reason="torch.distributed with NCCL is not available")
def test_ranks_on_several_gpus_give_the_layer(seed):
    world = torch.cuda.device_count()
    if world < 2:
        pytest.skip(f"{world} CUDA device: the multi-GPU tensor-parallel test needs 2 or more "
                    "(run it on a multi-GPU machine)")
    world = min(world, 8)
    import torch.multiprocessing as mp
    result = mp.Manager().dict()
    mp.spawn(_tp_rank, args=(world, free_port(), seed, result), nprocs=world, join=True)
    for rank in range(world):
        assert result[rank] <= 1e-3, f"seed {seed}: rank {rank}: rel L2 {result[rank]:.3g}"
