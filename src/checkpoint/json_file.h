// Reading a JSON file of a checkpoint (config.json, hf_quant_config.json, the shard index).
#pragma once

#include <filesystem>

#include <nlohmann/json.hpp>

namespace megamoe::checkpoint_detail {

// Throws megamoe::Error(kIo) when the file cannot be read and (kInvalidCheckpoint) naming the
// file when it is not valid JSON.
nlohmann::json read_json_file(const std::filesystem::path& path);

}  // namespace megamoe::checkpoint_detail
