// Reading a JSON file of a checkpoint (config.json, hf_quant_config.json, the shard index), the
// strict parse shared with the safetensors header, and JSON values quoted in error messages.
#pragma once

#include <filesystem>
#include <functional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace megamoe::checkpoint_detail {

// Throws megamoe::Error naming the file: kNotFound when it does not exist, kInvalidArgument when
// it is not a regular file (a directory, FIFO or device: checked without blocking on a FIFO),
// kIo when it cannot be read, kInvalidCheckpoint when it is not valid JSON (see parse_json_strict).
// `what` says what the file is for messages ("model config").
nlohmann::json read_json_file(const std::filesystem::path& path, const char* what = "JSON file");

// Parses `text` as one JSON document and rejects what nlohmann would silently accept or what
// could exhaust memory: a NUL byte (nlohmann ends the input there and ignores the rest), a key
// twice in one object (nlohmann keeps the last) and nesting deeper than `max_depth` arrays or
// objects. Errors are megamoe::Error(kInvalidCheckpoint) starting with `where()`.
nlohmann::json parse_json_strict(std::string_view text, int max_depth,
                                 const std::function<std::string()>& where);

// A JSON value as quoted in an error message: at most a few levels deep and about 120
// characters, whatever its size or depth (a full dump of a hostile value could be megabytes long
// or overflow the stack). Never throws on odd strings.
std::string json_brief(const nlohmann::json& value);

}  // namespace megamoe::checkpoint_detail
