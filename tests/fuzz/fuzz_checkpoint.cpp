// Fuzz target for the safetensors header parser and the checkpoint loader (libFuzzer's entry
// point; tests/fuzz/replay_main.cpp drives it over the seed corpus where libFuzzer is absent).
//
// The first byte picks what the rest is:
//   even: a .safetensors file. It is opened (header validation), every tensor's bytes are
//         touched, and it is loaded as layer 0 of a small Qwen3-MoE-style model (H 32, I 16,
//         2 experts, top-1): names, dtypes, shapes, every block scale and global scale are
//         checked, and a loaded layer runs one token through the CPU reference.
//   odd:  a config.json, read by load_model_config.
// megamoe::Error is the expected way to refuse an input; anything else escaping (another
// exception, a crash, a sanitizer report, a hang) is a bug.

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "megamoe/checkpoint.h"
#include "megamoe/dtype.h"
#include "megamoe/reference.h"
#include "megamoe/safetensors.h"
#include "megamoe/status.h"

namespace {

namespace fs = std::filesystem;

// The model the fuzzed safetensors file is loaded as.
megamoe::ModelConfig small_model() {
  megamoe::ModelConfig c;
  c.architecture = "Qwen3MoeForCausalLM";
  c.model_type = "qwen3_moe";
  c.hidden_size = 32;
  c.moe_intermediate_size = 16;
  c.num_experts = 2;
  c.num_experts_per_tok = 1;
  c.num_hidden_layers = 1;
  c.decoder_sparse_step = 1;
  c.norm_topk_prob = true;
  c.scoring_func = "softmax";
  c.topk_method = "greedy";
  return c;
}

// A file descriptor in memory (no disk traffic per input), reached by path through /proc.
struct MemFile {
  int fd = -1;
  std::string path;
  MemFile() {
    fd = ::memfd_create("megamoe_fuzz", MFD_CLOEXEC);
    if (fd < 0) {
      std::perror("memfd_create");
      std::abort();
    }
    path = "/proc/self/fd/" + std::to_string(fd);
  }
  void write(const uint8_t* data, size_t size) const {
    if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, data, size, 0) != ssize_t(size)) {
      std::perror("memfd write");
      std::abort();
    }
  }
};

// A directory of its own for config.json (load_model_config takes a directory).
const fs::path& config_dir() {
  static const fs::path dir = [] {
    const fs::path d = fs::temp_directory_path() / ("megamoe_fuzz_" + std::to_string(::getpid()));
    fs::create_directories(d);
    std::atexit([] { std::error_code ec; fs::remove_all(config_dir(), ec); });
    return d;
  }();
  return dir;
}

void fuzz_safetensors(const uint8_t* data, size_t size) {
  static const MemFile file;
  file.write(data, size);
  try {
    const auto f = megamoe::SafetensorsFile::open(file.path);
    uint64_t sum = 0;
    for (const megamoe::TensorInfo& t : f->tensors()) {
      const auto bytes = f->bytes(t);
      if (!bytes.empty()) sum += bytes.front() + bytes.back();
      if (f->find(t.name) != &t) std::abort();  // the index must find every tensor
    }
    (void)sum;
    const megamoe::Checkpoint ckpt = megamoe::Checkpoint::open(file.path);
    const megamoe::MoeLayer layer = megamoe::load_moe_layer(ckpt, small_model(), 0);
    const std::vector<uint16_t> hidden(32, megamoe::f32_to_bf16(0.5f));
    megamoe::reference::TopK topk;
    topk.tokens = 1;
    topk.k = 1;
    topk.ids = {1};
    topk.weights = {1.0f};
    (void)megamoe::reference::moe_forward(layer, hidden, 1, topk, {.threads = 1});
  } catch (const megamoe::Error&) {
  }
}

void fuzz_config(const uint8_t* data, size_t size) {
  {
    std::FILE* f = std::fopen((config_dir() / "config.json").c_str(), "wb");
    if (f == nullptr || std::fwrite(data, 1, size, f) != size) std::abort();
    std::fclose(f);
  }
  try {
    const megamoe::ModelConfig c = megamoe::load_model_config(config_dir().string());
    for (int64_t l = 0; l < 4; ++l) (void)c.is_moe_layer(l);
    (void)c.routing();
  } catch (const megamoe::Error&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  if (data[0] % 2 == 0) {
    fuzz_safetensors(data + 1, size - 1);
  } else {
    fuzz_config(data + 1, size - 1);
  }
  return 0;
}
