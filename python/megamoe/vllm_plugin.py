"""The vLLM plugin: ModelOpt NVFP4 MoE layers on Hopper through megamoe's fused layer.

Installed with the ``megamoe[vllm]`` extra, vLLM loads it from the entry-point group
``vllm.general_plugins`` in every process; :func:`register` adds the quantization method
``nvfp4_megamoe`` ("megamoe" alone already names DeepGEMM's Mega MoE in vLLM), chosen with
``--quantization nvfp4_megamoe`` on a ModelOpt NVFP4 checkpoint. Linear layers keep vLLM's
ModelOpt handling; the MoE layers keep vLLM's parameter names and loader (``create_weights`` is
ModelOpt's) and run a ``FusedMoEKernel`` whose experts class, :class:`MegaMoeExperts`, calls
``megamoe.fused_moe_nvfp4`` on the rank's experts prepared in place (held once). Written against
vLLM 0.33 (the extra pins ``vllm>=0.33,<0.34``): the modular-kernel interface moves between
minor versions. README "Use with vLLM" says what is supported and what was tested.

Settings (environment, read when a layer is made): ``MEGAMOE_VLLM_PRECISION`` ("w4a16", the
exact default; "w4a8" or "auto"), ``MEGAMOE_VLLM_MAX_TOKENS`` (the largest batch one call of the
op runs, default 8192 or vLLM's max_num_batched_tokens if smaller; larger batches run in chunks).
"""

from __future__ import annotations

import os
from typing import Optional

import torch

import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.logger import init_logger
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.all2all_utils import maybe_make_prepare_finalize
from vllm.model_executor.layers.fused_moe.config import (FusedMoEConfig,
                                                         FusedMoEParallelConfig,
                                                         FusedMoEQuantConfig,
                                                         nvfp4_w4a16_moe_quant_config)
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceNoOP
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.modelopt import (ModelOptNvFp4Config,
                                                              ModelOptNvFp4FusedMoE,
                                                              algos_owned_by)
from vllm.model_executor.layers.quantization.utils.quant_utils import (QuantKey, kNvfp4Dynamic,
                                                                       kNvfp4Static)
from vllm.model_executor.utils import is_weights_pre_processed
from vllm.platforms import current_platform

from . import vllm_adapter

logger = init_logger(__name__)

QUANTIZATION_NAME = "nvfp4_megamoe"
DEFAULT_MAX_TOKENS = 8192


def _device_capability() -> Optional[tuple[int, int]]:
    """(major, minor) of the current CUDA device, None where vLLM runs on no CUDA device."""
    if not current_platform.is_cuda():
        return None
    capability = current_platform.get_device_capability()
    return None if capability is None else (capability.major, capability.minor)


def _parallel_reason(p: FusedMoEParallelConfig) -> Optional[str]:
    """None for the standard-format paths that give the experts global ids and an expert_map."""
    if p.enable_eplb:
        return "expert-parallel load balancing (EPLB): the prepared layer's experts are fixed"
    if p.use_batched_activation_format:
        return (f"the batched activation format of all2all backend {p.all2all_backend!r} (DeepEP "
                "low-latency, NIXL EP); use allgather_reducescatter or deepep_high_throughput")
    if p.use_passthrough_all2all:
        return "the passthrough all2all backend (its experts dispatch themselves)"
    if p.use_all2all_kernels and not (p.use_ag_rs_all2all_kernels or p.use_deepep_ht_kernels):
        return (f"all2all backend {p.all2all_backend!r} (supported: allgather_reducescatter, "
                "deepep_high_throughput, or none)")
    return None


