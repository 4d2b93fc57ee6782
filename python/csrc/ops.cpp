// The schemas of the megamoe torch ops: the one place that says what each op takes and returns.
// Kernels are registered beside their implementations (moe_ops.cpp, routing_ops.cpp,
// format_ops.cpp, checkpoint_ops.cpp); the fake (meta) kernels that let torch.compile trace the
// ops are registered from Python (megamoe/_ops.py).
#include <torch/library.h>

TORCH_LIBRARY(megamoe, m) {
  // The fused W4A16 MoE layer (docs/design.md §2) on the stacked engine layout: hidden [T, H] bf16,
  // w13 u8 [E, 2I, H/2] (rows gate then up), w13_scale f8e4m3 [E, 2I, H/16], w13_scale_2 f32
  // [E, 2], w2 u8 [E, H, I/2], w2_scale f8e4m3 [E, H, I/16], w2_scale_2 f32 [E], topk_weights
  // [T, k] (f32/bf16/f16), topk_ids [T, k] (int32/int64) -> [T, H] bf16. `handle` is the prepared
  // layer (moe_prepare) built from exactly these tensors and options; the shared expert, when
  // prepared with one, is passed the same way (shared_w13 [2Is, H/2] ... shared_w2_scale_2 [1]).
  // check_ids: outside CUDA-graph capture, read back the count of ids outside [0, E) and raise
  // IndexError when there are any (one host synchronisation per call). fp32_output: the [T, H]
  // fp32 sums before their bf16 rounding (a tensor-parallel rank's partial, summed across ranks
  // and rounded once by the caller).
  m.def(
      "fused_moe_nvfp4(Tensor hidden, Tensor w13, Tensor w13_scale, Tensor w13_scale_2, "
      "Tensor w2, Tensor w2_scale, Tensor w2_scale_2, Tensor topk_weights, Tensor topk_ids, *, "
      "int handle, float? swiglu_limit=None, bool deterministic=False, "
      "Tensor? shared_w13=None, Tensor? shared_w13_scale=None, Tensor? shared_w13_scale_2=None, "
      "Tensor? shared_w2=None, Tensor? shared_w2_scale=None, Tensor? shared_w2_scale_2=None, "
      "bool check_ids=True, bool fp32_output=False) -> Tensor");

  // Builds the prepared layer of fused_moe_nvfp4 once (plan for max_tokens, prepacked weights,
  // workspace): copies the stacked tensors to the host, checks every scale, prepacks, uploads and
  // synchronises. Not for a forward pass. Returns the handle. With `prepacked`, the tensors are
  // ones moe_prepare_in_place has rewritten: the layer reads them where they are. `precision` is the plan's
  // (megamoe/precision.h): "w4a16" (exact, the default), "w4a8" or "auto"; a precision that no GPU
  // kernel of this build serves raises NotImplementedError, any other name ValueError.
  m.def(
      "moe_prepare(Tensor w13, Tensor w13_scale, Tensor w13_scale_2, Tensor w2, "
      "Tensor w2_scale, Tensor w2_scale_2, *, int top_k, int max_tokens, "
      "float? swiglu_limit=None, bool deterministic=False, "
      "Tensor? shared_w13=None, Tensor? shared_w13_scale=None, Tensor? shared_w13_scale_2=None, "
      "Tensor? shared_w2=None, Tensor? shared_w2_scale=None, Tensor? shared_w2_scale_2=None, "
      "str precision=\"w4a16\", bool prepacked=False) -> int");
  // moe_prepare without a second copy of the weights: the prepacked layout overwrites w13,
  // w13_scale, w2 and w2_scale (and the shared expert's; ModelOpt's all-zero weights get global
  // scale 1 in w13_scale_2 / w2_scale_2), and the layer reads them there. The shared expert's
  // code and scale tensors must each follow the routed ones in one allocation. Afterwards the
  // tensors hold moe_weight_layout(handle), not the checkpoint layout: moe_unprepack /
  // moe_unprepack_in_place give it back, and moe_prepare(..., prepacked=True) prepares another
  // layer over them (no copy, no check of the bytes).
  m.def(
      "moe_prepare_in_place(Tensor(a!) w13, Tensor(b!) w13_scale, Tensor(c!) w13_scale_2, "
      "Tensor(d!) w2, Tensor(e!) w2_scale, Tensor(f!) w2_scale_2, *, int top_k, int max_tokens, "
      "float? swiglu_limit=None, bool deterministic=False, "
      "Tensor(g!)? shared_w13=None, Tensor(h!)? shared_w13_scale=None, "
      "Tensor(i!)? shared_w13_scale_2=None, Tensor(j!)? shared_w2=None, "
      "Tensor(k!)? shared_w2_scale=None, Tensor(l!)? shared_w2_scale_2=None, "
      "str precision=\"w4a16\") -> int");
  // The layout a prepared layer reads its weights in ("sm90-prepacked-nvfp4"), and the one that
  // moe_prepare_in_place writes on `device`.
  m.def("moe_weight_layout(int handle) -> str");
  // The workspace a prepared layer needs, and one it uses instead of its own: layers that never
  // run at the same time (a model's, one after another on a stream) can share the largest one.
  // Set it before capturing a CUDA graph that runs the layer; preparing again gives the layer its
  // own again.
  m.def("moe_workspace_bytes(int handle) -> int");
  m.def("moe_set_workspace(int handle, Tensor workspace) -> ()");
  m.def("moe_prepacked_layout(Device device) -> str");
  // Tensors in a prepacked `layout` back to the checkpoint layout, as new CPU tensors in
  // moe_prepare's argument order (w13 .. w2_scale_2, then the shared expert's six when given).
  m.def(
      "moe_unprepack(str layout, Tensor w13, Tensor w13_scale, Tensor w13_scale_2, Tensor w2, "
      "Tensor w2_scale, Tensor w2_scale_2, *, Tensor? shared_w13=None, "
      "Tensor? shared_w13_scale=None, Tensor? shared_w13_scale_2=None, Tensor? shared_w2=None, "
      "Tensor? shared_w2_scale=None, Tensor? shared_w2_scale_2=None) -> Tensor[]");
  // The same, written back into the tensors themselves (through the host; synchronises).
  m.def(
      "moe_unprepack_in_place(str layout, Tensor(a!) w13, Tensor(b!) w13_scale, "
      "Tensor w13_scale_2, Tensor(c!) w2, Tensor(d!) w2_scale, Tensor w2_scale_2, *, "
      "Tensor(e!)? shared_w13=None, Tensor(f!)? shared_w13_scale=None, "
      "Tensor? shared_w13_scale_2=None, Tensor(g!)? shared_w2=None, "
      "Tensor(h!)? shared_w2_scale=None, Tensor? shared_w2_scale_2=None) -> ()");
  // Frees a prepared layer after the device has finished the work queued with it.
  m.def("moe_release(int handle) -> ()");
  // The prepared layer, its memory and the kernel configuration chosen for `tokens`, as text.
  m.def("moe_describe(int handle, int tokens) -> str");

  // Router logits [T, E] f32 -> (topk_weights [T, k] f32, topk_ids [T, k] int32), docs/design.md §2:
  // method "softmax" (Qwen3, Mixtral) or "noaux_tc" (DeepSeek-V3: sigmoid, groups, bias).
  m.def(
      "route(Tensor router_logits, *, int top_k, str method=\"softmax\", bool renormalize=True, "
      "int n_group=1, int topk_group=1, float routed_scaling_factor=1.0, "
      "Tensor? e_score_correction_bias=None) -> (Tensor topk_weights, Tensor topk_ids)");

  // ModelOpt NVFP4 weight quantization (docs/design.md §2), bit for bit: weight [N, K] or [E, N, K]
  // (f32/bf16/f16) -> (codes u8 [.., N, K/2], scales f8e4m3 [.., N, K/16], weight_scale_2 f32
  // [] or [E]). Runs on the host (a CUDA input is copied there and the results back).
  m.def("quantize_nvfp4(Tensor weight) -> (Tensor weight, Tensor weight_scale, Tensor weight_scale_2)");
  // codes u8 [.., N, K/2], scales f8e4m3/u8 [.., N, K/16], global scale f32 ([] or [1]; [E] for
  // 3-D) -> bf16 [.., N, K] = bf16(e2m1 * ue4m3 * weight_scale_2). Reads the global scales on
  // the host.
  m.def("dequantize_nvfp4(Tensor weight, Tensor weight_scale, Tensor weight_scale_2) -> Tensor");

  // Expert parallelism (include/megamoe/ep.h; docs/python.md). ep_unique_id: a new NCCL
  // communicator id as hex (rank 0 makes it, every rank is given it). ep_loopback_create: R virtual
  // ranks on SM partitions of one GPU, for tests; ep_loopback_stream: rank r's stream (an int for
  // torch.cuda.ExternalStream) and its SM count. ep_group_create: this rank's endpoint (a
  // communicator over the id, or rank `rank` of loopback handle `loopback` > 0), one window for
  // every layer up to hidden_size and top_k. ep_prepare: a layer of the group over the rank's
  // experts (w13 [E/R, 2I, H/2] ..., experts [r·E/R, (r+1)·E/R) of the global num_experts) and the
  // shared expert, rewritten in place as moe_prepare_in_place does (or, with `prepacked`, already
  // rewritten). fused_moe_nvfp4_ep: the rank's tokens [T, H] with global top-k ids -> [T, H] bf16;
  // every rank calls it the same number of times, T <= max_tokens_per_rank; with check_ids it
  // synchronises, raises RuntimeError for a failed exchange and IndexError for ids outside [0, E).
  // ep_release / ep_describe take kind "layer", "group" or "loopback".
  m.def("ep_unique_id() -> str");
  m.def("ep_loopback_create(int world_size, Device device) -> int");
  m.def("ep_loopback_stream(int loopback, int rank) -> (int, int)");
  m.def(
      "ep_group_create(str unique_id, int rank, int world_size, Device device, int max_tokens_per_rank, "
      "int hidden_size, int top_k, float timeout_seconds=60.0, str precision=\"w4a16\", "
      "int loopback=0) -> int");
  m.def(
      "ep_prepare(int group, Tensor(a!) w13, Tensor(b!) w13_scale, Tensor(c!) w13_scale_2, Tensor(d!) w2, "
      "Tensor(e!) w2_scale, Tensor(f!) w2_scale_2, *, Tensor(g!)? shared_w13=None, "
      "Tensor(h!)? shared_w13_scale=None, Tensor(i!)? shared_w13_scale_2=None, Tensor(j!)? shared_w2=None, "
      "Tensor(k!)? shared_w2_scale=None, Tensor(l!)? shared_w2_scale_2=None, int num_experts, int top_k, "
      "float? swiglu_limit=None, bool deterministic=False, bool prepacked=False) -> int");
  m.def(
      "fused_moe_nvfp4_ep(Tensor hidden, Tensor w13, Tensor w13_scale, Tensor w13_scale_2, Tensor w2, "
      "Tensor w2_scale, Tensor w2_scale_2, Tensor topk_weights, Tensor topk_ids, *, int handle, "
      "Tensor? shared_w13=None, Tensor? shared_w13_scale=None, Tensor? shared_w13_scale_2=None, "
      "Tensor? shared_w2=None, Tensor? shared_w2_scale=None, Tensor? shared_w2_scale_2=None, "
      "bool check_ids=True) -> Tensor");
  m.def("ep_release(int handle, str kind) -> ()");
  m.def("ep_describe(int handle, str kind) -> str");

  // Loads model.layers.{layer}.mlp of the ModelOpt or compressed-tensors checkpoint in `path`
  // (config.json + safetensors) into stacked CPU tensors, bit for bit. Returns a JSON description
  // (shapes, routing, tensor names in order) and the tensors.
  m.def("load_moe_layer(str path, int layer) -> (str, Tensor[])");
}
