/* The stable C API of libmegamoe: load an NVFP4 MoE layer (from a checkpoint, or from the
 * engine's own stacked device tensors) and run it on a caller's CUDA stream.
 *
 * Plain C99; includes nothing from CUDA (a stream is a `struct CUstream_st *`, the type behind
 * cudaStream_t and CUstream, so either can be passed as is).
 *
 * Conventions:
 *   - Every function that can fail returns a megamoe_status. On failure it sets this thread's
 *     last error (megamoe_last_error): one sentence naming the function, the bad value and what is
 *     allowed. Every call that returns a status clears it first.
 *   - Structs passed in or out start with `struct_size`, set by the matching *_init function (or
 *     to sizeof of the struct as the caller compiled it). A newer library reads an older caller's
 *     shorter struct with defaults for the fields it lacks, and an older library accepts a newer
 *     caller's longer struct when the fields it does not know are all zero: fields added later are
 *     only appended, and take zero to mean their default.
 *   - Handles are opaque; *_destroy / *_close accept NULL. A handle may be used from several
 *     threads, but megamoe_layer_run calls on one layer that use its own workspace must be
 *     ordered (the same stream, or synchronised).
 *   - Device pointers are CUDA device (or managed) memory of the layer's device; tensors are
 *     row-major and contiguous.
 *
 * Compatibility: the C ABI changes only with the library's soname. Through 0.x the soname is
 * libmegamoe.so.0.MINOR; from 1.0 it is libmegamoe.so.MAJOR. The C++ API (the other headers of
 * include/megamoe/) is exported by the same library but makes no such promise. */
#ifndef MEGAMOE_MEGAMOE_H_
#define MEGAMOE_MEGAMOE_H_

#include <stddef.h>
#include <stdint.h>

/* The version of this header; megamoe_version() gives the library's (CMake reads it from here). */
#define MEGAMOE_VERSION_MAJOR 0
#define MEGAMOE_VERSION_MINOR 1
#define MEGAMOE_VERSION_PATCH 0
#define MEGAMOE_VERSION \
  (MEGAMOE_VERSION_MAJOR * 10000 + MEGAMOE_VERSION_MINOR * 100 + MEGAMOE_VERSION_PATCH)

#if defined(__GNUC__) || defined(__clang__)
#define MEGAMOE_API __attribute__((visibility("default")))
#else
#define MEGAMOE_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* A cudaStream_t (NULL: the legacy default stream). */
typedef struct CUstream_st* megamoe_stream;

/* Values are fixed: new ones are only appended. (In C++ the type is int-based, so that any value a
 * C caller passes, e.g. to megamoe_status_name, is a valid one.) */
typedef enum megamoe_status
#ifdef __cplusplus
    : int
#endif
{
  MEGAMOE_OK = 0,
  MEGAMOE_ERROR_INVALID_ARGUMENT = 1,   /* a caller-supplied value is outside what is allowed */
  MEGAMOE_ERROR_INVALID_CHECKPOINT = 2, /* a file on disk is malformed, truncated or inconsistent */
  MEGAMOE_ERROR_NOT_FOUND = 3,          /* a file or tensor that must exist does not */
  MEGAMOE_ERROR_IO = 4,                 /* the operating system refused a read */
  MEGAMOE_ERROR_UNSUPPORTED = 5,        /* well-formed, but not something this build or device runs */
  MEGAMOE_ERROR_CUDA = 6,               /* a CUDA runtime call failed */
  MEGAMOE_ERROR_INTERNAL = 7,           /* a broken invariant inside the library */
  MEGAMOE_ERROR_OUT_OF_MEMORY = 8       /* a host allocation failed */
} megamoe_status;

/* The GEMMs' arithmetic (README "Precision"). */
typedef enum megamoe_precision {
  MEGAMOE_PRECISION_W4A16 = 0, /* exact: bf16 activations, NVFP4 weights decoded exactly */
  MEGAMOE_PRECISION_W4A8 = 1,  /* fp8 activations (refused where the build has no such kernel) */
  MEGAMOE_PRECISION_AUTO = 2   /* per token count, the faster of the built kernels */
} megamoe_precision;

/* ---- library ------------------------------------------------------------------------------ */

/* The library's MEGAMOE_VERSION (compare with the header's to detect a mismatched library). */
MEGAMOE_API uint32_t megamoe_version(void);
/* "MAJOR.MINOR.PATCH" of the library; static storage. */
MEGAMOE_API const char* megamoe_version_string(void);
/* "MEGAMOE_OK", "MEGAMOE_ERROR_INVALID_ARGUMENT", ...; "MEGAMOE_ERROR_UNKNOWN" for other values. */
MEGAMOE_API const char* megamoe_status_name(megamoe_status status);
/* The message of this thread's last failed call, "" if its last call that returns a status
 * succeeded. Valid until the thread's next such call. Never NULL. */
