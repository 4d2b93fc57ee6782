"""A prepared NVFP4MoE holds its weights once on the GPU: prepare rewrites the buffers in place
into the kernels' layout, and everything that reads the weights back (state_dict,
checkpoint_tensors, unprepare, moves, load_state_dict) still sees the checkpoint's bytes. Also the
functional ops behind it (prepare_moe_in_place, unprepack_moe) and their errors.
"""

import pytest

from support import megamoe, random_shared, random_stacked, requires_hopper, torch

pytestmark = requires_hopper

CODE_NAMES = ("w13", "w13_scale", "w2", "w2_scale")


def layer(E, H, I, shared_i=0):
    """Random stacked tensors (block scales never 0, so every byte round-trips) and a router."""
    tensors = random_stacked(E, H, I)
    if shared_i:
        tensors.update({"shared_" + k: v for k, v in random_shared(H, shared_i).items()})
    tensors["router_weight"] = torch.randn(E, H) / H ** 0.5
    return tensors


def same_bytes(a, b):
    return a.shape == b.shape and torch.equal(a.cpu().view(torch.uint8), b.cpu().view(torch.uint8))


def inputs(T, H, E, k):
    x = torch.randn(T, H).to(torch.bfloat16).cuda()
    ids = torch.rand(T, E).argsort(dim=1)[:, :k].to(torch.int32).cuda()
    w = torch.rand(T, k).cuda() + 0.05
    return x, w / w.sum(dim=1, keepdim=True), ids


def code_names(module):
    return [p + n for p in ("", "shared_")[:1 + bool(module.shared_intermediate_size)]
            for n in CODE_NAMES]


@pytest.mark.parametrize("shared_i", [0, 256], ids=["routed", "shared_expert"])
def test_prepare_rewrites_the_buffers_and_state_dict_gives_the_checkpoint_back(shared_i, seed):
    E, H, I, k = 8, 256, 128, 2
    t = layer(E, H, I, shared_i)
    module = megamoe.NVFP4MoE.from_tensors(t, k, deterministic=True, max_tokens=64)
    assert "layout=sm90-prepacked-nvfp4" in repr(module)
    # In place: the code buffers no longer hold the checkpoint's bytes.
    assert not same_bytes(module.w13, t["w13"]), f"seed {seed}"
    state = module.state_dict()
    for name, tensor in t.items():
        assert same_bytes(state[name], tensor), f"{name} (seed {seed})"
    for name in code_names(module):
        assert state[name].device.type == "cpu", name  # no second copy on the GPU
    assert state["w13_scale"].dtype == torch.float8_e4m3fn

    x, w, ids = inputs(33, H, E, k)
    want = module(x, w, ids)
    fresh = megamoe.NVFP4MoE.from_tensors(layer(E, H, I, shared_i), k, deterministic=True,
                                          max_tokens=64)
    fresh(x, w, ids)  # prepared: the load replaces prepacked bytes
    fresh.load_state_dict(state)
    assert "not prepared" in fresh.describe()
    assert torch.equal(fresh(x, w, ids), want), f"seed {seed}"

    # A partial load into a prepared module: the rest of the buffers are unpacked first.
    other = layer(E, H, I, shared_i)
    fresh.load_state_dict({"w2": other["w2"]}, strict=False)
    for name in t:
        want_bytes = other[name] if name == "w2" else t[name]
        assert same_bytes(fresh.checkpoint_tensors()[name], want_bytes), f"{name} (seed {seed})"

    module.unprepare()
    assert "prepared=False" in repr(module) and "layout=" not in repr(module)
    for name, tensor in t.items():
        assert same_bytes(getattr(module, name), tensor), f"{name} after unprepare (seed {seed})"
    assert torch.equal(module(x, w, ids), want), f"seed {seed}"


def test_moves_keep_the_prepacked_bytes(seed):
    E, H, I, k = 8, 256, 128, 3
    t = layer(E, H, I, 128)
    module = megamoe.NVFP4MoE.from_tensors(t, k, deterministic=True, max_tokens=16)
    x, w, ids = inputs(16, H, E, k)
    want = module(x, w, ids)
    packed = module.w13.clone()
    module.cpu()
    assert same_bytes(module.w13, packed) and "layout=sm90-prepacked-nvfp4" in repr(module)
    assert module.shared_w13.untyped_storage().data_ptr() == module.w13.untyped_storage().data_ptr()
    for name, tensor in t.items():
        assert same_bytes(module.state_dict()[name], tensor), f"{name} on the CPU (seed {seed})"
    module.cuda()
    assert module.shared_w13.untyped_storage().data_ptr() == module.w13.untyped_storage().data_ptr()
    assert torch.equal(module(x, w, ids), want), f"seed {seed}"
    module.prepare(max_tokens=32)  # a new plan over the same prepacked bytes
    assert torch.equal(module(x, w, ids), want), f"seed {seed}"
    assert same_bytes(module.w13, packed)


