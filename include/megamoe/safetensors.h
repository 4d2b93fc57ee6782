// safetensors files: a memory-mapped, fully validated reader and a streaming writer.
// Format: u64 little-endian header length N, N bytes of JSON
//   {"name": {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, "__metadata__": {..}}
// then the data section; offsets are relative to its start.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "megamoe/dtype.h"

namespace megamoe {

struct TensorInfo {
  std::string name;
  DType dtype = DType::U8;
  std::vector<int64_t> shape;  // empty for a scalar
  uint64_t begin = 0;          // byte offset in the data section
  uint64_t end = 0;            // one past the last byte
  int64_t numel() const;
  uint64_t nbytes() const { return end - begin; }
};

// "[7168, 2048]" style shape text for messages.
std::string shape_string(std::span<const int64_t> shape);

class SafetensorsFile {
 public:
  // Maps the file read-only and validates the whole header: JSON well-formed, known dtypes,
  // non-negative shapes, offsets in bounds, byte sizes equal numel*dtype size, no overlaps, no
  // gaps-beyond-file. Throws megamoe::Error naming the file and the tensor on any violation.
  static std::shared_ptr<const SafetensorsFile> open(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::vector<TensorInfo>& tensors() const { return tensors_; }  // sorted by begin offset
  const TensorInfo* find(std::string_view name) const;                 // nullptr if absent
  std::span<const uint8_t> bytes(const TensorInfo& t) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  SafetensorsFile() = default;
  std::string path_;
  const uint8_t* map_ = nullptr;
  uint64_t map_size_ = 0;
  uint64_t data_start_ = 0;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
};

struct TensorSpec {
  std::string name;
  DType dtype = DType::U8;
  std::vector<int64_t> shape;
};

// Streaming writer: every tensor is declared up front (so the header can be written first), then
// data is appended in declaration order, in as many chunks as the caller likes. finish() checks
// that every declared byte was written and closes the file; the destructor of an unfinished
// writer removes the partial file.
class SafetensorsWriter {
 public:
  SafetensorsWriter(const std::string& path, std::vector<TensorSpec> specs,
                    const std::map<std::string, std::string>& metadata = {});
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  // Appends bytes to the tensor currently being written; `name` must be that tensor.
  void append(std::string_view name, std::span<const uint8_t> bytes);
  void finish();

 private:
  std::string path_;
  void* file_ = nullptr;  // FILE*
  std::vector<TensorSpec> specs_;
  std::vector<uint64_t> sizes_;
  size_t current_ = 0;
  uint64_t written_in_current_ = 0;
  bool finished_ = false;
};

// Convenience: writes a whole file from in-memory tensors (bytes must match each spec).
void write_safetensors(const std::string& path,
                       const std::vector<std::pair<TensorSpec, std::span<const uint8_t>>>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace megamoe
