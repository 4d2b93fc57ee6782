/* The C API's error paths, compiled as C99 against megamoe.h alone: every function with NULL
 * pointers, uninitialised and bad structs, bad options, wrong shapes, bad paths and corrupt
 * checkpoints. Each failure must return the expected status and a last-error message naming the
 * problem; each success must clear it. Runs on any machine: where a layer can be made (a CUDA
 * build with a GPU) the layer-taking functions' argument checks are exercised too.
 *
 *   megamoe_capi_error_test CHECKPOINT_DIR SCRATCH_DIR
 * CHECKPOINT_DIR: a synthesized qwen3-30b-a3b layer with 4 experts (megamoe synth); SCRATCH_DIR:
 * an existing directory holding empty subdirectories bad-config/, bad-tensors/ and layers/. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "megamoe/megamoe.h"

static int g_checks = 0;
static int g_failures = 0;

/* `got` must be `want`; on failure the last error must contain `needle` (when not NULL), on
 * success it must be empty. */
static void expect(megamoe_status got, megamoe_status want, const char* needle, const char* call, int line) {
  const char* message = megamoe_last_error();
  ++g_checks;
  if (message == NULL) {
    fprintf(stderr, "line %d: %s: megamoe_last_error() returned NULL\n", line, call);
    ++g_failures;
    return;
  }
  if (got != want) {
    fprintf(stderr, "line %d: %s returned %s, expected %s (last error: \"%s\")\n", line, call,
            megamoe_status_name(got), megamoe_status_name(want), message);
    ++g_failures;
  } else if (want == MEGAMOE_OK && message[0] != '\0') {
    fprintf(stderr, "line %d: %s succeeded but left the last error \"%s\"\n", line, call, message);
    ++g_failures;
  } else if (want != MEGAMOE_OK && (message[0] == '\0' || (needle != NULL && strstr(message, needle) == NULL))) {
    fprintf(stderr, "line %d: %s: last error \"%s\" does not mention \"%s\"\n", line, call, message,
            needle ? needle : "(anything)");
    ++g_failures;
  }
}
#define EXPECT(call, want, needle) expect((call), (want), (needle), #call, __LINE__)

static void check(int ok, const char* what, int line) {
  ++g_checks;
  if (!ok) {
    fprintf(stderr, "line %d: %s\n", line, what);
    ++g_failures;
  }
}
#define CHECK(cond) check((cond) ? 1 : 0, #cond, __LINE__)

static char* read_file(const char* path, size_t* size) {
  FILE* f = fopen(path, "rb");
  char* data;
  long n;
  if (!f) return NULL;
  fseek(f, 0, SEEK_END);
  n = ftell(f);
  fseek(f, 0, SEEK_SET);
  data = (char*)malloc((size_t)n + 1);
  if (data && fread(data, 1, (size_t)n, f) != (size_t)n) {
    free(data);
    data = NULL;
  }
  fclose(f);
  if (data) {
    data[n] = '\0';
    *size = (size_t)n;
  }
  return data;
}

static int write_file(const char* path, const char* data, size_t size) {
  FILE* f = fopen(path, "wb");
  int ok;
  if (!f) return 0;
  ok = fwrite(data, 1, size, f) == size;
  return fclose(f) == 0 && ok;
}

/* Replaces the first `from` in `text` (of a config.json) by `to`, in a new string. */
static char* replace(const char* text, const char* from, const char* to) {
  const char* at = strstr(text, from);
  size_t head, size;
  char* out;
  if (!at) return NULL;
  head = (size_t)(at - text);
  size = strlen(text) - strlen(from) + strlen(to) + 1;
  out = (char*)malloc(size);
  if (!out) return NULL;
  memcpy(out, text, head);
  strcpy(out + head, to);
  strcat(out, at + strlen(from));
  return out;
}

static void join(char* out, size_t size, const char* dir, const char* name) {
  snprintf(out, size, "%s/%s", dir, name);
}

/* ---- the library ----------------------------------------------------------------------------- */

static void test_library(void) {
  char expected[32];
  int count = -1;
  CHECK(megamoe_version() == MEGAMOE_VERSION);
  snprintf(expected, sizeof expected, "%d.%d.%d", MEGAMOE_VERSION_MAJOR, MEGAMOE_VERSION_MINOR,
           MEGAMOE_VERSION_PATCH);
  CHECK(strcmp(megamoe_version_string(), expected) == 0);
  CHECK(strcmp(megamoe_status_name(MEGAMOE_OK), "MEGAMOE_OK") == 0);
  CHECK(strcmp(megamoe_status_name(MEGAMOE_ERROR_INVALID_ARGUMENT), "MEGAMOE_ERROR_INVALID_ARGUMENT") == 0);
  CHECK(strcmp(megamoe_status_name(MEGAMOE_ERROR_OUT_OF_MEMORY), "MEGAMOE_ERROR_OUT_OF_MEMORY") == 0);
  CHECK(strcmp(megamoe_status_name((megamoe_status)99), "MEGAMOE_ERROR_UNKNOWN") == 0);
  CHECK(megamoe_has_cuda() == 0 || megamoe_has_cuda() == 1);
  EXPECT(megamoe_device_count(NULL), MEGAMOE_ERROR_INVALID_ARGUMENT, "megamoe_device_count: count is NULL");
  EXPECT(megamoe_device_count(&count), MEGAMOE_OK, NULL);
  CHECK(count >= 0);
  CHECK(megamoe_has_cuda() || count == 0);
}