class MegaMoeExperts(mk.FusedMoEExpertsModular):
    """vLLM's experts interface over megamoe's fused layer (W4A16: bf16 activations as given).

    Standard activation format; SiLU-gated experts with an optional ``swiglu_limit``; ids mapped
    through ``expert_map`` (-1 skipped); the routing weights applied and the top-k contributions
    summed by the op (no separate reduce); batches above the prepared ``max_tokens`` in chunks; no
    host synchronisation (CUDA-graph safe). The weights are prepared in place on the layer's own
    parameters by :meth:`process_weights_after_loading`.
    """

    # The op and its load-time steps: None is megamoe's CUDA ops; tests put a CPU reference here.
    backend: Optional[vllm_adapter.Backend] = None

    def __init__(self, moe_config: FusedMoEConfig, quant_config: FusedMoEQuantConfig):
        super().__init__(moe_config, quant_config)
        self.prepared: Optional[vllm_adapter.PreparedExperts] = None

    @staticmethod
    def activation_format() -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.Standard

    @staticmethod
    def _supports_current_device() -> bool:
        return _device_capability() == vllm_adapter.SUPPORTED_CAPABILITY

    @staticmethod
    def _supports_no_act_and_mul() -> bool:
        return False

    @staticmethod
    def _supports_quant_scheme(weight_key: Optional[QuantKey],
                               activation_key: Optional[QuantKey]) -> bool:
        # NVFP4 weights; activations stay bf16 (a W4A4 checkpoint's input scales go unused, as in
        # vLLM's own W4A16 backends on Hopper).
        return weight_key == kNvfp4Static and activation_key in (None, kNvfp4Dynamic)

    @staticmethod
    def _supports_activation(activation: MoEActivation) -> bool:
        return activation == MoEActivation.SILU

    @staticmethod
    def _supports_parallel_config(moe_parallel_config: FusedMoEParallelConfig) -> bool:
        return _parallel_reason(moe_parallel_config) is None

    @staticmethod
    def _supports_shape(hidden_dim: int) -> bool:
        return hidden_dim > 0 and hidden_dim % vllm_adapter.SHAPE_MULTIPLE == 0

    @staticmethod
    def is_supported_config(cls, moe_config: FusedMoEConfig, weight_key: Optional[QuantKey],
                            activation_key: Optional[QuantKey],
                            activation_format: mk.FusedMoEActivationFormat):
        """vLLM's checks, with the reasons that are megamoe's own spelled out, then the layer's
        shape (the prepared layer's rules)."""
        def refuse(reason):
            return False, f"kernel does not support {reason}"

        if not cls._supports_current_device():
            capability = _device_capability()
            where = ("no CUDA device" if capability is None
                     else f"compute capability {capability[0]}.{capability[1]}")
            return refuse(f"{where} (megamoe's kernels run on Hopper, sm_90)")
        reason = _parallel_reason(moe_config.moe_parallel_config)
        if reason is not None:
            return refuse(reason)
        if not cls._supports_activation(moe_config.activation):
            return refuse(f"activation {moe_config.activation.value!r} (SiLU-gated experts only: "
                          "silu(gate) * up)")
        supported, reason = mk.FusedMoEExperts.is_supported_config(
            cls, moe_config, weight_key, activation_key, activation_format)
        if not supported:
            return supported, reason
        reason = vllm_adapter.unsupported_reason(
            hidden_size=moe_config.hidden_dim,
            intermediate_size=moe_config.intermediate_size_per_partition,
            num_local_experts=moe_config.num_local_experts, top_k=moe_config.experts_per_token,
            dtype=moe_config.in_dtype, has_bias=moe_config.has_bias,
            swiglu_alpha=moe_config.swiglu_alpha, swiglu_beta=moe_config.swiglu_beta)
        return (True, None) if reason is None else refuse(reason)

    def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts,
                         expert_tokens_meta, activation):
        # The op keeps its own workspace (one per device, megamoe.vllm_adapter.SharedWorkspace)
        # and writes the weighted, reduced [M, K] output.
        return (0,), (0,), (M, K)

    def finalize_weight_and_reduce_impl(self) -> mk.TopKWeightAndReduce:
        return TopKWeightAndReduceNoOP()

    def max_tokens(self) -> int:
        """The batch one call of the op runs (larger ones run in chunks)."""
        cap = int(os.environ.get("MEGAMOE_VLLM_MAX_TOKENS", DEFAULT_MAX_TOKENS))
        if cap < 1:
            raise ValueError(f"MEGAMOE_VLLM_MAX_TOKENS = {cap}; it must be at least 1")
        return max(1, min(cap, int(self.moe_config.max_num_tokens)))

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Prepares the layer's experts in place on its parameters (held once)."""
        precision = os.environ.get("MEGAMOE_VLLM_PRECISION", "w4a16")
        self.prepared = vllm_adapter.PreparedExperts(
            vllm_adapter.checkpoint_tensors(layer), top_k=self.moe_config.experts_per_token,
            max_tokens=self.max_tokens(), swiglu_limit=self.moe_config.swiglu_limit,
            precision=precision, backend=self.backend)
        logger.debug("megamoe: prepared %s (%d local experts, max_tokens=%d, %s)",
                     getattr(layer, "layer_name", "layer"), self.prepared.num_experts,
                     self.prepared.max_tokens, precision)

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
              global_num_experts, expert_map, a1q_scale, a2_scale, workspace13, workspace2,
              expert_tokens_meta, apply_router_weight_on_input):
        if self.prepared is None:
            raise RuntimeError("megamoe: the experts were not prepared (vLLM calls "
                               "process_weights_after_loading after loading the weights)")
        if activation != MoEActivation.SILU:
            raise ValueError(f"megamoe: activation {activation}; only SiLU is supported")
        if apply_router_weight_on_input:
            # prepare() has scaled the input by the (top-1) weight already.
            topk_weights = torch.ones_like(topk_weights)
        self.prepared.forward(hidden_states, topk_weights, topk_ids, expert_map, out=output)
        return None