def test_replaced_buffers_are_joined_again(seed):
    E, H, I, k = 4, 128, 64, 2
    t = layer(E, H, I, 64)
    module = megamoe.NVFP4MoE(H, I, E, k, shared_intermediate_size=64, deterministic=True,
                              device="cuda")
    for name, tensor in t.items():
        setattr(module, name, tensor.cuda())  # separate storages
    x, w, ids = inputs(8, H, E, k)
    out = module(x, w, ids)
    assert module.shared_w2.untyped_storage().data_ptr() == module.w2.untyped_storage().data_ptr()
    reference = megamoe.NVFP4MoE.from_tensors(t, k, deterministic=True)
    assert torch.equal(out, reference(x, w, ids)), f"seed {seed}"


def test_a_refused_layer_is_left_as_it_was():
    E, H, I = 4, 128, 64
    t = layer(E, H, I)
    bad = dict(t)
    bad["w2_scale"] = t["w2_scale"].clone()
    bad["w2_scale"].view(torch.uint8)[1, 2, 3] = 0x7F
    module = megamoe.NVFP4MoE.from_tensors(bad, 2, device="cpu").cuda()
    with pytest.raises(ValueError, match=r"w2_scale\[1, 2, 3\] is the block scale 0x7F"):
        module.prepare()
    for name, tensor in bad.items():
        assert same_bytes(getattr(module, name), tensor), name
    assert "layout=" not in repr(module)
    with torch.no_grad():
        module.w2_scale.copy_(t["w2_scale"].cuda())
    module.prepare()  # fixed: prepares


def test_prepared_module_holds_one_copy_of_the_weights():
    # DeepSeek-V3's expert shapes (16 of the 256 experts): before this, the prepared copy doubled
    # the device memory of the NVFP4 bytes.
    E, H, I, k = 16, 7168, 2048, 8
    t = layer(E, H, I, 2048)
    nvfp4_bytes = sum(v.numel() * v.element_size() for n, v in t.items() if n != "router_weight")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free_before = torch.cuda.mem_get_info()[0]
    module = megamoe.NVFP4MoE.from_tensors(t, k, max_tokens=16)
    torch.cuda.synchronize()
    used = free_before - torch.cuda.mem_get_info()[0]
    assert used < 1.05 * nvfp4_bytes + (64 << 20), (
        f"{used / 1e6:.1f} MB on the device for {nvfp4_bytes / 1e6:.1f} MB of NVFP4 weights; "
        f"{module.describe(16)}")
    assert "weights prepacked in place" in module.describe(16)


def test_functional_in_place_ops():
    E, H, I, k = 8, 256, 128, 2
    t = {n: v.cuda() for n, v in layer(E, H, I, 128).items()}
    names = ("w13", "w13_scale", "w13_scale_2", "w2", "w2_scale", "w2_scale_2")
    shared_names = tuple("shared_" + n for n in names)
    x, w, ids = inputs(20, H, E, k)

    copied = megamoe.prepare_moe(*(t[n] for n in names), top_k=k, max_tokens=20,
                                 deterministic=True, shared_expert=[t[n] for n in shared_names])
    want = megamoe.fused_moe_nvfp4(x, *(t[n] for n in names), w, ids, handle=copied,
                                   deterministic=True,
                                   shared_expert=[t[n] for n in shared_names])
    # Separate allocations for the shared expert: refused, naming the rule.
    with pytest.raises(ValueError, match="shared_w13 must start where w13 ends"):
        megamoe.prepare_moe_in_place(*(t[n] for n in names), top_k=k, max_tokens=20,
                                     shared_expert=[t[n] for n in shared_names])

    joint = {}
    for n in names:
        s = "shared_" + n
        if n.endswith("_2"):
            joint[n], joint[s] = t[n].clone(), t[s].clone()
            continue
        flat = torch.cat([t[n].view(torch.uint8).reshape(-1), t[s].view(torch.uint8).reshape(-1)])
        a = t[n].numel()
        joint[n] = flat[:a].view(t[n].dtype).view(t[n].shape)
        joint[s] = flat[a:].view(t[s].dtype).view(t[s].shape)
    handle = megamoe.prepare_moe_in_place(*(joint[n] for n in names), top_k=k, max_tokens=20,
                                          deterministic=True,
                                          shared_expert=[joint[n] for n in shared_names])
    assert handle.layout() == "sm90-prepacked-nvfp4"
    got = megamoe.fused_moe_nvfp4(x, *(joint[n] for n in names), w, ids, handle=handle,
                                  deterministic=True,
                                  shared_expert=[joint[n] for n in shared_names])
    assert torch.equal(got, want)
    viewed = megamoe.prepare_moe(*(joint[n] for n in names), top_k=k, max_tokens=20,
                                 deterministic=True, prepacked=True,
                                 shared_expert=[joint[n] for n in shared_names])
    again = megamoe.fused_moe_nvfp4(x, *(joint[n] for n in names), w, ids, handle=viewed,
                                    deterministic=True,
                                    shared_expert=[joint[n] for n in shared_names])
    assert torch.equal(again, want)

    back = megamoe.unprepack_moe(handle.layout(), *(joint[n] for n in names),
                                 shared_expert=[joint[n] for n in shared_names])
    for n, tensor in zip(names + shared_names, back):
        assert tensor.device.type == "cpu" and same_bytes(tensor, t[n]), n
    megamoe.unprepack_moe_in_place(handle.layout(), *(joint[n] for n in names),
                                   shared_expert=[joint[n] for n in shared_names])
    for n in names + shared_names:
        assert same_bytes(joint[n], t[n]), n
    with pytest.raises(ValueError, match='weight layout "sm80" is not one of this build'):
        megamoe.unprepack_moe("sm80", *(joint[n] for n in names),
                              shared_expert=[joint[n] for n in shared_names])