/* ---- checkpoints ----------------------------------------------------------------------------- */

static void test_checkpoint(const char* dir, const char* scratch) {
  megamoe_checkpoint* ckpt = (megamoe_checkpoint*)&g_checks; /* must be reset to NULL on failure */
  megamoe_checkpoint_info info;
  char path[4096], config_path[4096];
  size_t size = 0;
  char* config;
  int is_moe = -1;

  EXPECT(megamoe_checkpoint_open(NULL, &ckpt), MEGAMOE_ERROR_INVALID_ARGUMENT, "dir is NULL");
  CHECK(ckpt == NULL);
  EXPECT(megamoe_checkpoint_open(dir, NULL), MEGAMOE_ERROR_INVALID_ARGUMENT, "out is NULL");
  EXPECT(megamoe_checkpoint_open("", &ckpt), MEGAMOE_ERROR_INVALID_ARGUMENT, "dir is empty");
  EXPECT(megamoe_checkpoint_open("/nonexistent/megamoe-checkpoint", &ckpt), MEGAMOE_ERROR_NOT_FOUND,
         "/nonexistent/megamoe-checkpoint/config.json");
  CHECK(ckpt == NULL);

  /* A config.json that is not JSON. */
  join(path, sizeof path, scratch, "bad-config/config.json");
  CHECK(write_file(path, "{\"architectures\": [", 19));
  join(path, sizeof path, scratch, "bad-config");
  EXPECT(megamoe_checkpoint_open(path, &ckpt), MEGAMOE_ERROR_INVALID_CHECKPOINT, "config.json");
  CHECK(ckpt == NULL);

  /* A good config.json over a truncated safetensors file. */
  join(config_path, sizeof config_path, dir, "config.json");
  config = read_file(config_path, &size);
  CHECK(config != NULL);
  if (config) {
    join(path, sizeof path, scratch, "bad-tensors/config.json");
    CHECK(write_file(path, config, size));
    join(path, sizeof path, scratch, "bad-tensors/model.safetensors");
    CHECK(write_file(path, "\x10\0\0\0\0\0\0\0{\"a\":", 13));
    join(path, sizeof path, scratch, "bad-tensors");
    EXPECT(megamoe_checkpoint_open(path, &ckpt), MEGAMOE_ERROR_INVALID_CHECKPOINT, "model.safetensors");
    CHECK(ckpt == NULL);
  }

  EXPECT(megamoe_checkpoint_close(NULL), MEGAMOE_OK, NULL);
  EXPECT(megamoe_checkpoint_open(dir, &ckpt), MEGAMOE_OK, NULL);
  CHECK(ckpt != NULL);

  memset(&info, 0, sizeof info);
  EXPECT(megamoe_checkpoint_describe(NULL, &info), MEGAMOE_ERROR_INVALID_ARGUMENT, "checkpoint is NULL");
  EXPECT(megamoe_checkpoint_describe(ckpt, NULL), MEGAMOE_ERROR_INVALID_ARGUMENT, "info is NULL");
  EXPECT(megamoe_checkpoint_describe(ckpt, &info), MEGAMOE_ERROR_INVALID_ARGUMENT, "struct_size is 0");
  info.struct_size = 8;
  EXPECT(megamoe_checkpoint_describe(ckpt, &info), MEGAMOE_ERROR_INVALID_ARGUMENT, "struct_size is 8");
  info.struct_size = sizeof info;
  EXPECT(megamoe_checkpoint_describe(ckpt, &info), MEGAMOE_OK, NULL);
  CHECK(info.hidden_size == 2048 && info.moe_intermediate_size == 768 && info.num_experts == 4);
  CHECK(info.top_k == 4 && info.n_shared_experts == 0 && info.num_layers == 1 && info.first_moe_layer == 0);
  CHECK(info.quant_format == MEGAMOE_QUANT_MODELOPT_NVFP4);

  EXPECT(megamoe_checkpoint_is_moe_layer(NULL, 0, &is_moe), MEGAMOE_ERROR_INVALID_ARGUMENT, "checkpoint is NULL");
  EXPECT(megamoe_checkpoint_is_moe_layer(ckpt, 0, NULL), MEGAMOE_ERROR_INVALID_ARGUMENT, "is_moe is NULL");
  EXPECT(megamoe_checkpoint_is_moe_layer(ckpt, -1, &is_moe), MEGAMOE_ERROR_INVALID_ARGUMENT, "layer -1 is out of range");
  EXPECT(megamoe_checkpoint_is_moe_layer(ckpt, 1, &is_moe), MEGAMOE_ERROR_INVALID_ARGUMENT, "layers 0..0");
  EXPECT(megamoe_checkpoint_is_moe_layer(ckpt, 0, &is_moe), MEGAMOE_OK, NULL);
  CHECK(is_moe == 1);
  EXPECT(megamoe_checkpoint_close(ckpt), MEGAMOE_OK, NULL);
  free(config);
}