MEGAMOE_API const char* megamoe_last_error(void);
/* 1 when the library was built with the GPU runtime (CUDA), 0 for a CPU-only build, in which the
 * layer functions fail with MEGAMOE_ERROR_UNSUPPORTED after checking their arguments. */
MEGAMOE_API int megamoe_has_cuda(void);
/* Number of usable CUDA devices (0 without a GPU, a driver or a CUDA build). */
MEGAMOE_API megamoe_status megamoe_device_count(int* count);

/* ---- checkpoints -------------------------------------------------------------------------- */

/* A checkpoint directory (config.json, optional hf_quant_config.json, one *.safetensors or a
 * sharded model.safetensors.index.json), ModelOpt or compressed-tensors NVFP4. The tensors stay in
 * the memory-mapped files. Host-only: works in every build. */
typedef struct megamoe_checkpoint megamoe_checkpoint;

typedef enum megamoe_quant_format {
  MEGAMOE_QUANT_UNQUANTIZED = 0,
  MEGAMOE_QUANT_MODELOPT_NVFP4 = 1,
  MEGAMOE_QUANT_COMPRESSED_TENSORS_NVFP4 = 2
} megamoe_quant_format;

typedef struct megamoe_checkpoint_info {
  uint32_t struct_size;           /* sizeof(megamoe_checkpoint_info) */
  int32_t quant_format;           /* megamoe_quant_format, from the config */
  int64_t num_layers;             /* num_hidden_layers */
  int64_t first_moe_layer;        /* the lowest MoE layer index; -1 when there is none */
  int64_t hidden_size;            /* H */
  int64_t moe_intermediate_size;  /* I of a routed expert */
  int64_t num_experts;            /* E routed experts */
  int32_t top_k;                  /* num_experts_per_tok */
  int32_t n_shared_experts;       /* the shared expert's I is n_shared_experts * I */
} megamoe_checkpoint_info;

/* Opens `dir`. Fails NOT_FOUND / INVALID_CHECKPOINT / IO naming the file and what is wrong. */
MEGAMOE_API megamoe_status megamoe_checkpoint_open(const char* dir, megamoe_checkpoint** out);
MEGAMOE_API megamoe_status megamoe_checkpoint_close(megamoe_checkpoint* checkpoint);
/* Fills `info` (set info->struct_size first); writes no more than info->struct_size bytes. */
MEGAMOE_API megamoe_status megamoe_checkpoint_describe(const megamoe_checkpoint* checkpoint,
                                                       megamoe_checkpoint_info* info);
/* *is_moe = 1 when layer `layer` (0..num_layers-1) is a MoE layer of the model, else 0. */
MEGAMOE_API megamoe_status megamoe_checkpoint_is_moe_layer(const megamoe_checkpoint* checkpoint,
                                                           int64_t layer, int* is_moe);

/* ---- layers ------------------------------------------------------------------------------- */

/* One MoE layer prepared on a device: its plan (kernels chosen, workspace sized for max_tokens),
 * its prepacked NVFP4 weights (the checkpoint's bits, never decoded into memory), its routing and,
 * unless options.external_workspace, a workspace of its own. Owns everything it uses. */
typedef struct megamoe_layer megamoe_layer;

typedef struct megamoe_layer_options {
  uint32_t struct_size;        /* sizeof(megamoe_layer_options) */
  int32_t device;              /* CUDA device ordinal (default 0) */
  int64_t max_tokens;          /* the largest T any run passes: 1..1048576 (no default) */
  int32_t precision;           /* megamoe_precision (default W4A16) */
  int32_t deterministic;       /* 1: fixed-order combine, bitwise identical runs (default 0) */
  int32_t external_workspace;  /* 1: every run passes its workspace; 0 (default): the layer
                                  allocates one at creation, used by runs that pass none */
} megamoe_layer_options;

/* Sets struct_size and the defaults; max_tokens must still be set. */
MEGAMOE_API megamoe_status megamoe_layer_options_init(megamoe_layer_options* options);

/* Layer `layer_index` (model.layers.{L}.mlp) of an open checkpoint, uploaded to options->device.
 * The checkpoint may be closed afterwards. Checks everything on the host first (the layer's
 * tensors included), so a CPU-only build reports a bad layer as any other build would, then fails
 * UNSUPPORTED. */