def test_changing_a_prepacked_buffer_is_refused_until_unprepared(seed):
    t = layer(8, 256, 128)
    module = megamoe.NVFP4MoE.from_tensors(t, 2, deterministic=True)
    x, w, ids = inputs(12, 256, 8, 2)
    want = module(x, w, ids)
    with torch.no_grad():
        module.w2.copy_(t["w2"].cuda())  # checkpoint bytes over prepacked ones
    with pytest.raises(ValueError, match="modified in place"):
        module(x, w, ids)
    with pytest.raises(ValueError, match="w2 was changed after it was prepacked in place"):
        module.prepare()
    module.load_state_dict(t)  # the way to give a prepared module new weights
    assert torch.equal(module(x, w, ids), want), f"seed {seed}"


def test_a_state_dict_taken_before_prepare_loads_after_it(seed):
    t = layer(8, 256, 128, 128)
    module = megamoe.NVFP4MoE.from_tensors(t, 2, deterministic=True, device="cpu").cuda()
    early = module.state_dict()  # the buffers themselves
    x, w, ids = inputs(12, 256, 8, 2)
    want = module(x, w, ids)  # prepares: `early` now holds the prepacked bytes
    module.load_state_dict(early)
    for name, tensor in t.items():
        assert same_bytes(module.checkpoint_tensors()[name], tensor), name
    assert torch.equal(module(x, w, ids), want), f"seed {seed}"


def test_checkpoint_tensors_of_a_prepared_module_are_on_the_cpu_and_copies_run(seed):
    import copy

    t = layer(8, 256, 128, 128)
    module = megamoe.NVFP4MoE.from_tensors(t, 2, deterministic=True)
    tensors = module.checkpoint_tensors()
    for name in t:
        if name != "router_weight":
            assert tensors[name].device.type == "cpu", name
    x, w, ids = inputs(12, 256, 8, 2)
    want = module(x, w, ids)
    twin = copy.deepcopy(module)
    assert "prepared=False" in repr(twin)
    assert torch.equal(twin(x, w, ids), want), f"seed {seed}"
    assert torch.equal(module(x, w, ids), want), f"seed {seed}: the original after its copy ran"


def test_layers_share_one_workspace(seed):
    a = megamoe.NVFP4MoE.from_tensors(layer(8, 256, 128, 128), 2, deterministic=True, max_tokens=64)
    b = megamoe.NVFP4MoE.from_tensors(layer(16, 512, 128), 4, deterministic=True, max_tokens=256)
    x_a, w_a, ids_a = inputs(40, 256, 8, 2)
    x_b, w_b, ids_b = inputs(200, 512, 16, 4)
    want_a, want_b = a(x_a, w_a, ids_a), b(x_b, w_b, ids_b)
    need = max(megamoe.ops.moe_workspace_bytes(m._handle_id) for m in (a, b))
    workspace = megamoe.share_workspace(torch.nn.ModuleList([a, b]).modules())
    assert workspace.numel() == need
    for m in (a, b):
        assert f"workspace {need} B" in m.describe(), m.describe()
    for _ in range(2):  # in turns, as a model's layers run
        assert torch.equal(a(x_a, w_a, ids_a), want_a), f"seed {seed}"
        assert torch.equal(b(x_b, w_b, ids_b), want_b), f"seed {seed}"
    with pytest.raises(ValueError, match="needs"):
        megamoe.ops.moe_set_workspace(b._handle_id, workspace[:256])
    with pytest.raises(ValueError, match="256-byte aligned"):
        megamoe.ops.moe_set_workspace(a._handle_id, workspace[8:])
    assert megamoe.share_workspace([torch.nn.Linear(2, 2)]) is None