/* ---- layers from a checkpoint ----------------------------------------------------------------- */

/* A newer caller's options: one more field than this library knows. */
typedef struct {
  megamoe_layer_options options;
  int64_t newer_field;
} newer_options;

static void test_layer_options(const char* dir, megamoe_checkpoint* ckpt) {
  megamoe_layer* layer = (megamoe_layer*)&g_checks;
  megamoe_layer_options o;
  newer_options newer;

  EXPECT(megamoe_layer_options_init(NULL), MEGAMOE_ERROR_INVALID_ARGUMENT, "options is NULL");
  memset(&o, 0xAB, sizeof o);
  EXPECT(megamoe_layer_options_init(&o), MEGAMOE_OK, NULL);
  CHECK(o.struct_size == sizeof o && o.device == 0 && o.max_tokens == 0);
  CHECK(o.precision == MEGAMOE_PRECISION_W4A16 && o.deterministic == 0 && o.external_workspace == 0);

  EXPECT(megamoe_layer_create(ckpt, 0, &o, NULL), MEGAMOE_ERROR_INVALID_ARGUMENT, "out is NULL");
  EXPECT(megamoe_layer_create(NULL, 0, &o, &layer), MEGAMOE_ERROR_INVALID_ARGUMENT, "checkpoint is NULL");
  CHECK(layer == NULL);
  EXPECT(megamoe_layer_create(ckpt, 0, NULL, &layer), MEGAMOE_ERROR_INVALID_ARGUMENT, "options is NULL");
  /* max_tokens has no default. */
  EXPECT(megamoe_layer_create(ckpt, 0, &o, &layer), MEGAMOE_ERROR_INVALID_ARGUMENT, "options.max_tokens is 0");
  o.max_tokens = (int64_t)1 << 21;
  EXPECT(megamoe_layer_create(ckpt, 0, &o, &layer), MEGAMOE_ERROR_INVALID_ARGUMENT, "1..1048576");
  o.max_tokens = 64;
  o.struct_size = 0;
  EXPECT(megamoe_layer_create(ckpt, 0, &o, &layer), MEGAMOE_ERROR_INVALID_ARGUMENT, "megamoe_layer_options_init");
  o.struct_size = 4;
  EXPECT(megamoe_layer_create(ckpt, 0, &o, &layer), MEGAMOE_ERROR_INVALID_ARGUMENT, "struct_size is 4");
  o.struct_size = 0xABABABABu; /* an uninitialised struct: refused without reading past it */
  EXPECT(megamoe_layer_create(ckpt, 0, &o, &layer), MEGAMOE_ERROR_INVALID_ARGUMENT, "more than any version");
  o.struct_size = sizeof o;
  o.device = -1;
  EXPECT(megamoe_layer_create(ckpt, 0, &o, &layer), MEGAMOE_ERROR_INVALID_ARGUMENT, "options.device is -1");
  o.device = 0;
  o.precision = 7;
  EXPECT(megamoe_layer_create(ckpt, 0, &o, &layer), MEGAMOE_ERROR_INVALID_ARGUMENT, "options.precision is 7");
  o.precision = MEGAMOE_PRECISION_W4A16;
  o.deterministic = 2;
  EXPECT(megamoe_layer_create(ckpt, 0, &o, &layer), MEGAMOE_ERROR_INVALID_ARGUMENT, "options.deterministic is 2");
  o.deterministic = 0;
  o.external_workspace = -1;
  EXPECT(megamoe_layer_create(ckpt, 0, &o, &layer), MEGAMOE_ERROR_INVALID_ARGUMENT, "options.external_workspace");
  o.external_workspace = 0;

  /* A newer header's struct: accepted while its unknown field is zero, refused once it is set. */
  memset(&newer, 0, sizeof newer);
  newer.options = o;
  newer.options.struct_size = sizeof newer;
  newer.newer_field = 1;
  EXPECT(megamoe_layer_create(ckpt, 0, &newer.options, &layer), MEGAMOE_ERROR_UNSUPPORTED, "does not have");
  CHECK(layer == NULL);

  EXPECT(megamoe_layer_create(ckpt, -1, &o, &layer), MEGAMOE_ERROR_INVALID_ARGUMENT, "layer_index -1 is out of range");
  EXPECT(megamoe_layer_create(ckpt, 1, &o, &layer), MEGAMOE_ERROR_INVALID_ARGUMENT, "layers 0..0");

  EXPECT(megamoe_layer_create_from_path(NULL, 0, &o, &layer), MEGAMOE_ERROR_INVALID_ARGUMENT, "checkpoint_dir is NULL");
  EXPECT(megamoe_layer_create_from_path("", 0, &o, &layer), MEGAMOE_ERROR_INVALID_ARGUMENT, "checkpoint_dir is empty");
  EXPECT(megamoe_layer_create_from_path("/nonexistent/ckpt", 0, &o, &layer), MEGAMOE_ERROR_NOT_FOUND, "/nonexistent/ckpt");
  EXPECT(megamoe_layer_create_from_path(dir, 0, NULL, &layer), MEGAMOE_ERROR_INVALID_ARGUMENT, "options is NULL");
  EXPECT(megamoe_layer_create_from_path(dir, 0, &o, NULL), MEGAMOE_ERROR_INVALID_ARGUMENT, "out is NULL");
  EXPECT(megamoe_layer_create_from_path(dir, 3, &o, &layer), MEGAMOE_ERROR_INVALID_ARGUMENT, "layer_index 3");
  CHECK(layer == NULL);
}