MEGAMOE_API megamoe_status megamoe_layer_create(const megamoe_checkpoint* checkpoint,
                                                int64_t layer_index,
                                                const megamoe_layer_options* options,
                                                megamoe_layer** out);
/* megamoe_checkpoint_open + megamoe_layer_create + megamoe_checkpoint_close. */
MEGAMOE_API megamoe_status megamoe_layer_create_from_path(const char* checkpoint_dir,
                                                          int64_t layer_index,
                                                          const megamoe_layer_options* options,
                                                          megamoe_layer** out);

/* Element types of a tensor descriptor. */
typedef enum megamoe_dtype {
  MEGAMOE_DTYPE_U8 = 0,      /* packed e2m1 codes (element 2j in the low nibble), or ue4m3 bytes */
  MEGAMOE_DTYPE_F8_E4M3 = 1, /* ue4m3 block scales (torch.float8_e4m3fn) */
  MEGAMOE_DTYPE_F32 = 2,
  MEGAMOE_DTYPE_BF16 = 3,
  MEGAMOE_DTYPE_I32 = 4
} megamoe_dtype;

#define MEGAMOE_MAX_DIMS 4

/* A device tensor: row-major. strides are in elements; all zero means contiguous (the only
 * layout this version takes: other strides are refused, naming the tensor). */
typedef struct megamoe_tensor {
  const void* data;
  int32_t dtype; /* megamoe_dtype */
  int32_t ndim;  /* 1..MEGAMOE_MAX_DIMS */
  int64_t shape[MEGAMOE_MAX_DIMS];
  int64_t strides[MEGAMOE_MAX_DIMS];
} megamoe_tensor;

typedef enum megamoe_routing_kind {
  MEGAMOE_ROUTING_NONE = 0,         /* no router: every run passes top-k ids and weights */
  MEGAMOE_ROUTING_SOFTMAX_TOPK = 1, /* Qwen3-MoE, Mixtral */
  MEGAMOE_ROUTING_NOAUX_TC = 2      /* DeepSeek-V3: sigmoid, grouped top-k on score + bias */
} megamoe_routing_kind;

/* How router logits become top-k ids and weights (docs/design.md §2). */
typedef struct megamoe_routing {
  int32_t kind;                  /* megamoe_routing_kind (default NONE) */
  int32_t renormalize;           /* softmax: divide by the top-k sum; noaux_tc: norm_topk_prob
                                    (default 1) */
  int32_t n_group;               /* noaux_tc (default 1) */
  int32_t topk_group;            /* noaux_tc (default 1) */
  float routed_scaling_factor;   /* multiplies the weights (default 1) */
  megamoe_tensor correction_bias; /* noaux_tc e_score_correction_bias [E] F32, or data NULL */
} megamoe_routing;

/* The stacked NVFP4 layout engines keep on the GPU (docs/design.md §2), E experts, hidden size H,
 * intermediate size I:
 *   w13 [E, 2I, H/2] U8 (rows: gate then up)   w13_scale [E, 2I, H/16] F8_E4M3 or U8
 *   w13_scale_2 [E, 2] F32 (gate, up)            w2 [E, H, I/2] U8
 *   w2_scale [E, H, I/16] F8_E4M3 or U8          w2_scale_2 [E] F32
 * and the optional shared expert (every token, weight 1; Is its intermediate size; data NULL in
 * shared_w13 means none): shared_w13 [2Is, H/2], shared_w13_scale [2Is, H/16],
 * shared_w13_scale_2 [2], shared_w2 [H, Is/2], shared_w2_scale [H, Is/16], shared_w2_scale_2 [1].
 * By default the tensors are copied at creation: the caller's buffers may be freed afterwards.
 * With in_place = 1 the layer holds no second copy: after every scale is checked (a refused layer
 * is left as it was), the prepacked layout overwrites w13, w13_scale, w2 and w2_scale (and the
 * shared expert's; ModelOpt's all-zero weights get global scale 1 in w13_scale_2 / w2_scale_2),
 * and the layer reads them there: keep them allocated and unchanged until the layer is destroyed
 * (the tensors no longer hold the checkpoint layout). With a shared expert, each of its code and
 * scale tensors must follow the routed one in the same allocation (shared_w13.data == w13.data +
 * w13's bytes, and likewise for w13_scale, w2, w2_scale). */
typedef struct megamoe_stacked_layer {
  uint32_t struct_size; /* sizeof(megamoe_stacked_layer) */
  megamoe_tensor w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2;
  megamoe_tensor shared_w13, shared_w13_scale, shared_w13_scale_2;
  megamoe_tensor shared_w2, shared_w2_scale, shared_w2_scale_2;
  int32_t top_k;            /* experts per token: 1..min(E, 16) (no default) */
  int32_t has_swiglu_limit; /* 1: clamp gate <= limit, |up| <= limit before SwiGLU */
  float swiglu_limit;
  megamoe_routing routing;
  int32_t in_place; /* 1: prepack the tensors in place and read them there (default 0: copy) */
} megamoe_stacked_layer;

