/* Loads one MoE layer of an NVFP4 checkpoint through the C API and runs it on random tokens.
 *
 *   megamoe_example_run_layer CHECKPOINT_DIR LAYER [TOKENS]
 *
 * An engine computes the router logits with its own gate GEMM; here they are random, and the
 * layer routes them on the device (softmax top-k or DeepSeek's noaux_tc, from config.json).
 * Build: CMake target megamoe_example_run_layer, or against an installed package:
 *   cc -std=c99 run_layer.c -I$PREFIX/include -L$PREFIX/lib -lmegamoe -lcudart */
#include <cuda_runtime_api.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "megamoe/megamoe.h"

/* Prints the failed call's status and message and leaves: an example has nothing to clean up for. */
static void check(megamoe_status status, const char* call) {
  if (status != MEGAMOE_OK) {
    fprintf(stderr, "%s (%s): %s\n", megamoe_status_name(status), call, megamoe_last_error());
    exit(1);
  }
}

static void check_cuda(cudaError_t err, const char* call) {
  if (err != cudaSuccess) {
    fprintf(stderr, "%s: %s\n", call, cudaGetErrorString(err));
    exit(1);
  }
}

/* Uniform in [-1, 1) from a 64-bit LCG: reproducible tokens without a library. */
static float uniform(uint64_t* state) {
  *state = *state * 6364136223846793005ull + 1442695040888963407ull;
  return (float)((*state >> 40) * (1.0 / (1ull << 24))) * 2.0f - 1.0f;
}

/* fp32 -> bf16 bits, rounded to nearest even (finite inputs). */
static uint16_t to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

static float from_bf16(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

int main(int argc, char** argv) {
  megamoe_checkpoint* checkpoint = NULL;
  megamoe_checkpoint_info info;
  megamoe_layer_options options;
  megamoe_layer* layer = NULL;
  megamoe_run_args args;
  cudaStream_t stream;
  uint16_t *hidden, *output, *d_hidden, *d_output;
  float *logits, *d_logits;
  char config[256];
  uint64_t rng = 0x5eed;
  int64_t layer_index, tokens, H, E, i;
  double sum = 0.0;
  int64_t non_finite = 0;

  if (argc < 3 || argc > 4) {
    fprintf(stderr, "usage: %s CHECKPOINT_DIR LAYER [TOKENS]\n", argv[0]);
    return 2;
  }
  layer_index = strtoll(argv[2], NULL, 10);
  tokens = argc == 4 ? strtoll(argv[3], NULL, 10) : 16;
  if (tokens < 1) {
    fprintf(stderr, "TOKENS must be at least 1\n");
    return 2;
  }

  check(megamoe_checkpoint_open(argv[1], &checkpoint), "megamoe_checkpoint_open");
  memset(&info, 0, sizeof info);
  info.struct_size = sizeof info;
  check(megamoe_checkpoint_describe(checkpoint, &info), "megamoe_checkpoint_describe");
  H = info.hidden_size;
  E = info.num_experts;
  printf("%s: %lld layers, H = %lld, E = %lld, top-%d\n", argv[1], (long long)info.num_layers, (long long)H,
         (long long)E, info.top_k);

  check(megamoe_layer_options_init(&options), "megamoe_layer_options_init");
  options.max_tokens = tokens;
  check(megamoe_layer_create(checkpoint, layer_index, &options, &layer), "megamoe_layer_create");
  check(megamoe_checkpoint_close(checkpoint), "megamoe_checkpoint_close");
  check(megamoe_layer_describe(layer, tokens, config, sizeof config, NULL), "megamoe_layer_describe");
  printf("layer %lld: %s\n", (long long)layer_index, config);

  hidden = (uint16_t*)malloc((size_t)(tokens * H) * sizeof *hidden);
  output = (uint16_t*)malloc((size_t)(tokens * H) * sizeof *output);
  logits = (float*)malloc((size_t)(tokens * E) * sizeof *logits);
  if (!hidden || !output || !logits) {
    fprintf(stderr, "out of host memory\n");
    return 1;
  }
  for (i = 0; i < tokens * H; ++i) hidden[i] = to_bf16(uniform(&rng));
  for (i = 0; i < tokens * E; ++i) logits[i] = 4.0f * uniform(&rng);

  check_cuda(cudaSetDevice(options.device), "cudaSetDevice");
  check_cuda(cudaStreamCreate(&stream), "cudaStreamCreate");
  check_cuda(cudaMalloc((void**)&d_hidden, (size_t)(tokens * H) * sizeof *d_hidden), "cudaMalloc");
  check_cuda(cudaMalloc((void**)&d_output, (size_t)(tokens * H) * sizeof *d_output), "cudaMalloc");
  check_cuda(cudaMalloc((void**)&d_logits, (size_t)(tokens * E) * sizeof *d_logits), "cudaMalloc");
  check_cuda(cudaMemcpy(d_hidden, hidden, (size_t)(tokens * H) * sizeof *hidden, cudaMemcpyHostToDevice), "cudaMemcpy");
  check_cuda(cudaMemcpy(d_logits, logits, (size_t)(tokens * E) * sizeof *logits, cudaMemcpyHostToDevice), "cudaMemcpy");

  check(megamoe_run_args_init(&args), "megamoe_run_args_init");
  args.tokens = tokens;
  args.hidden = d_hidden;
  args.router_logits = d_logits;
  args.output = d_output;
  /* A cudaStream_t is the C API's megamoe_stream. */
  check(megamoe_layer_run(layer, &args, stream), "megamoe_layer_run");
  check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  check_cuda(cudaMemcpy(output, d_output, (size_t)(tokens * H) * sizeof *output, cudaMemcpyDeviceToHost), "cudaMemcpy");

  for (i = 0; i < tokens * H; ++i) {
    const float v = from_bf16(output[i]);
    if (isfinite(v)) {
      sum += fabs(v);
    } else {
      ++non_finite;
    }
  }
  printf("%lld tokens: mean |output| = %.6g, %lld non-finite values\n", (long long)tokens,
         sum / (double)(tokens * H), (long long)non_finite);

  check(megamoe_layer_destroy(layer), "megamoe_layer_destroy");
  cudaFree(d_hidden);
  cudaFree(d_output);
  cudaFree(d_logits);
  cudaStreamDestroy(stream);
  free(hidden);
  free(output);
  free(logits);
  return non_finite == 0 ? 0 : 1;
}