/* Layers the config declares but the checkpoint does not hold as a MoE layer. */
static void test_missing_layers(const char* dir, const char* scratch) {
  char path[4096];
  size_t config_size = 0, tensors_size = 0;
  char *config, *more_layers, *with_dense, *tensors;
  megamoe_layer_options o;
  megamoe_layer* layer = NULL;
  megamoe_checkpoint* ckpt = NULL;
  int is_moe = -1;

  join(path, sizeof path, dir, "config.json");
  config = read_file(path, &config_size);
  join(path, sizeof path, dir, "model.safetensors");
  tensors = read_file(path, &tensors_size);
  CHECK(config != NULL && tensors != NULL);
  if (!config || !tensors) return;
  more_layers = replace(config, "\"num_hidden_layers\": 1", "\"num_hidden_layers\": 3");
  with_dense = more_layers ? replace(more_layers, "\"mlp_only_layers\": []", "\"mlp_only_layers\": [1]") : NULL;
  CHECK(with_dense != NULL);
  if (with_dense) {
    join(path, sizeof path, scratch, "layers/config.json");
    CHECK(write_file(path, with_dense, strlen(with_dense)));
    join(path, sizeof path, scratch, "layers/model.safetensors");
    CHECK(write_file(path, tensors, tensors_size));
    join(path, sizeof path, scratch, "layers");
    EXPECT(megamoe_checkpoint_open(path, &ckpt), MEGAMOE_OK, NULL);
    EXPECT(megamoe_checkpoint_is_moe_layer(ckpt, 1, &is_moe), MEGAMOE_OK, NULL);
    CHECK(is_moe == 0);
    megamoe_layer_options_init(&o);
    o.max_tokens = 16;
    /* Layer 1 is dense; layer 2 is a MoE layer whose tensors are missing. */
    EXPECT(megamoe_layer_create(ckpt, 1, &o, &layer), MEGAMOE_ERROR_INVALID_ARGUMENT, "layer 1");
    EXPECT(megamoe_layer_create(ckpt, 2, &o, &layer), MEGAMOE_ERROR_INVALID_CHECKPOINT, "model.layers.2.mlp");
    CHECK(layer == NULL);
    megamoe_checkpoint_close(ckpt);
  }
  free(config);
  free(tensors);
  free(more_layers);
  free(with_dense);
}

/* ---- layers from stacked tensors -------------------------------------------------------------- */

/* Stand-ins for device pointers: the checks below fail before anything is read through them. */
static unsigned char g_fake_device[64];

static megamoe_tensor tensor(int32_t dtype, int ndim, int64_t d0, int64_t d1, int64_t d2) {
  megamoe_tensor t;
  memset(&t, 0, sizeof t);
  t.data = g_fake_device;
  t.dtype = dtype;
  t.ndim = ndim;
  t.shape[0] = d0;
  t.shape[1] = d1;
  t.shape[2] = d2;
  return t;
}

/* A consistent layer: H = 128, I = 64, E = 4, top_k = 2, no shared expert. */
static megamoe_stacked_layer good_stacked(void) {
  megamoe_stacked_layer s;
  megamoe_stacked_layer_init(&s);
  s.w13 = tensor(MEGAMOE_DTYPE_U8, 3, 4, 128, 64);
  s.w13_scale = tensor(MEGAMOE_DTYPE_F8_E4M3, 3, 4, 128, 8);
  s.w13_scale_2 = tensor(MEGAMOE_DTYPE_F32, 2, 4, 2, 0);
  s.w2 = tensor(MEGAMOE_DTYPE_U8, 3, 4, 128, 32);
  s.w2_scale = tensor(MEGAMOE_DTYPE_U8, 3, 4, 128, 4);
  s.w2_scale_2 = tensor(MEGAMOE_DTYPE_F32, 1, 4, 0, 0);
  s.top_k = 2;
  return s;
}

