"""Expert parallelism in torch (megamoe.EpGroup, NVFP4MoE(ep_group=...)): R ranks' outputs are the
whole layer's on their tokens, each rank holding its experts once. On one GPU the ranks are virtual
(megamoe.EpLoopback: SM partitions, the same device code as over NCCL); the multi-GPU test starts
one process per GPU and skips (visibly) where fewer than two are present.
"""

import os

import pytest

import nvfp4_oracle as oracle
from support import (free_port, layer_tensors, megamoe, nccl_available, random_shared,
                     random_stacked, requires_hopper, torch)

pytestmark = requires_hopper

MAX_REL_L2 = 2e-3  # test_moe.py's bound: against the float64 oracle rounded to bf16 once
H, I, E, K = 256, 128, 16, 4


def layer(shared_i=256, **routing):
    t = random_stacked(E, H, I)
    if shared_i:
        t.update({"shared_" + n: v for n, v in random_shared(H, shared_i).items()})
    t["router_weight"] = torch.randn(E, H) / H ** 0.5
    return t


def same_bytes(a, b):
    return a.shape == b.shape and torch.equal(a.cpu().view(torch.uint8), b.cpu().view(torch.uint8))


def loopback_or_skip(R):
    try:
        return megamoe.EpLoopback(R)
    except (NotImplementedError, RuntimeError) as e:
        pytest.skip(f"no loopback of {R} ranks here: {e}")


def rank_modules(t, lb, max_t, **options):
    modules = []
    for r in range(lb.world_size):
        group = megamoe.EpGroup(loopback=lb, rank=r, hidden_size=H, top_k=K, max_tokens_per_rank=max_t)
        modules.append(megamoe.NVFP4MoE.from_tensors(t, K, ep_group=group, check_ids=False, **options))
    return modules


def routing(T):
    ids = torch.rand(T, E).argsort(dim=1)[:, :K].to(torch.int32)
    w = torch.rand(T, K) + 0.05
    return (w / w.sum(dim=1, keepdim=True)).cuda(), ids.cuda()


def run_ranks(modules, lb, inputs):
    """Every rank's forward on its own stream (launched before any waits), then every rank's
    stream synchronised (the ranks' streams are in green contexts: torch.cuda.synchronize(), which
    waits for the primary context, does not wait for them)."""
    torch.cuda.synchronize()
    outs = []
    for r, m in enumerate(modules):
        with torch.cuda.stream(lb.stream(r)):
            outs.append(m(*inputs[r]))
    lb.synchronize()
    return outs


@pytest.mark.parametrize("R", [2, 4])
@pytest.mark.parametrize("shared_i", [0, 256], ids=["routed", "shared_expert"])
def test_ranks_give_the_whole_layer(R, shared_i, seed):
    t = layer(shared_i)
    lb = loopback_or_skip(R)
    max_t = 24
    modules = rank_modules(t, lb, max_t, deterministic=True)
    whole = megamoe.NVFP4MoE.from_tensors(t, K, deterministic=True, max_tokens=R * max_t)
    for m, r in zip(modules, range(R)):
        assert m.num_local_experts == E // R and m.expert_first == r * E // R
        assert f"ep_rank={r}, ep_size={R}" in repr(m)
        assert "weights held in place" in m.describe()
    tokens = [max_t, 0] + [int(n) for n in torch.randint(0, max_t + 1, (R - 2,))]
    inputs = []
    for T in tokens:
        x = torch.randn(T, H).to(torch.bfloat16).cuda()
        inputs.append((x, *routing(T)))
    outs = run_ranks(modules, lb, inputs)
    again = run_ranks(modules, lb, inputs)
    x_all = torch.cat([i[0] for i in inputs])
    w_all = torch.cat([i[1] for i in inputs])
    ids_all = torch.cat([i[2] for i in inputs])
    ref = oracle.moe_forward(x_all, layer_tensors(whole), w_all, ids_all)
    got = torch.cat(outs)
    assert got.dtype == torch.bfloat16 and got.shape == x_all.shape
    assert bool(torch.isfinite(got).all()), f"seed {seed}"
    err = oracle.rel_l2(got, ref.to(torch.bfloat16))
    assert err <= MAX_REL_L2, f"seed {seed}: R={R} rel L2 {err:.3g}"
    for r in range(R):
        assert torch.equal(outs[r], again[r]), f"seed {seed}: rank {r} is not bitwise stable"