/* Sets struct_size and the defaults (no tensors, routing NONE); top_k must still be set. */
MEGAMOE_API megamoe_status megamoe_stacked_layer_init(megamoe_stacked_layer* layer);

/* A layer from stacked device tensors. A one-time load step: the tensors are read after the work
 * already queued on `stream`, every scale is checked, and the device is synchronised before it
 * returns. Shapes, dtypes and strides are checked on the host first (in every build). */
MEGAMOE_API megamoe_status megamoe_layer_create_stacked(const megamoe_stacked_layer* weights,
                                                        const megamoe_layer_options* options,
                                                        megamoe_stream stream,
                                                        megamoe_layer** out);

MEGAMOE_API megamoe_status megamoe_layer_destroy(megamoe_layer* layer);

typedef struct megamoe_layer_info {
  uint32_t struct_size;              /* sizeof(megamoe_layer_info) */
  int32_t device;
  int64_t hidden_size;               /* H */
  int64_t intermediate_size;         /* I */
  int64_t num_experts;               /* E */
  int64_t shared_intermediate_size;  /* 0: no shared expert */
  int32_t top_k;
  int32_t routing_kind;              /* megamoe_routing_kind: NONE means no router logits */
  int64_t max_tokens;
  int32_t precision;                 /* megamoe_precision, as asked */
  int32_t deterministic;
  int32_t external_workspace;
  size_t workspace_size;             /* megamoe_layer_workspace_size */
  size_t weight_bytes;               /* device bytes of the prepacked weights */
} megamoe_layer_info;

MEGAMOE_API megamoe_status megamoe_layer_get_info(const megamoe_layer* layer,
                                                  megamoe_layer_info* info);
/* The configuration a run of `tokens` tokens uses (precision, tiles, combine), as text: at most
 * size - 1 characters and a NUL are written to `buffer` (NULL when size is 0); *length (if not
 * NULL) gets the full length, so a call with size 0 sizes the buffer. */
MEGAMOE_API megamoe_status megamoe_layer_describe(const megamoe_layer* layer, int64_t tokens,
                                                  char* buffer, size_t size, size_t* length);
/* Bytes of device workspace a run needs (256-byte aligned), the same for every T <= max_tokens. */
MEGAMOE_API megamoe_status megamoe_layer_workspace_size(const megamoe_layer* layer, size_t* bytes);

typedef struct megamoe_run_args {
  uint32_t struct_size;         /* sizeof(megamoe_run_args) */
  int64_t tokens;               /* T, 0..max_tokens */
  const void* hidden;           /* [T, H] bf16 */
  /* The routing: either both of */
  const int32_t* topk_ids;      /* [T, top_k]; ids outside [0, E) are counted and skipped */
  const float* topk_weights;    /* [T, top_k] */
  /* or, for a layer with a router, */
  const float* router_logits;   /* [T, E] fp32: routed on the device */
  /* and one output: */
  void* output;                 /* [T, H] bf16 */
  float* output_f32;            /* [T, H] fp32, the sums before the bf16 rounding */
  void* workspace;              /* workspace_size bytes, 256-byte aligned; NULL: the layer's */
  size_t workspace_size;        /* bytes at workspace */
} megamoe_run_args;

MEGAMOE_API megamoe_status megamoe_run_args_init(megamoe_run_args* args);

/* Runs the layer on `stream` (a stream of the layer's device). Arguments are checked on the host;
 * then it only launches: no allocation, no host synchronisation, CUDA-graph capturable. hidden and
 * the output must be 16-byte aligned. T = 0 (an empty batch) launches nothing; its pointers may be
 * NULL. Runs on the layer's device whatever the calling thread's
 * current device (which it leaves as it found it). */
MEGAMOE_API megamoe_status megamoe_layer_run(megamoe_layer* layer, const megamoe_run_args* args,
                                             megamoe_stream stream);

/* Top-k ids outside [0, E) that the last run using `workspace` (NULL: the layer's own) skipped.
 * Synchronises `stream`; not for graph capture. */
MEGAMOE_API megamoe_status megamoe_layer_invalid_id_count(const megamoe_layer* layer,
                                                          const void* workspace,
                                                          megamoe_stream stream, int64_t* count);

#ifdef __cplusplus
}
#endif

#endif /* MEGAMOE_MEGAMOE_H_ */