static void test_stacked(int layers_possible) {
  megamoe_layer* layer = (megamoe_layer*)&g_checks;
  megamoe_layer_options o;
  megamoe_stacked_layer s;

  megamoe_layer_options_init(&o);
  o.max_tokens = 32;
  EXPECT(megamoe_stacked_layer_init(NULL), MEGAMOE_ERROR_INVALID_ARGUMENT, "layer is NULL");
  s = good_stacked();
  CHECK(s.struct_size == sizeof s && s.routing.kind == MEGAMOE_ROUTING_NONE);
  CHECK(s.routing.n_group == 1 && s.routing.topk_group == 1 && s.routing.routed_scaling_factor == 1.0f);

  EXPECT(megamoe_layer_create_stacked(&s, &o, NULL, NULL), MEGAMOE_ERROR_INVALID_ARGUMENT, "out is NULL");
  EXPECT(megamoe_layer_create_stacked(NULL, &o, NULL, &layer), MEGAMOE_ERROR_INVALID_ARGUMENT, "weights is NULL");
  CHECK(layer == NULL);
  EXPECT(megamoe_layer_create_stacked(&s, NULL, NULL, &layer), MEGAMOE_ERROR_INVALID_ARGUMENT, "options is NULL");
  s.struct_size = 0;
  EXPECT(megamoe_layer_create_stacked(&s, &o, NULL, &layer), MEGAMOE_ERROR_INVALID_ARGUMENT, "megamoe_stacked_layer_init");

  s = good_stacked();
  s.w13.ndim = 2;
  EXPECT(megamoe_layer_create_stacked(&s, &o, NULL, &layer), MEGAMOE_ERROR_INVALID_ARGUMENT, "w13.ndim is 2");
  s = good_stacked();
  s.w13.shape[1] = 127;
  EXPECT(megamoe_layer_create_stacked(&s, &o, NULL, &layer), MEGAMOE_ERROR_INVALID_ARGUMENT, "even number");
  s = good_stacked();
  s.w2.shape[1] = 100;
  EXPECT(megamoe_layer_create_stacked(&s, &o, NULL, &layer), MEGAMOE_ERROR_INVALID_ARGUMENT, "H = w2.shape[1] = 100");
  s = good_stacked();
  s.w2.shape[1] = (int64_t)1 << 40;
  EXPECT(megamoe_layer_create_stacked(&s, &o, NULL, &layer), MEGAMOE_ERROR_INVALID_ARGUMENT, "at most 2^24");
  s = good_stacked();
  s.w13.shape[0] = 0;
  EXPECT(megamoe_layer_create_stacked(&s, &o, NULL, &layer), MEGAMOE_ERROR_INVALID_ARGUMENT, "w13.shape[0] = 0");
  s = good_stacked();
  s.w13_scale.shape[2] = 9;
  EXPECT(megamoe_layer_create_stacked(&s, &o, NULL, &layer), MEGAMOE_ERROR_INVALID_ARGUMENT,
         "w13_scale has shape [4, 128, 9]; expected [E, 2I, H/16] = [4, 128, 8]");
  s = good_stacked();
  s.w2.shape[0] = 3;
  EXPECT(megamoe_layer_create_stacked(&s, &o, NULL, &layer), MEGAMOE_ERROR_INVALID_ARGUMENT, "w2 has shape [3, 128, 32]");
  s = good_stacked();
  s.w2_scale_2.ndim = 2;
  EXPECT(megamoe_layer_create_stacked(&s, &o, NULL, &layer), MEGAMOE_ERROR_INVALID_ARGUMENT, "w2_scale_2.ndim is 2");
  s = good_stacked();
  s.w13_scale_2.dtype = MEGAMOE_DTYPE_U8;
  EXPECT(megamoe_layer_create_stacked(&s, &o, NULL, &layer), MEGAMOE_ERROR_INVALID_ARGUMENT, "w13_scale_2.dtype");
  s = good_stacked();
  s.w13.dtype = MEGAMOE_DTYPE_BF16;
  EXPECT(megamoe_layer_create_stacked(&s, &o, NULL, &layer), MEGAMOE_ERROR_INVALID_ARGUMENT, "w13.dtype is 3 (BF16)");
  s = good_stacked();
  s.w2_scale.data = NULL;
  EXPECT(megamoe_layer_create_stacked(&s, &o, NULL, &layer), MEGAMOE_ERROR_INVALID_ARGUMENT, "w2_scale.data is NULL");
  s = good_stacked();
  s.w13.strides[0] = 128 * 64 + 16; /* padded experts: not taken by this version */
  s.w13.strides[1] = 64;
  s.w13.strides[2] = 1;
  EXPECT(megamoe_layer_create_stacked(&s, &o, NULL, &layer), MEGAMOE_ERROR_UNSUPPORTED, "contiguous");
  s.w13.strides[0] = 128 * 64; /* the contiguous strides spelled out */
  s.top_k = 0;
  EXPECT(megamoe_layer_create_stacked(&s, &o, NULL, &layer), MEGAMOE_ERROR_INVALID_ARGUMENT, "top_k is 0");
  s.top_k = 5;
  EXPECT(megamoe_layer_create_stacked(&s, &o, NULL, &layer), MEGAMOE_ERROR_INVALID_ARGUMENT, "1..min(E, 16) = 1..4");

  s = good_stacked();
  s.shared_w2 = tensor(MEGAMOE_DTYPE_U8, 2, 128, 32, 0);
  EXPECT(megamoe_layer_create_stacked(&s, &o, NULL, &layer), MEGAMOE_ERROR_INVALID_ARGUMENT,
         "shared_w2 is given but shared_w13 is not");
  s.shared_w13 = tensor(MEGAMOE_DTYPE_U8, 2, 128, 64, 0);
  s.shared_w13_scale = tensor(MEGAMOE_DTYPE_U8, 2, 128, 8, 0);
  s.shared_w13_scale_2 = tensor(MEGAMOE_DTYPE_F32, 1, 2, 0, 0);
  s.shared_w2 = tensor(MEGAMOE_DTYPE_U8, 2, 128, 32, 0);
  s.shared_w2_scale = tensor(MEGAMOE_DTYPE_U8, 2, 128, 4, 0);
  s.shared_w2_scale_2 = tensor(MEGAMOE_DTYPE_F32, 1, 2, 0, 0);
  EXPECT(megamoe_layer_create_stacked(&s, &o, NULL, &layer), MEGAMOE_ERROR_INVALID_ARGUMENT,
         "shared_w2_scale_2 has shape [2]; expected [1]");

  s = good_stacked();
  s.has_swiglu_limit = 1;
  s.swiglu_limit = (float)NAN;
  EXPECT(megamoe_layer_create_stacked(&s, &o, NULL, &layer), MEGAMOE_ERROR_INVALID_ARGUMENT, "swiglu_limit is nan");
  s.swiglu_limit = -1.0f;
  EXPECT(megamoe_layer_create_stacked(&s, &o, NULL, &layer), MEGAMOE_ERROR_INVALID_ARGUMENT, "swiglu_limit is -1");

  s = good_stacked();
  s.in_place = 2;
  EXPECT(megamoe_layer_create_stacked(&s, &o, NULL, &layer), MEGAMOE_ERROR_INVALID_ARGUMENT,
         "in_place is 2; it must be 0 or 1");

  s = good_stacked();
  s.routing.kind = 5;
  EXPECT(megamoe_layer_create_stacked(&s, &o, NULL, &layer), MEGAMOE_ERROR_INVALID_ARGUMENT, "routing.kind is 5");
  s.routing.kind = MEGAMOE_ROUTING_SOFTMAX_TOPK;
  s.routing.correction_bias = tensor(MEGAMOE_DTYPE_F32, 1, 4, 0, 0);
  EXPECT(megamoe_layer_create_stacked(&s, &o, NULL, &layer), MEGAMOE_ERROR_INVALID_ARGUMENT, "only MEGAMOE_ROUTING_NOAUX_TC");
  s.routing.kind = MEGAMOE_ROUTING_NOAUX_TC;
  s.routing.correction_bias.shape[0] = 8;
  EXPECT(megamoe_layer_create_stacked(&s, &o, NULL, &layer), MEGAMOE_ERROR_INVALID_ARGUMENT, "routing.correction_bias has shape [8]");
  s.routing.correction_bias.shape[0] = 4;
  s.routing.n_group = 3;
  EXPECT(megamoe_layer_create_stacked(&s, &o, NULL, &layer), MEGAMOE_ERROR_INVALID_ARGUMENT, "n_group is 3");
  s.routing.n_group = 1;
  s.routing.routed_scaling_factor = 0.0f;
  EXPECT(megamoe_layer_create_stacked(&s, &o, NULL, &layer), MEGAMOE_ERROR_INVALID_ARGUMENT, "routed_scaling_factor");
  s.routing.routed_scaling_factor = 2.5f;
  o.max_tokens = 0;
  EXPECT(megamoe_layer_create_stacked(&s, &o, NULL, &layer), MEGAMOE_ERROR_INVALID_ARGUMENT, "options.max_tokens is 0");
  o.max_tokens = 32;
  CHECK(layer == NULL);
  if (!layers_possible) {
    /* Everything checks out on the host: what is left is the device. */
    EXPECT(megamoe_layer_create_stacked(&s, &o, NULL, &layer),
           MEGAMOE_ERROR_UNSUPPORTED, megamoe_has_cuda() ? "no CUDA device" : "built without CUDA");
    CHECK(layer == NULL);
  }
}

