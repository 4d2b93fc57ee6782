// A checkpoint on disk: one .safetensors file, or a directory holding either a sharded set
// described by model.safetensors.index.json or exactly one *.safetensors file.

#include "megamoe/checkpoint.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>

#include "checkpoint/json_file.h"
#include "megamoe/status.h"

namespace megamoe {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr const char* kIndexName = "model.safetensors.index.json";

using checkpoint_detail::read_json_file;

// A shard named by index.json must be a file of the checkpoint directory itself: a path with a
// directory part (or "..") would let a downloaded index point anywhere on the machine.
bool is_plain_file_name(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
         name.find('\\') == std::string::npos;
}

}  // namespace

const char* quant_format_name(QuantFormat f) {
  switch (f) {
    case QuantFormat::kUnquantized: return "unquantized";
    case QuantFormat::kModelOptNvfp4: return "modelopt-nvfp4";
    case QuantFormat::kCompressedTensorsNvfp4: return "compressed-tensors-nvfp4";
  }
  return "unknown";
}

Checkpoint Checkpoint::open(const std::string& path) {
  Checkpoint ckpt;
  ckpt.path_ = path;
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  MEGAMOE_CHECK(fs::exists(st), kNotFound, "checkpoint '", path, "' does not exist.");

  if (!fs::is_directory(st)) {
    ckpt.files_.push_back(SafetensorsFile::open(path));
    for (const TensorInfo& t : ckpt.files_[0]->tensors()) ckpt.where_.emplace_back(t.name, 0);
  } else if (const fs::path index_path = fs::path(path) / kIndexName; fs::exists(index_path, ec)) {
    const json index = read_json_file(index_path, "shard index");
    MEGAMOE_CHECK(index.is_object() && index.contains("weight_map") &&
                      index["weight_map"].is_object(),
                  kInvalidCheckpoint, "'", index_path.string(),
                  "' has no \"weight_map\" object mapping tensor names to shard files.");
    std::map<std::string, size_t> shard_index;  // shard file name -> index in files_
    for (const auto& [tensor, shard_json] : index["weight_map"].items()) {
      MEGAMOE_CHECK(shard_json.is_string(), kInvalidCheckpoint, "'", index_path.string(),
                    "' maps tensor '", tensor, "' to a ", shard_json.type_name(),
                    "; expected a shard file name.");
      const std::string& shard = shard_json.get_ref<const std::string&>();
      MEGAMOE_CHECK(is_plain_file_name(shard), kInvalidCheckpoint, "'", index_path.string(),
                    "' maps tensor '", tensor, "' to '", shard,
                    "'; shards must be plain file names in the checkpoint directory.");
      auto it = shard_index.find(shard);
      if (it == shard_index.end()) {
        const fs::path shard_path = fs::path(path) / shard;
        // Only existence here: SafetensorsFile::open rejects a directory or FIFO as such.
        MEGAMOE_CHECK(fs::exists(shard_path, ec), kNotFound, "shard '", shard_path.string(),
                      "' named in '", index_path.string(), "' (for tensor '", tensor,
                      "') does not exist.");
        ckpt.files_.push_back(SafetensorsFile::open(shard_path.string()));
        it = shard_index.emplace(shard, ckpt.files_.size() - 1).first;
      }
      const auto& file = ckpt.files_[it->second];
      MEGAMOE_CHECK(file->find(tensor) != nullptr, kInvalidCheckpoint, "'", index_path.string(),
                    "' maps tensor '", tensor, "' to shard '", file->path(),
                    "', which does not contain it.");
      ckpt.where_.emplace_back(tensor, it->second);
    }
  } else {
    std::vector<fs::path> candidates;
    // The error_code overloads: a directory that cannot be listed gets a megamoe::Error, not a
    // std::filesystem_error.
    for (fs::directory_iterator it(path, ec), end; !ec && it != end; it.increment(ec)) {
      std::error_code entry_ec;
      if (it->is_regular_file(entry_ec) && it->path().extension() == ".safetensors") {
        candidates.push_back(it->path());
      }
    }
    MEGAMOE_CHECK(!ec, kIo, "cannot list checkpoint directory '", path, "': ", ec.message(), ".");
    std::sort(candidates.begin(), candidates.end());
    MEGAMOE_CHECK(!candidates.empty(), kNotFound, "checkpoint directory '", path, "' has no ",
                  kIndexName, " and no *.safetensors file.");
    if (candidates.size() > 1) {
      std::string names;
      for (const auto& c : candidates) names += (names.empty() ? "" : ", ") + c.filename().string();
      MEGAMOE_FAIL(kInvalidCheckpoint, "checkpoint directory '", path, "' has ", candidates.size(),
                   " *.safetensors files (", names, ") but no ", kIndexName,
                   " saying which tensor is in which; expected one file or an index.");
    }
    ckpt.files_.push_back(SafetensorsFile::open(candidates[0].string()));
    for (const TensorInfo& t : ckpt.files_[0]->tensors()) ckpt.where_.emplace_back(t.name, 0);
  }
  std::sort(ckpt.where_.begin(), ckpt.where_.end());
  return ckpt;
}

std::optional<TensorRef> Checkpoint::find(const std::string& name) const {
  const auto it = std::lower_bound(where_.begin(), where_.end(), name,
                                   [](const auto& entry, const std::string& n) { return entry.first < n; });
  if (it == where_.end() || it->first != name) return std::nullopt;
  const auto& file = files_[it->second];
  const TensorInfo* info = file->find(name);
  return TensorRef{info, file, file->bytes(*info)};
}

TensorRef Checkpoint::get(const std::string& name) const {
  auto ref = find(name);
  MEGAMOE_CHECK(ref.has_value(), kNotFound, "tensor '", name, "' is not in checkpoint '", path_,
                "'.");
  return *ref;
}

std::vector<std::string> Checkpoint::tensor_names() const {
  std::vector<std::string> names;
  names.reserve(where_.size());
  for (const auto& entry : where_) names.push_back(entry.first);
  return names;
}

}  // namespace megamoe
