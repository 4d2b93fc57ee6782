"""Independent torch oracles for the megamoe tests: NVFP4 decode and the ModelOpt recipe, routing
(softmax / noaux_tc) and the W4A16 MoE forward of docs/design.md §2, written from the spec with plain
torch ops (no megamoe code), in float64 where the spec computes exactly.
"""

from __future__ import annotations

import torch

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=torch.float32)


def decode_codes(codes: torch.Tensor) -> torch.Tensor:
    """Packed e2m1 [.., N, K/2] -> fp32 [.., N, K]; element 2j is the low nibble of byte j."""
    c = codes.cpu().long()
    lut = E2M1
    return torch.stack([lut[c & 0xF], lut[c >> 4]], dim=-1).flatten(-2)


def decode_scales(scales: torch.Tensor) -> torch.Tensor:
    """ue4m3 [.., N, K/16] (float8_e4m3fn or its bytes) -> fp32 [.., N, K], one per 16."""
    s = scales.cpu()
    if s.dtype == torch.uint8:
        s = s.view(torch.float8_e4m3fn)
    return s.float().repeat_interleave(16, dim=-1)


def dequantize(codes, scales, global_scale) -> torch.Tensor:
    """fp32 e2m1 * ue4m3 * global: the product of the first two is exact, the last one rounds."""
    g = torch.as_tensor(global_scale, dtype=torch.float32).cpu()
    g = g.reshape(g.shape + (1, 1)) if g.dim() == 1 and codes.dim() == 3 else g.reshape(())
    return (decode_codes(codes) * decode_scales(scales)) * g


def quantize_modelopt(w: torch.Tensor):
    """The ModelOpt weight recipe (docs/design.md §2) in fp32 torch ops, for one [N, K] weight."""
    w = w.cpu().float()
    n, k = w.shape
    amax = w.abs().max()
    # The GPU export's form, megamoe's default (docs/design.md §2): PyTorch on a CUDA tensor computes
    # ModelOpt's amax / 2688 as amax * fl32(1/2688); this tensor is on the CPU, so write it out.
    s2 = amax * torch.tensor(1.0 / 2688.0, dtype=torch.float32)
    blocks = w.reshape(n, k // 16, 16)
    ratio = blocks.abs().amax(dim=-1) / (6.0 * s2)
    ratio = torch.where(ratio == 0, torch.ones_like(ratio), ratio).clamp(2.0 ** -9, 448.0)
    scales = ratio.to(torch.float8_e4m3fn)
    q = blocks / (scales.float() * s2).unsqueeze(-1)
    a = q.abs()
    mag = ((a > 0.25).int() + (a >= 0.75).int() + (a > 1.25).int() + (a >= 1.75).int()
           + (a > 2.5).int() + (a >= 3.5).int() + (a > 5.0).int())
    code = (mag | torch.where(q < 0, 8, 0)).reshape(n, k).to(torch.uint8)
    packed = code[:, 0::2] | (code[:, 1::2] << 4)
    return packed, scales, s2.reshape(())


def route(logits: torch.Tensor, top_k: int, method: str = "softmax", renormalize: bool = True,
          n_group: int = 1, topk_group: int = 1, routed_scaling_factor: float = 1.0,
          bias: torch.Tensor | None = None):
    """(weights f32 [T, k], ids int64 [T, k]): scores in float64, selections by (score desc,
    index asc) through stable sorts, weights rounded to fp32 once."""
    l = logits.detach().cpu().double()
    T, E = l.shape
    if method == "softmax":
        p = torch.exp(l - l.max(dim=-1, keepdim=True).values)
        base = p / p.sum(dim=-1, keepdim=True)
        choice = base
    else:
        base = 1.0 / (1.0 + torch.exp(-l))
        choice = base + (0.0 if bias is None else bias.detach().cpu().double())
        groups = choice.reshape(T, n_group, E // n_group)
        top2 = groups.sort(dim=-1, descending=True).values[..., :2]
        gscore = top2.sum(dim=-1) if E // n_group > 1 else groups[..., 0]
        kept = torch.sort(-gscore, dim=-1, stable=True).indices[:, :topk_group]
        mask = torch.zeros(T, n_group, dtype=torch.bool).scatter_(1, kept, True)
        mask = mask.repeat_interleave(E // n_group, dim=1)
        choice = torch.where(mask, choice, torch.full_like(choice, -torch.inf))
    ids = torch.sort(-choice, dim=-1, stable=True).indices[:, :top_k]
    w = base.gather(1, ids)
    if renormalize:
        s = w.sum(dim=-1, keepdim=True)
        w = torch.where(s > 0, w / s, w)
    return (w * routed_scaling_factor).float(), ids


def moe_forward(hidden: torch.Tensor, layer: dict, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, swiglu_limit: float | None = None) -> torch.Tensor:
    """The W4A16 forward of docs/design.md §2 in float64 (fp32 [T, H] before the final bf16 rounding).

    ``layer`` holds the stacked tensors (w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2 and
    optionally shared_*). Per (token, expert): g, u = x . W^T times each half's global scale;
    optional clamp; a = bf16(silu(g) * u); y = a . Wd^T * s2; out = sum_k w_k y_k + shared.
    """
    x = hidden.detach().cpu().double()
    T = x.shape[0]
    ids = topk_ids.detach().cpu().long()
    tw = topk_weights.detach().cpu().double()

    def expert(xs, codes13, scales13, s13, codes2, scales2, s2):
        w13 = (decode_codes(codes13) * decode_scales(scales13)).double()
        wd = (decode_codes(codes2) * decode_scales(scales2)).double()
        inter = w13.shape[0] // 2
        g = (xs @ w13[:inter].T) * float(s13[0])
        u = (xs @ w13[inter:].T) * float(s13[1])
        if swiglu_limit is not None:
            g = g.clamp(max=swiglu_limit)
            u = u.clamp(-swiglu_limit, swiglu_limit)
        a = (g / (1.0 + torch.exp(-g)) * u).to(torch.bfloat16).double()
        return (a @ wd.T) * float(s2)

    out = torch.zeros(T, x.shape[1], dtype=torch.float64)
    for e in ids.unique().tolist():
        rows, slots = (ids == e).nonzero(as_tuple=True)
        y = expert(x[rows], layer["w13"][e], layer["w13_scale"][e], layer["w13_scale_2"][e].cpu(),
                   layer["w2"][e], layer["w2_scale"][e], layer["w2_scale_2"][e].cpu())
        out.index_add_(0, rows, y * tw[rows, slots].unsqueeze(1))
    if layer.get("shared_w13") is not None:
        out += expert(x, layer["shared_w13"], layer["shared_w13_scale"],
                      layer["shared_w13_scale_2"].cpu(), layer["shared_w2"],
                      layer["shared_w2_scale"], layer["shared_w2_scale_2"].cpu().reshape(()))
    return out


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    g, w = got.detach().cpu().double(), want.detach().cpu().double()
    return float((g - w).norm() / w.norm().clamp_min(1e-300))