/* ---- functions that take a layer ---------------------------------------------------------------- */

static void test_null_layer(void) {
  megamoe_layer_info info;
  megamoe_run_args args;
  char text[16];
  size_t n = 0;
  int64_t count = 0;

  memset(&info, 0, sizeof info);
  info.struct_size = sizeof info;
  EXPECT(megamoe_layer_destroy(NULL), MEGAMOE_OK, NULL);
  EXPECT(megamoe_layer_get_info(NULL, &info), MEGAMOE_ERROR_INVALID_ARGUMENT, "layer is NULL");
  EXPECT(megamoe_layer_describe(NULL, 1, text, sizeof text, &n), MEGAMOE_ERROR_INVALID_ARGUMENT, "layer is NULL");
  EXPECT(megamoe_layer_workspace_size(NULL, &n), MEGAMOE_ERROR_INVALID_ARGUMENT, "layer is NULL");
  EXPECT(megamoe_run_args_init(NULL), MEGAMOE_ERROR_INVALID_ARGUMENT, "args is NULL");
  EXPECT(megamoe_run_args_init(&args), MEGAMOE_OK, NULL);
  CHECK(args.struct_size == sizeof args && args.tokens == 0 && args.hidden == NULL && args.workspace == NULL);
  EXPECT(megamoe_layer_run(NULL, &args, NULL), MEGAMOE_ERROR_INVALID_ARGUMENT, "layer is NULL");
  EXPECT(megamoe_layer_invalid_id_count(NULL, NULL, NULL, &count), MEGAMOE_ERROR_INVALID_ARGUMENT, "layer is NULL");
}

