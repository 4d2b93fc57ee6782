#include "checkpoint/json_file.h"

#include <fstream>
#include <sstream>

#include "megamoe/status.h"

namespace megamoe::checkpoint_detail {

nlohmann::json read_json_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  MEGAMOE_CHECK(in.good(), kIo, "cannot read '", path.string(), "'.");
  std::ostringstream text;
  text << in.rdbuf();
  try {
    return nlohmann::json::parse(text.str());
  } catch (const nlohmann::json::exception& e) {
    MEGAMOE_FAIL(kInvalidCheckpoint, "'", path.string(), "' is not valid JSON: ", e.what());
  }
}

}  // namespace megamoe::checkpoint_detail
