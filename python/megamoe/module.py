"""NVFP4MoE: a MoE layer (router + experts) running the fused NVFP4 kernels of megamoe."""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.nn.functional as F

from . import _ops

_METHODS = ("softmax", "noaux_tc")

# The code and block-scale buffers, each routed one paired with the shared expert's: with a shared
# expert, each pair is one storage (the kernels address the shared expert's slices as experts
# E.. of one base), so that preparing in place needs no second copy.
_JOINT = (("w13", "shared_w13"), ("w13_scale", "shared_w13_scale"), ("w2", "shared_w2"),
          ("w2_scale", "shared_w2_scale"))
_CHECKPOINT = "checkpoint"  # the buffers' layout before prepare() and after unprepare()
_UNKNOWN = "unknown"        # after a prepare that failed while rewriting the buffers


def _adjacent(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``b`` follows ``a`` in one storage, both contiguous."""
    return (a.device == b.device and a.dtype == b.dtype and a.is_contiguous() and b.is_contiguous()
            and a.device.type != "meta"
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and b.storage_offset() == a.storage_offset() + a.numel())


def _flat(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The 1-D tensor over adjacent ``a`` then ``b``."""
    return a.new_empty(0).set_(a.untyped_storage(), a.storage_offset(), (a.numel() + b.numel(),))


def _split(flat: torch.Tensor, a_shape, b_shape):
    n = _numel(a_shape)
    return flat[:n].view(a_shape), flat[n:].view(b_shape)


_EXPERT_NAMES = ("w13", "w13_scale", "w13_scale_2", "w2", "w2_scale", "w2_scale_2")


def _version_of(t: torch.Tensor):
    try:
        return t._version
    except RuntimeError:  # inference tensors track no version
        return None


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class NVFP4MoE(torch.nn.Module):
    """A Mixture-of-Experts layer whose experts are NVFP4 (W4A16 on Hopper, docs/design.md §2).

    The weights are buffers in the stacked engine layout, with the checkpoint's bits:
    ``w13`` uint8 [E, 2I, H/2] (rows gate then up), ``w13_scale`` float8_e4m3fn [E, 2I, H/16],
    ``w13_scale_2`` f32 [E, 2], ``w2`` uint8 [E, H, I/2], ``w2_scale`` [E, H, I/16],
    ``w2_scale_2`` f32 [E]; the optional shared expert as ``shared_w13`` [2Is, H/2] ...
    ``shared_w2_scale_2`` [1]; the router as ``router_weight`` f32 [E, H] and, for noaux_tc,
    ``e_score_correction_bias`` f32 [E].

    Calls:
      ``forward(hidden)``: routes with the layer's router (fp32 logits);
      ``forward(hidden, router_logits)``: routes the given logits [.., E];
      ``forward(hidden, topk_weights, topk_ids)``: uses the given routing [.., top_k].
    ``hidden`` is bf16 [.., H]; the result has its shape.

    The weights are held once on the GPU: :meth:`prepare` (made on the first eager forward if not
    before) rewrites the code and block-scale buffers in place into the kernels' layout and the
    kernels read them there; prepare before ``torch.compile`` or CUDA-graph capture. After that
    the buffers hold that layout, not the checkpoint's: :meth:`state_dict` and
    :meth:`checkpoint_tensors` give the checkpoint layout back (as CPU tensors, so the device
    never holds a second copy), :meth:`unprepare` restores it in the buffers, and
    :meth:`load_state_dict` takes checkpoint-layout tensors (the next forward prepares again).
    With a shared expert, each routed code or scale buffer and the shared expert's are views of
    one storage. Moving the module keeps the prepacked bytes and re-makes only the prepared layer
    (plan and workspace). Dtype casts (``.to(torch.bfloat16)``, ``.half()``) leave the NVFP4
    buffers as they are. Batches larger than ``max_tokens`` run in chunks of ``max_tokens``.

    ``precision`` is the GEMMs' arithmetic, fixed when the layer is prepared: "w4a16" (exact, the
    default), "w4a8" (fp8 activations, docs/w4a8.md) or "auto" (per batch size, w4a8 where it runs
    and is faster, else w4a16; :meth:`describe` shows the precision a batch size runs at). A
    precision that no GPU kernel of this build serves makes preparing raise NotImplementedError.

    ``tp_group`` (a ``torch.distributed`` process group of R ranks, one GPU each) makes the module
    rank ``tp_group.rank()``'s tensor-parallel slice (megamoe/tp.h): its buffers hold rows
    [r·I/R, (r+1)·I/R) of every expert's gate and up and the same columns of its down (the shared
    expert's the same way), so its state dict is the rank's slice; ``intermediate_size`` stays the
    layer's. Every rank routes every token the same way; forward computes the rank's partial sum in
    fp32, all-reduces it over the group in fp32 and rounds once to bf16 (graph-safe with the NCCL
    backend). I/R and Is/R must be multiples of 64. :meth:`from_checkpoint` and
    :meth:`from_tensors` take the whole layer and keep the rank's slice.

    ``ep_group`` (a :class:`megamoe.EpGroup`, one per process and model) makes the module rank r's
    expert-parallel part: its buffers hold routed experts [r·E/R, (r+1)·E/R) (``num_experts``
    stays the layer's) and the shared expert and router whole. Each rank calls forward on its own
    tokens with global ids; every rank runs each layer the same number of times, so a batch is never
    split (at most the group's ``max_tokens_per_rank`` tokens). :meth:`from_checkpoint` and
    :meth:`from_tensors` take the whole layer. ``tp_group`` and ``ep_group`` do not combine.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 *, shared_intermediate_size: int = 0, method: str = "softmax",
                 renormalize: bool = True, n_group: int = 1, topk_group: int = 1,
                 routed_scaling_factor: float = 1.0, swiglu_limit: Optional[float] = None,
                 has_router: bool = True, max_tokens: int = 4096, deterministic: bool = False,
                 check_ids: bool = True, precision: str = "w4a16", tp_group=None, ep_group=None,
                 device=None):
        super().__init__()
        _ops.check_precision(precision, "NVFP4MoE")
        if method not in _METHODS:
            raise ValueError(f"NVFP4MoE: method {method!r} is not supported; allowed: {_METHODS}")
        for name, value in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
            if value < 16 or value % 16:
                raise ValueError(f"NVFP4MoE: {name} = {value}; it must be a positive multiple "
                                 "of 16 (the kernels need multiples of 64)")
        if shared_intermediate_size < 0 or shared_intermediate_size % 16:
            raise ValueError(f"NVFP4MoE: shared_intermediate_size = {shared_intermediate_size}; "
                             "it must be 0 or a positive multiple of 16")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"NVFP4MoE: top_k = {top_k} must be in [1, num_experts = "
                             f"{num_experts}]")
        if max_tokens < 1:
            raise ValueError(f"NVFP4MoE: max_tokens = {max_tokens} must be >= 1")
        self.hidden_size = int(hidden_size)
        self.intermediate_size = int(intermediate_size)
        self.num_experts = int(num_experts)
        self.top_k = int(top_k)
        self.shared_intermediate_size = int(shared_intermediate_size)
        self.method = method
        self.renormalize = bool(renormalize)
        self.n_group = int(n_group)
        self.topk_group = int(topk_group)
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.swiglu_limit = None if swiglu_limit is None else float(swiglu_limit)
        self.max_tokens = int(max_tokens)
        self.deterministic = bool(deterministic)
        self.precision = precision
        self.check_ids = bool(check_ids)
        self.has_router = bool(has_router)
        if tp_group is not None and ep_group is not None:
            raise ValueError("NVFP4MoE: tp_group and ep_group together are not supported; pass one")
        self.tp_group = tp_group
        self.tp_size = 1 if tp_group is None else int(tp_group.size())
        self.tp_rank = 0 if tp_group is None else int(tp_group.rank())
        # A group of one rank is the single-GPU layer.
        self.ep_group = ep_group if ep_group is not None and ep_group.world_size > 1 else None
        self.expert_first, self.num_local_experts = 0, self.num_experts
        if self.ep_group is not None:
            g = self.ep_group
            self.expert_first, self.num_local_experts = g.expert_range(self.num_experts)
            if self.num_local_experts < top_k:
                raise ValueError(f"NVFP4MoE: {self.num_local_experts} experts per rank is fewer than "
                                 f"top_k = {top_k}; use fewer expert-parallel ranks")
            if self.hidden_size > g.hidden_size or top_k > g.top_k:
                raise ValueError(f"NVFP4MoE: hidden_size = {self.hidden_size} and top_k = {top_k} "
                                 f"exceed the EpGroup's window (made for hidden_size <= "
                                 f"{g.hidden_size}, top_k <= {g.top_k})")
            self.max_tokens = g.max_tokens_per_rank
        if tp_group is not None:
            _ops.tp_range(self.intermediate_size, self.tp_rank, self.tp_size)
            if shared_intermediate_size:
                _ops.tp_range(shared_intermediate_size, self.tp_rank, self.tp_size,
                              "shared_intermediate_size")

        # The buffers hold this rank's slice (all of it without tensor or expert parallelism).
        H, E = self.hidden_size, self.num_local_experts
        I, Is = self.intermediate_size // self.tp_size, shared_intermediate_size // self.tp_size
        shapes = {"w13": (E, 2 * I, H // 2), "w13_scale": (E, 2 * I, H // 16),
                  "w13_scale_2": (E, 2), "w2": (E, H, I // 2), "w2_scale": (E, H, I // 16),
                  "w2_scale_2": (E,)}
        if Is:
            shapes.update({"shared_w13": (2 * Is, H // 2), "shared_w13_scale": (2 * Is, H // 16),
                           "shared_w13_scale_2": (2,), "shared_w2": (H, Is // 2),
                           "shared_w2_scale": (H, Is // 16), "shared_w2_scale_2": (1,)})

        def dtype_of(name):
            return (torch.uint8 if name.endswith(("w13", "w2")) else
                    torch.float32 if name.endswith("_2") else torch.float8_e4m3fn)

        views = {}
        for name, shared_name in self._joint_pairs(Is):  # routed then shared, one storage
            flat = torch.empty(_numel(shapes[name]) + _numel(shapes[shared_name]),
                               dtype=dtype_of(name), device=device)
            views[name], views[shared_name] = _split(flat, shapes[name], shapes[shared_name])
        for name, shape in shapes.items():
            self.register_buffer(name, views[name] if name in views else
                                 torch.empty(shape, dtype=dtype_of(name), device=device))

        if has_router:
            self.register_buffer("router_weight", torch.empty(self.num_experts, H, device=device))
        if method == "noaux_tc":
            self.register_buffer("e_score_correction_bias", torch.empty(self.num_experts, device=device))

        self._handle: Optional[_ops.MoeHandle] = None
        self._handle_id = -1  # what forward passes to the op: an int torch.compile treats as a constant
        self._layout = _CHECKPOINT  # what the code and block-scale buffers hold
        self._packed = {}  # buffer name -> (data_ptr, version) when they were last prepacked
        self.register_state_dict_post_hook(NVFP4MoE._checkpoint_state)
        self.register_load_state_dict_pre_hook(NVFP4MoE._before_load)
        self.register_load_state_dict_post_hook(NVFP4MoE._release_after_load)

    # ---- state dicts: always the checkpoint layout

    def _code_names(self):
        names = ["w13", "w13_scale", "w2", "w2_scale"]
        if self.shared_intermediate_size:
            names += ["shared_w13", "shared_w13_scale", "shared_w2", "shared_w2_scale"]
        return names

    def _joint_pairs(self, shared_size=None):
        # Expert parallelism runs the shared expert as a layer of its own: no joint storage.
        shared_size = self.shared_intermediate_size if shared_size is None else shared_size
        return _JOINT if shared_size and self.ep_group is None else ()

    def _weight_names(self):
        return list(_EXPERT_NAMES) + (list(_ops.SHARED_EXPERT_ARGS)
                                      if self.shared_intermediate_size else [])

    @staticmethod
    def _checkpoint_state(module: "NVFP4MoE", state_dict, prefix, local_metadata) -> None:
        if module._layout == _CHECKPOINT:
            return
        tensors = module.checkpoint_tensors()
        for name in module._weight_names():
            if prefix + name in state_dict:
                state_dict[prefix + name] = tensors[name]

    @staticmethod
    def _before_load(module: "NVFP4MoE", state_dict, prefix, local_metadata, strict, missing_keys,
                     unexpected_keys, error_msgs) -> None:
        if module._layout == _CHECKPOINT:
            return
        incoming = [state_dict.get(prefix + name) for name in module._code_names()]
        aliased = any(t is not None and t.untyped_storage().data_ptr()
                      == module._buffers[name].untyped_storage().data_ptr()
                      for t, name in zip(incoming, module._code_names()))
        if not aliased and all(t is not None and t.shape == module._buffers[name].shape
                               for t, name in zip(incoming, module._code_names())):
            # Every prepacked byte is about to be overwritten with checkpoint-layout bytes.
            module.release()
            module._layout, module._packed = _CHECKPOINT, {}
        elif any(t is not None for t in incoming):
            # A partial load (the buffers it leaves must be in the same layout), or tensors that
            # are the buffers themselves (a state dict taken before prepare): unpack first.
            module.unprepare()

    @staticmethod
    def _release_after_load(module: "NVFP4MoE", incompatible_keys) -> None:
        module.release()  # the loaded bytes replace the ones the prepared layer was made from

    def checkpoint_tensors(self) -> dict:
        """The layer's tensors by buffer name, in the checkpoint layout: the buffers themselves
        where the layer is not prepared in place, else new CPU tensors for every expert tensor
        (unpacked through the host; the device holds no second copy). The values are the
        checkpoint's; the bytes too, but for the codes of blocks whose scale is 0 (given back as 0)
        and ModelOpt's all-zero weights (given back as zero codes and scales, global scale 1)."""
        tensors = dict(self.named_buffers())
        if self._layout == _CHECKPOINT:
            return tensors
        self._check_layout_known("checkpoint_tensors")
        tensors.update(self._unpacked(in_place=False))
        return tensors

    def _unpacked(self, in_place: bool) -> dict:
        """The expert tensors unpacked from self._layout: new CPU tensors, or (in_place) into the
        buffers. Expert parallelism prepacks the shared expert as a one-expert layer of its own."""
        unpack = _ops.unprepack_moe_in_place if in_place else _ops.unprepack_moe
        if self.ep_group is None:
            out = unpack(self._layout, *self._expert_tensors(), shared_expert=self._shared_tensors())
            return {} if in_place else dict(zip(self._weight_names(), out))
        out = unpack(self._layout, *self._expert_tensors())
        tensors = {} if in_place else dict(zip(_EXPERT_NAMES, out))
        if self.shared_intermediate_size:
            one = [t.unsqueeze(0) for t in self._shared_tensors()]
            one[2], one[5] = one[2].view(1, 2), one[5].view(1)  # [E=1, 2] and [E=1] global scales
            shared = unpack(self._layout, *one)
            if not in_place:
                for name, t, like in zip(_ops.SHARED_EXPERT_ARGS, shared, self._shared_tensors()):
                    tensors[name] = t.view(like.shape)
        return tensors

    def unprepare(self) -> "NVFP4MoE":
        """Frees the prepared layer and rewrites the buffers back into the checkpoint layout, in
        place (through the host). Call it before changing a prepared module's buffers; afterwards
        they can be read or changed as checkpoint tensors, and the next forward prepares again."""
        self.release()
        if self._layout != _CHECKPOINT:
            self._check_layout_known("unprepare")
            try:
                self._unpacked(in_place=True)
            except (ValueError, TypeError):
                raise  # refused before anything was written
            except BaseException:
                self._layout = _UNKNOWN
                raise
            self._layout, self._packed = _CHECKPOINT, {}
        return self

    def _record_packed(self) -> None:
        """What the prepacked buffers are now: prepare() refuses them if they change after."""
        self._packed = {name: (buf.data_ptr(), _version_of(buf))
                        for name, buf in self._buffers.items() if name in self._code_names()}

    def _check_packed_unchanged(self) -> None:
        for name, (ptr, version) in self._packed.items():
            buf = self._buffers[name]
            if buf.data_ptr() != ptr or _version_of(buf) != version:
                raise ValueError(
                    f"NVFP4MoE.prepare: {name} was changed after it was prepacked in place, so its "
                    f"bytes are in no known layout (it held {self._layout}). Load weights with "
                    "load_state_dict (checkpoint layout), or call unprepare() before changing a "
                    "prepared module's buffers.")

    def _check_layout_known(self, where: str) -> None:
        if self._layout == _UNKNOWN:
            raise RuntimeError(f"NVFP4MoE.{where}: a prepare() failed while rewriting the weight "
                               "buffers, which now hold neither layout; load the weights again "
                               "(load_state_dict, or a new module)")

    # ---- construction

    @classmethod
    def from_checkpoint(cls, path, layer: int, *, device="cuda", max_tokens: int = 4096,
                        deterministic: bool = False, check_ids: bool = True,
                        precision: str = "w4a16", tp_group=None, ep_group=None) -> "NVFP4MoE":
        """Loads model.layers.{layer}.mlp of a ModelOpt or compressed-tensors NVFP4 checkpoint.

        ``path`` is the model directory (config.json, safetensors files). The codes and block
        scales are the checkpoint's bits; global scales its values (compressed-tensors'
        reciprocal is inverted once, in fp32). On a CUDA ``device`` the layer is also prepared.
        With ``tp_group`` or ``ep_group``, the module keeps its rank's slice (the class docstring).
        """
        desc, tensors = _ops.load_moe_layer(os.fspath(path), layer)
        r = desc["routing"]
        module = cls(desc["hidden_size"], desc["intermediate_size"], desc["num_experts"],
                     r["top_k"], shared_intermediate_size=desc["shared_intermediate_size"],
                     method=r["method"], renormalize=r["renormalize"], n_group=r["n_group"],
                     topk_group=r["topk_group"],
                     routed_scaling_factor=r["routed_scaling_factor"],
                     swiglu_limit=desc["swiglu_limit"], has_router="router_weight" in tensors,
                     max_tokens=max_tokens, deterministic=deterministic, check_ids=check_ids,
                     precision=precision, tp_group=tp_group, ep_group=ep_group, device="meta")
        module._assign(module._rank_slice(tensors))
        module.checkpoint_description = desc
        return module._placed(device)

    @classmethod
    def from_tensors(cls, tensors: dict, top_k: int, *, device="cuda", **options) -> "NVFP4MoE":
        """A layer from stacked NVFP4 tensors named as this module's buffers (see the class
        docstring): w13 ... w2_scale_2, optionally shared_*, router_weight and, for
        ``method="noaux_tc"``, e_score_correction_bias. Sizes come from the tensors' shapes;
        ``options`` as for the constructor. On a CUDA ``device`` the layer is also prepared.
        With ``tp_group`` in ``options``, the tensors are the whole layer's and the module keeps
        its rank's slice.
        """
        E, two_i, half_h = tensors["w13"].shape
        shared = tensors.get("shared_w13")
        module = cls(2 * half_h, two_i // 2, E, top_k,
                     shared_intermediate_size=0 if shared is None else shared.shape[0] // 2,
                     has_router="router_weight" in tensors, device="meta", **options)
        module._assign(module._rank_slice(tensors))
        return module._placed(device)

    def _rank_slice(self, tensors: dict) -> dict:
        if self.tp_group is not None:
            return _ops.tp_slice(tensors, self.tp_rank, self.tp_size)
        if self.ep_group is not None:  # the rank's experts; the shared expert and router whole
            first, count = self.expert_first, self.num_local_experts
            return {name: t[first:first + count] if name in _EXPERT_NAMES else t
                    for name, t in tensors.items()}
        return tensors

    @classmethod
    def from_float(cls, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, top_k: int, *,
                   router_weight: Optional[torch.Tensor] = None,
                   e_score_correction_bias: Optional[torch.Tensor] = None,
                   shared_gate_up_proj: Optional[torch.Tensor] = None,
                   shared_down_proj: Optional[torch.Tensor] = None, device="cuda",
                   **options) -> "NVFP4MoE":
        """Quantizes unquantized experts (ModelOpt recipe, :func:`megamoe.quantize_experts`).

        ``gate_up_proj`` [E, 2I, H] rows gate then up, ``down_proj`` [E, H, I] (the transformers
        layout); the shared expert as [2Is, H] and [H, Is]; ``options`` as for the constructor.
        """
        tensors = _ops.quantize_experts(gate_up_proj, down_proj)
        if shared_gate_up_proj is not None:
            shared = _ops.quantize_experts(shared_gate_up_proj, shared_down_proj)
            tensors.update({"shared_" + name: t for name, t in shared.items()})
        if router_weight is not None:
            tensors["router_weight"] = router_weight.float()
        if e_score_correction_bias is not None:
            tensors["e_score_correction_bias"] = e_score_correction_bias.float()
        return cls.from_tensors(tensors, top_k, device=device, **options)

    def _assign(self, tensors: dict) -> None:
        self._set_buffers(tensors)
        self._layout, self._packed = _CHECKPOINT, {}
        self._join()

    def _join(self) -> None:
        """Makes each routed code or scale buffer and the shared expert's one storage again where
        they are not (after a buffer was replaced): one copy of the pair, on its device."""
        for name, shared_name in self._joint_pairs():
            a, b = self._buffers[name], self._buffers[shared_name]
            if _adjacent(a, b):
                continue
            flat = torch.empty(a.numel() + b.numel(), dtype=a.dtype, device=a.device)
            routed, shared = _split(flat, a.shape, b.shape)
            routed.copy_(a)
            shared.copy_(b.to(a.device))
            self._buffers[name], self._buffers[shared_name] = routed, shared

    def _set_buffers(self, tensors: dict) -> None:
        unknown = set(tensors) - {name for name, _ in self.named_buffers()}
        if unknown:
            raise ValueError(f"NVFP4MoE: unexpected tensors {sorted(unknown)}")
        for name, buf in self.named_buffers():
            if name not in tensors:
                raise ValueError(f"NVFP4MoE: no tensor for buffer {name!r}")
            t = tensors[name]
            if t.shape != buf.shape or t.dtype != buf.dtype:
                raise ValueError(f"NVFP4MoE: {name} has shape {tuple(t.shape)} and dtype {t.dtype}; "
                                 f"expected {tuple(buf.shape)} and {buf.dtype}")
            setattr(self, name, t.cpu().contiguous())

    def _placed(self, device) -> "NVFP4MoE":
        self.to(device)
        if torch.device(device).type == "cuda":
            self.prepare()
        return self

    # ---- the prepared layer

    def prepare(self, max_tokens: Optional[int] = None) -> "NVFP4MoE":
        """(Re)builds the prepared layer the kernels run (CUDA weights only).

        The first time, a one-time load step: the buffers are copied to the host, every scale is
        checked, and the prepacked layout is written back over them in place. Afterwards (a move,
        a new ``max_tokens``) only the plan and workspace are made. Call it after loading weights
        and before torch.compile or CUDA-graph capture.
        """
        if max_tokens is not None:
            if max_tokens < 1:
                raise ValueError(f"NVFP4MoE.prepare: max_tokens = {max_tokens} must be >= 1")
            self.max_tokens = int(max_tokens)
        self.release()
        if self.w13.device.type != "cuda":
            raise ValueError(f"NVFP4MoE.prepare: the weights are on {self.w13.device}; move the "
                             "module to a CUDA device first (module.cuda())")
        self._check_layout_known("prepare")
        if self._layout != _CHECKPOINT:
            self._check_packed_unchanged()
        device_layout = _ops.ops.moe_prepacked_layout(self.w13.device)
        if self._layout not in (_CHECKPOINT, device_layout):
            self.unprepare()  # prepacked for another architecture
        self._join()
        in_place = self._layout == _CHECKPOINT
        try:
            self._handle = self._make_handle(prepacked=not in_place)
        except (ValueError, TypeError, NotImplementedError):
            raise  # refused before anything was written
        except BaseException:
            if in_place:
                self._layout = _UNKNOWN
            raise
        if in_place:
            self._layout = device_layout
            self._record_packed()
        self._handle_id = int(self._handle)
        return self

    def _make_handle(self, prepacked: bool):
        if self.ep_group is not None:
            from .ep import EpLayerHandle

            shared = self._shared_tensors()
            return EpLayerHandle(_ops.ops.ep_prepare(
                self.ep_group._handle, *self._expert_tensors(), num_experts=self.num_experts,
                top_k=self.top_k, swiglu_limit=self.swiglu_limit, deterministic=self.deterministic,
                prepacked=prepacked,
                **({} if shared is None else dict(zip(_ops.SHARED_EXPERT_ARGS, shared)))))
        options = dict(top_k=self.top_k, max_tokens=self.max_tokens,
                       swiglu_limit=self.swiglu_limit, deterministic=self.deterministic,
                       shared_expert=self._shared_tensors(), precision=self.precision)
        if prepacked:
            return _ops.prepare_moe(*self._expert_tensors(), prepacked=True, **options)
        return _ops.prepare_moe_in_place(*self._expert_tensors(), **options)

    def release(self) -> None:
        """Frees the prepared layer's plan and workspace (the next forward makes new ones); the
        buffers keep the layout they hold."""
        if self._handle is not None:
            self._handle.release()
        self._handle, self._handle_id = None, -1

    def describe(self, tokens: int = 1) -> str:
        """The prepared layer, its memory, and the kernel configuration for ``tokens``."""
        if self._handle is None:
            return f"{type(self).__name__} (not prepared)"
        return self._handle.describe(tokens)

    def _apply(self, fn, recurse=True):
        # Device moves apply; dtype casts do not (the NVFP4 buffers have fixed dtypes). Any
        # move invalidates the prepared layer, which points at the old tensors.
        self.release()

        def keep_dtype(t):
            moved = fn(t)
            return moved if moved.dtype == t.dtype else t.to(moved.device)

        # Each joint pair moves as its one storage (moved apart, the pair would need a second
        # copy to be joined again). None hides a buffer from Module._apply and keeps its order.
        joint = []
        for name, shared_name in self._joint_pairs():
            a, b = self._buffers[name], self._buffers[shared_name]
            if _adjacent(a, b) or (a.is_meta and b.is_meta and a.dtype == b.dtype):
                joint.append((name, shared_name, a, b))
                self._buffers[name] = self._buffers[shared_name] = None
        try:
            result = super()._apply(keep_dtype, recurse)
        except BaseException:
            for name, shared_name, a, b in joint:
                self._buffers[name], self._buffers[shared_name] = a, b
            raise
        for name, shared_name, a, b in joint:
            flat = (torch.empty(a.numel() + b.numel(), dtype=a.dtype, device="meta") if a.is_meta
                    else _flat(a, b))
            self._buffers[name], self._buffers[shared_name] = _split(keep_dtype(flat), a.shape, b.shape)
        if self._packed:
            self._record_packed()  # the prepacked bytes, moved
        return result

    def __getstate__(self):
        # A copy (deepcopy, pickle) is not prepared: the handle belongs to this module.
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__.copy()
        state = dict(state)
        state["_handle"], state["_handle_id"] = None, -1
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        if self._packed:
            self._record_packed()  # the copy's own prepacked buffers

    def _expert_tensors(self):
        return (self.w13, self.w13_scale, self.w13_scale_2, self.w2, self.w2_scale,
                self.w2_scale_2)

    def _shared_tensors(self):
        if not self.shared_intermediate_size:
            return None
        return tuple(getattr(self, name) for name in _ops.SHARED_EXPERT_ARGS)

    # ---- forward

    def router_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [T, E] of hidden [T, H] with the layer's router weight."""
        if not self.has_router:
            raise ValueError("NVFP4MoE: this layer has no router weight; pass router_logits or "
                             "(topk_weights, topk_ids) to forward")
        return F.linear(hidden.float(), self.router_weight)

    def route(self, router_logits: torch.Tensor):
        """(topk_weights [T, k] fp32, topk_ids [T, k] int32) of logits [T, E], on the GPU."""
        return _ops.ops.route(
            router_logits.float().contiguous(), top_k=self.top_k, method=self.method,
            renormalize=self.renormalize, n_group=self.n_group, topk_group=self.topk_group,
            routed_scaling_factor=self.routed_scaling_factor,
            e_score_correction_bias=self.e_score_correction_bias if self.method == "noaux_tc" else None)

    def forward(self, hidden: torch.Tensor, *routing: torch.Tensor) -> torch.Tensor:
        if len(routing) > 2:
            raise TypeError("NVFP4MoE.forward takes (hidden), (hidden, router_logits) or "
                            f"(hidden, topk_weights, topk_ids); got {1 + len(routing)} tensors")
        if hidden.shape[-1] != self.hidden_size:
            raise ValueError(f"NVFP4MoE: hidden has shape {tuple(hidden.shape)}; the last "
                             f"dimension must be hidden_size = {self.hidden_size}")
        x = hidden.reshape(-1, self.hidden_size).contiguous()
        if len(routing) == 2:
            for name, t in zip(("topk_weights", "topk_ids"), routing):
                if t.dim() == 0 or t.shape[-1] != self.top_k:
                    raise ValueError(f"NVFP4MoE: {name} has shape {tuple(t.shape)}; its last "
                                     f"dimension must be top_k = {self.top_k}")
            topk_weights, topk_ids = (t.reshape(-1, self.top_k).contiguous() for t in routing)
        else:
            logits = routing[0].reshape(-1, self.num_experts) if routing else self.router_logits(x)
            topk_weights, topk_ids = self.route(logits)
        handle = self._prepared_handle()
        if self.ep_group is not None:
            # Every rank runs the layer the same number of times: no chunking here.
            shared = self._shared_tensors()
            out = _ops.ops.fused_moe_nvfp4_ep(
                x, *self._expert_tensors(), topk_weights, topk_ids, handle=handle,
                check_ids=self.check_ids,
                **({} if shared is None else dict(zip(_ops.SHARED_EXPERT_ARGS, shared))))
            return out.reshape(hidden.shape)
        m = self.max_tokens
        partial = self.tp_group is not None  # the rank's fp32 partial sum, reduced below
        if x.shape[0] <= m:
            out = self._experts(x, topk_weights, topk_ids, handle, partial)
        else:
            out = torch.cat([self._experts(x[i:i + m], topk_weights[i:i + m], topk_ids[i:i + m],
                                           handle, partial) for i in range(0, x.shape[0], m)])
        if partial:
            torch.distributed.all_reduce(out, group=self.tp_group)
            out = out.to(torch.bfloat16)
        return out.reshape(hidden.shape)

    def _prepared_handle(self) -> int:
        if self._handle_id < 0:
            capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
            if torch.compiler.is_compiling() or capturing:
                raise RuntimeError(
                    "NVFP4MoE: the layer is not prepared; call prepare() (or run one eager "
                    "forward) before torch.compile or CUDA-graph capture: preparing copies and "
                    "prepacks the weights, which can be neither traced nor captured")
            self.prepare()
        return self._handle_id

    def _experts(self, x, topk_weights, topk_ids, handle: int, fp32_output: bool = False) -> torch.Tensor:
        shared = self._shared_tensors()
        return _ops.ops.fused_moe_nvfp4(
            x, *self._expert_tensors(), topk_weights, topk_ids, handle=handle,
            swiglu_limit=self.swiglu_limit, deterministic=self.deterministic,
            check_ids=self.check_ids, fp32_output=fp32_output,
            **({} if shared is None else dict(zip(_ops.SHARED_EXPERT_ARGS, shared))))

    def extra_repr(self) -> str:
        parts = [f"hidden_size={self.hidden_size}", f"intermediate_size={self.intermediate_size}",
                 f"num_experts={self.num_experts}", f"top_k={self.top_k}"]
        if self.shared_intermediate_size:
            parts.append(f"shared_intermediate_size={self.shared_intermediate_size}")
        parts.append(f"method={self.method}")
        if self.method == "noaux_tc":
            parts.append(f"n_group={self.n_group}, topk_group={self.topk_group}")
        if self.routed_scaling_factor != 1.0:
            parts.append(f"routed_scaling_factor={self.routed_scaling_factor}")
        if self.swiglu_limit is not None:
            parts.append(f"swiglu_limit={self.swiglu_limit}")
        if self.precision != "w4a16":
            parts.append(f"precision={self.precision}")
        if self.tp_group is not None:
            parts.append(f"tp_rank={self.tp_rank}, tp_size={self.tp_size}")
        if self.ep_group is not None:
            parts.append(f"ep_rank={self.ep_group.rank}, ep_size={self.ep_group.world_size}, "
                         f"experts=[{self.expert_first}, {self.expert_first + self.num_local_experts})")
        parts.append(f"max_tokens={self.max_tokens}, prepared={self._handle is not None}")
        if self._layout != _CHECKPOINT:
            parts.append(f"layout={self._layout}")
        return ", ".join(parts)


def share_workspace(modules) -> Optional[torch.Tensor]:
    """Gives the prepared :class:`NVFP4MoE` layers among ``modules`` (e.g. ``model.modules()``;
    other modules are skipped) one workspace, the largest they need, instead of one each: a model's
    layers run one after another, so one suffices (DeepSeek-V3 at ``max_tokens=4096``: 0.27 GB
    instead of 0.27 GB per layer). Layers that could run at the same time (on two streams) must
    not share. Unprepared layers are prepared first. Call it after preparing and before capturing
    CUDA graphs; preparing a layer again (a move, a new ``max_tokens``) gives it its own workspace
    again. Expert-parallel layers are skipped: they use their EpGroup's scratch. Returns the
    workspace (None where no layer qualifies)."""
    layers = [m for m in modules if isinstance(m, NVFP4MoE) and m.ep_group is None]
    if not layers:
        return None
    devices = {m.w13.device for m in layers}
    if len(devices) != 1:
        raise ValueError(f"megamoe.share_workspace: the layers are on {sorted(map(str, devices))}; "
                         "one workspace serves the layers of one device")
    handles = [m._prepared_handle() for m in layers]
    need = max(_ops.ops.moe_workspace_bytes(h) for h in handles)
    workspace = torch.empty(need, dtype=torch.uint8, device=devices.pop())
    for h in handles:
        _ops.ops.moe_set_workspace(h, workspace)
    return workspace