def test_ranks_route_with_their_router_and_hold_their_experts_once(seed):
    R, max_t = 2, 16
    t = layer()
    lb = loopback_or_skip(R)
    modules = rank_modules(t, lb, max_t, deterministic=True)
    whole = megamoe.NVFP4MoE.from_tensors(t, K, deterministic=True, max_tokens=R * max_t)
    xs = [torch.randn(max_t, H).to(torch.bfloat16).cuda() for _ in range(R)]
    torch.cuda.synchronize()
    outs = []
    for r, m in enumerate(modules):
        with torch.cuda.stream(lb.stream(r)):
            outs.append(m(xs[r]))  # the router path: logits, route, experts
    lb.synchronize()
    want = whole(torch.cat(xs))
    err = oracle.rel_l2(torch.cat(outs), want)
    assert err <= MAX_REL_L2, f"seed {seed}: rel L2 {err:.3g} against the single-GPU layer"
    # The rank's state dict is its slice, in the checkpoint layout.
    first, count = modules[1].expert_first, modules[1].num_local_experts
    state = modules[1].state_dict()
    for name in ("w13", "w13_scale", "w13_scale_2", "w2", "w2_scale", "w2_scale_2"):
        assert same_bytes(state[name], t[name][first:first + count]), name
    for name in ("shared_w13", "shared_w13_scale", "shared_w13_scale_2", "shared_w2",
                 "shared_w2_scale", "shared_w2_scale_2"):
        assert same_bytes(state[name], t[name]), name
    modules[1].unprepare()
    assert torch.equal(modules[1].w13.cpu(), t["w13"][first:first + count])


def test_graph_replays_equal_eager_runs(seed):
    R, max_t = 2, 16
    lb = loopback_or_skip(R)
    modules = rank_modules(layer(), lb, max_t, deterministic=True)
    static = [(torch.randn(max_t, H).to(torch.bfloat16).cuda(), *routing(max_t)) for _ in range(R)]
    graphs, outs = [], []
    for r in range(R):  # captured, not run: no rank waits on another here
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=lb.stream(r)):
            outs.append(modules[r](*static[r]))
        graphs.append(graph)
    for round in range(3):
        fresh = [(torch.randn(max_t, H).to(torch.bfloat16).cuda(), *routing(max_t)) for _ in range(R)]
        for r in range(R):
            for dst, src in zip(static[r], fresh[r]):
                dst.copy_(src)
        want = run_ranks(modules, lb, fresh)  # eager, same group: the epochs stay in step
        for r in range(R):
            with torch.cuda.stream(lb.stream(r)):
                graphs[r].replay()
        lb.synchronize()
        for r in range(R):
            assert torch.equal(outs[r], want[r]), f"seed {seed}: round {round}, rank {r}"


def test_bad_setups_are_refused():
    lb = loopback_or_skip(2)
    group = megamoe.EpGroup(loopback=lb, rank=0, hidden_size=H, top_k=K, max_tokens_per_rank=8)
    with pytest.raises(ValueError, match="do not split evenly over 2 ranks"):
        megamoe.NVFP4MoE(H, I, 15, K, ep_group=group, device="cuda")
    with pytest.raises(ValueError, match="exceed the EpGroup's window"):
        megamoe.NVFP4MoE(2 * H, I, E, K, ep_group=group, device="cuda")
    with pytest.raises(ValueError, match="pass a process_group, or a loopback and a rank"):
        megamoe.EpGroup(hidden_size=H, top_k=K, max_tokens_per_rank=8)
    module = megamoe.NVFP4MoE.from_tensors(layer(), K, ep_group=group, check_ids=False)
    x = torch.randn(9, H).to(torch.bfloat16).cuda()
    with pytest.raises(ValueError, match="more than the group's max_tokens_per_rank = 8"):
        module(x, *routing(9))




def _ep_rank(rank, world, port, seed, result):
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    os.environ["NVSHMEM_DISABLE_NVLS"] = "1"
    torch.cuda.set_device(rank)
    torch.manual_seed(seed)  # every rank draws the same layer and every rank's inputs
    torch.distributed.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                         world_size=world, device_id=torch.device("cuda", rank))
    try:
        experts = 8 * world
        t = random_stacked(experts, H, I)
        t.update({"shared_" + n: v for n, v in random_shared(H, 256).items()})
        inputs = []
        for _ in range(world):
            T = 13
            x = torch.randn(T, H).to(torch.bfloat16).cuda()
            ids = torch.rand(T, experts).argsort(dim=1)[:, :K].to(torch.int32).cuda()
            w = torch.rand(T, K).cuda() + 0.05
            inputs.append((x, w / w.sum(dim=1, keepdim=True), ids))
        group = megamoe.EpGroup(torch.distributed.group.WORLD, hidden_size=H, top_k=K,
                                max_tokens_per_rank=16)
        module = megamoe.NVFP4MoE.from_tensors(t, K, ep_group=group, deterministic=True)
        got = module(*inputs[rank])
        whole = megamoe.NVFP4MoE.from_tensors(t, K, deterministic=True)
        want = whole(*inputs[rank])
        result[rank] = oracle.rel_l2(got, want)
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.skipif(not nccl_available(), reason="torch.distributed with NCCL is not available")
def test_ranks_on_several_gpus_give_the_layer(seed):
    world = torch.cuda.device_count()
    if world < 2:
        pytest.skip(f"{world} CUDA device: the multi-GPU expert-parallel test needs 2 or more "
                    "(run it on a multi-GPU machine; the loopback tests cover the ranks on one GPU)")
    world = min(world, 8)
    import torch.multiprocessing as mp
    result = mp.Manager().dict()
    mp.spawn(_ep_rank, args=(world, free_port(), seed, result), nprocs=world, join=True)
    for rank in range(world):
        assert result[rank] <= MAX_REL_L2, f"seed {seed}: rank {rank}: rel L2 {result[rank]:.3g}"