/* With a GPU: the argument checks of the functions that take a layer. They fail before anything is
 * launched, so the pointers need not be real. */
static void test_layer_arguments(const char* dir) {
  megamoe_layer* layer = NULL;
  megamoe_layer* external = NULL;
  megamoe_layer_options o;
  megamoe_layer_info info;
  megamoe_run_args a;
  size_t workspace = 0, n = 0;
  char text[8];
  int64_t count = 0;

  megamoe_layer_options_init(&o);
  o.max_tokens = 64;
  EXPECT(megamoe_layer_create_from_path(dir, 0, &o, &layer), MEGAMOE_OK, NULL);
  if (!layer) return;
  o.device = 4096;
  EXPECT(megamoe_layer_create_from_path(dir, 0, &o, &external), MEGAMOE_ERROR_INVALID_ARGUMENT, "options.device is 4096");
  o.device = 0;
  o.external_workspace = 1;
  EXPECT(megamoe_layer_create_from_path(dir, 0, &o, &external), MEGAMOE_OK, NULL);

  memset(&info, 0, sizeof info);
  EXPECT(megamoe_layer_get_info(layer, NULL), MEGAMOE_ERROR_INVALID_ARGUMENT, "info is NULL");
  EXPECT(megamoe_layer_get_info(layer, &info), MEGAMOE_ERROR_INVALID_ARGUMENT, "struct_size is 0");
  info.struct_size = sizeof info;
  EXPECT(megamoe_layer_get_info(layer, &info), MEGAMOE_OK, NULL);
  CHECK(info.hidden_size == 2048 && info.num_experts == 4 && info.top_k == 4 && info.max_tokens == 64);
  CHECK(info.routing_kind == MEGAMOE_ROUTING_SOFTMAX_TOPK && info.weight_bytes > 0);
  EXPECT(megamoe_layer_workspace_size(layer, NULL), MEGAMOE_ERROR_INVALID_ARGUMENT, "bytes is NULL");
  EXPECT(megamoe_layer_workspace_size(layer, &workspace), MEGAMOE_OK, NULL);
  CHECK(workspace == info.workspace_size && workspace > 0);

  EXPECT(megamoe_layer_describe(layer, 65, text, sizeof text, &n), MEGAMOE_ERROR_INVALID_ARGUMENT, "0..max_tokens = 64");
  EXPECT(megamoe_layer_describe(layer, -1, text, sizeof text, &n), MEGAMOE_ERROR_INVALID_ARGUMENT, "tokens is -1");
  EXPECT(megamoe_layer_describe(layer, 1, NULL, 4, &n), MEGAMOE_ERROR_INVALID_ARGUMENT, "buffer is NULL");
  EXPECT(megamoe_layer_describe(layer, 1, NULL, 0, &n), MEGAMOE_OK, NULL);
  CHECK(n > sizeof text);
  EXPECT(megamoe_layer_describe(layer, 1, text, sizeof text, NULL), MEGAMOE_OK, NULL);
  CHECK(strlen(text) == sizeof text - 1 && strncmp(text, "T=1 ", 4) == 0);

  EXPECT(megamoe_layer_run(layer, NULL, NULL), MEGAMOE_ERROR_INVALID_ARGUMENT, "args is NULL");
  megamoe_run_args_init(&a);
  EXPECT(megamoe_layer_run(layer, &a, NULL), MEGAMOE_OK, NULL); /* T = 0: nothing to do, no pointers */
  memset(&a, 0, sizeof a);
  EXPECT(megamoe_layer_run(layer, &a, NULL), MEGAMOE_ERROR_INVALID_ARGUMENT, "megamoe_run_args_init");
  megamoe_run_args_init(&a);
  a.tokens = 65;
  EXPECT(megamoe_layer_run(layer, &a, NULL), MEGAMOE_ERROR_INVALID_ARGUMENT, "args.tokens is 65");
  a.tokens = 4;
  EXPECT(megamoe_layer_run(layer, &a, NULL), MEGAMOE_ERROR_INVALID_ARGUMENT, "give both, or router_logits");
  a.topk_ids = (const int32_t*)(const void*)g_fake_device;
  EXPECT(megamoe_layer_run(layer, &a, NULL), MEGAMOE_ERROR_INVALID_ARGUMENT, "args.topk_weights is NULL");
  a.topk_weights = (const float*)(const void*)g_fake_device;
  a.router_logits = (const float*)(const void*)g_fake_device;
  EXPECT(megamoe_layer_run(layer, &a, NULL), MEGAMOE_ERROR_INVALID_ARGUMENT, "both router_logits and topk_ids");
  a.router_logits = NULL;
  EXPECT(megamoe_layer_run(layer, &a, NULL), MEGAMOE_ERROR_INVALID_ARGUMENT, "args.hidden is NULL");
  a.hidden = g_fake_device;
  EXPECT(megamoe_layer_run(layer, &a, NULL), MEGAMOE_ERROR_INVALID_ARGUMENT, "give exactly one");
  a.output = g_fake_device;
  a.output_f32 = (float*)(void*)g_fake_device;
  EXPECT(megamoe_layer_run(layer, &a, NULL), MEGAMOE_ERROR_INVALID_ARGUMENT, "give exactly one");
  a.output_f32 = NULL;
  a.workspace = g_fake_device;
  a.workspace_size = workspace - 1;
  EXPECT(megamoe_layer_run(layer, &a, NULL), MEGAMOE_ERROR_INVALID_ARGUMENT, "megamoe_layer_workspace_size");
  a.workspace = NULL;
  EXPECT(megamoe_layer_run(external, &a, NULL), MEGAMOE_ERROR_INVALID_ARGUMENT, "external_workspace = 1");
  EXPECT(megamoe_layer_invalid_id_count(external, NULL, NULL, &count), MEGAMOE_ERROR_INVALID_ARGUMENT, "external_workspace = 1");
  EXPECT(megamoe_layer_invalid_id_count(layer, NULL, NULL, NULL), MEGAMOE_ERROR_INVALID_ARGUMENT, "count is NULL");

  EXPECT(megamoe_layer_destroy(external), MEGAMOE_OK, NULL);
  EXPECT(megamoe_layer_destroy(layer), MEGAMOE_OK, NULL);
}

