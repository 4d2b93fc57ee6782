// Runs the fuzz target once on every file named on the command line (or found in a named
// directory): the seed corpus as a regression test in every build, with any compiler. libFuzzer
// builds (MEGAMOE_FUZZ=ON with clang) link libFuzzer's own main instead and explore from there.
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

int main(int argc, char** argv) {
  namespace fs = std::filesystem;
  std::vector<fs::path> files;
  for (int i = 1; i < argc; ++i) {
    if (fs::is_directory(argv[i])) {
      for (const auto& e : fs::directory_iterator(argv[i])) files.push_back(e.path());
    } else {
      files.emplace_back(argv[i]);
    }
  }
  if (files.empty()) {
    std::fprintf(stderr, "usage: %s FILE|DIR...: no input files found\n", argv[0]);
    return 2;
  }
  for (const fs::path& p : files) {
    std::ifstream in(p, std::ios::binary);
    const std::vector<uint8_t> data{std::istreambuf_iterator<char>(in),
                                    std::istreambuf_iterator<char>()};
    LLVMFuzzerTestOneInput(data.data(), data.size());
  }
  std::printf("ran %zu inputs\n", files.size());
  return 0;
}