def _activation_format(moe: FusedMoEConfig) -> mk.FusedMoEActivationFormat:
    return (mk.FusedMoEActivationFormat.BatchedExperts
            if moe.moe_parallel_config.use_batched_activation_format
            else mk.FusedMoEActivationFormat.Standard)


class ModelOptNvFp4MegaMoeMethod(ModelOptNvFp4FusedMoE):
    """ModelOpt's NVFP4 MoE method (its weights, names and loader) without vLLM's backend oracle
    and weight conversion: the layer runs :class:`MegaMoeExperts` in a ``FusedMoEKernel``.

    The name must contain "ModelOpt": vLLM's expert weight loader picks the ModelOpt scale rules by
    the method's class name."""

    def __init__(self, quant_config: ModelOptNvFp4Config, moe_config: FusedMoEConfig) -> None:
        # ModelOptNvFp4FusedMoE.__init__ would pick one of vLLM's backends: skip it.
        FusedMoEMethodBase.__init__(self, moe_config)
        self.quant_config = quant_config
        self.use_a16 = quant_config.quant_method == "W4A16_NVFP4"
        if quant_config.moe_activation_override is not None:
            raise ValueError(f"{QUANTIZATION_NAME}: the MoE activation override "
                             f"{quant_config.moe_activation_override} does not apply: megamoe "
                             "runs bf16 activations (W4A16)")
        self.per_token_activation = False
        self.nvfp4_backend = None
        self.use_global_sf = False  # create_weights: input scales per local expert
        self.experts_cls = MegaMoeExperts
        supported, reason = MegaMoeExperts.is_supported_config(
            MegaMoeExperts, moe_config, kNvfp4Static, None if self.use_a16 else kNvfp4Dynamic,
            _activation_format(moe_config))
        if not supported:
            raise ValueError(f"{QUANTIZATION_NAME}: megamoe cannot run this MoE layer: {reason}. "
                             "Serve it without --quantization nvfp4_megamoe (vLLM's own "
                             "ModelOpt NVFP4 backends).")

    def get_fused_moe_quant_config(self, layer) -> FusedMoEQuantConfig:
        # W4A16: no activation quantization in prepare(); both w13 global scales are kept.
        return nvfp4_w4a16_moe_quant_config(
            g1_alphas=layer.w13_weight_scale_2, g2_alphas=layer.w2_weight_scale_2,
            w1_scale=layer.w13_weight_scale, w2_scale=layer.w2_weight_scale,
            gemm1_clamp_limit=self.moe.swiglu_limit)

    def process_weights_after_loading(self, layer) -> None:
        if is_weights_pre_processed():
            raise RuntimeError(f"{QUANTIZATION_NAME}: pre-processed weights are another "
                               "backend's layout; load the ModelOpt checkpoint itself")
        self.moe_quant_config = self.get_fused_moe_quant_config(layer)
        prepare_finalize = maybe_make_prepare_finalize(
            moe=self.moe, quant_config=self.moe_quant_config,
            routing_tables=layer._expert_routing_tables(), allow_new_interface=True,
            use_monolithic=False)
        experts = MegaMoeExperts(moe_config=self.moe, quant_config=self.moe_quant_config)
        self.moe_kernel = mk.FusedMoEKernel(prepare_finalize, experts)
        experts.process_weights_after_loading(layer)

    @property
    def supports_eplb(self) -> bool:
        return False


class MegaMoeNvFp4Config(ModelOptNvFp4Config):
    """ModelOpt NVFP4 (``quant_algo`` NVFP4 or W4A16_NVFP4) with the MoE layers on megamoe; only
    when asked for by name (``--quantization nvfp4_megamoe``), never by the checkpoint alone."""

    FusedMoEMethodCls = ModelOptNvFp4MegaMoeMethod

    def get_name(self):
        return QUANTIZATION_NAME

    @classmethod
    def get_min_capability(cls) -> int:
        return 90

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None):
        if user_quant != QUANTIZATION_NAME:
            return None
        algo = cls._extract_modelopt_quant_algo(hf_quant_cfg)
        allowed = algos_owned_by("modelopt_fp4")
        if algo in allowed:
            return QUANTIZATION_NAME
        # Refused here, by name: vLLM's own overrides would otherwise run some checkpoints (ModelOpt
        # FP8) with another method than the one asked for, without a word.
        method = (hf_quant_cfg or {}).get("quant_method")
        raise ValueError(
            f"--quantization {QUANTIZATION_NAME} runs ModelOpt NVFP4 checkpoints (quant_method "
            f"modelopt, quant_algo {' or '.join(allowed)}); this one has quant_method {method!r}"
            + (f", quant_algo {algo!r}" if algo else ""))


_registered = False


def register() -> None:
    """The ``vllm.general_plugins`` entry point: registers ``nvfp4_megamoe`` (once per process;
    vLLM calls it in every process it starts)."""
    global _registered
    if not _registered:
        register_quantization_config(QUANTIZATION_NAME)(MegaMoeNvFp4Config)
        _registered = True