int main(int argc, char** argv) {
  megamoe_checkpoint* ckpt = NULL;
  megamoe_layer_options o;
  megamoe_layer* layer = NULL;
  int devices = 0;
  int layers_possible;

  if (argc != 3) {
    fprintf(stderr, "usage: %s CHECKPOINT_DIR SCRATCH_DIR\n", argv[0]);
    return 2;
  }
  megamoe_device_count(&devices);
  layers_possible = megamoe_has_cuda() && devices > 0;

  test_library();
  test_checkpoint(argv[1], argv[2]);
  if (megamoe_checkpoint_open(argv[1], &ckpt) == MEGAMOE_OK) {
    test_layer_options(argv[1], ckpt);
    if (!layers_possible) {
      /* Valid arguments: the layer is loaded and checked on the host, then the device is missing. */
      megamoe_layer_options_init(&o);
      o.max_tokens = 16;
      EXPECT(megamoe_layer_create(ckpt, 0, &o, &layer), MEGAMOE_ERROR_UNSUPPORTED,
             megamoe_has_cuda() ? "no CUDA device" : "built without CUDA");
      CHECK(layer == NULL);
    }
    megamoe_checkpoint_close(ckpt);
  }
  test_missing_layers(argv[1], argv[2]);
  test_stacked(layers_possible);
  test_null_layer();
  if (layers_possible) {
    test_layer_arguments(argv[1]);
  } else {
    printf("no GPU: the argument checks of megamoe_layer_run, _describe, _get_info on a live layer are "
           "exercised on the GPU machine\n");
  }
  printf("megamoe C API error paths: %d checks, %d failed\n", g_checks, g_failures);
  return g_failures == 0 ? 0 : 1;
}
