// safetensors writer: the header declared up front, then the tensors streamed in declaration
// order; a file that is not finished is removed.

#include "megamoe/safetensors.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <set>
#include <utility>

#include <nlohmann/json.hpp>

#include "checkpoint/safetensors_layout.h"
#include "megamoe/status.h"

namespace megamoe {

using checkpoint_detail::checked_extent;
using checkpoint_detail::kMetadataKey;

SafetensorsWriter::SafetensorsWriter(const std::string& path, std::vector<TensorSpec> specs,
                                     const std::map<std::string, std::string>& metadata)
    : path_(path), specs_(std::move(specs)) {
  // Validate everything before creating the file, so a rejected call leaves nothing behind.
  std::set<std::string_view> names;
  // ordered_json keeps __metadata__ first and the tensors in declaration (= offset) order, which
  // makes headers readable; readers do not depend on key order.
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header[kMetadataKey] = metadata;
  uint64_t offset = 0;
  for (const TensorSpec& s : specs_) {
    MEGAMOE_CHECK(!s.name.empty() && s.name != kMetadataKey, kInvalidArgument,
                  "safetensors writer for '", path, "': tensor name '", s.name,
                  "' is not allowed (names must be non-empty and not __metadata__).");
    MEGAMOE_CHECK(names.insert(s.name).second, kInvalidArgument, "safetensors writer for '", path,
                  "': tensor '", s.name, "' is declared twice.");
    const auto extent = checked_extent(s.shape, s.dtype);
    MEGAMOE_CHECK(extent.has_value(), kInvalidArgument, "safetensors writer for '", path,
                  "': tensor '", s.name, "' has shape ", shape_string(s.shape),
                  "; dimensions must be non-negative and the byte size must fit in 64 bits.");
    uint64_t end = 0;
    MEGAMOE_CHECK(!__builtin_add_overflow(offset, extent->bytes, &end), kInvalidArgument,
                  "safetensors writer for '", path, "': the data section overflows 64 bits at tensor '",
                  s.name, "'.");
    header[s.name] = {{"dtype", dtype_name(s.dtype)},
                      {"shape", s.shape},
                      {"data_offsets", {offset, end}}};
    sizes_.push_back(extent->bytes);
    offset = end;
  }
  std::string text = header.dump();
  // Like the reference implementation: pad the header with spaces so the data section starts
  // 8-byte aligned in the file (and therefore in the page-aligned mapping of a reader).
  text.append((8 - text.size() % 8) % 8, ' ');

  // An existing FIFO would block fopen until a reader comes, and a device would receive the
  // data: the output must be a new or a regular file.
  struct stat st {};
  MEGAMOE_CHECK(::stat(path.c_str(), &st) != 0 || S_ISREG(st.st_mode), kInvalidArgument,
                "safetensors output '", path,
                "' exists and is not a regular file (a directory, FIFO or device); write to a new "
                "or a regular file.");
  FILE* fp = std::fopen(path.c_str(), "wb");
  MEGAMOE_CHECK(fp != nullptr, kIo, "cannot create safetensors file '", path, "': ",
                std::strerror(errno), ".");
  file_ = fp;
  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(uint64_t(text.size()) >> (8 * i));
  if (std::fwrite(len, 1, 8, fp) != 8 || std::fwrite(text.data(), 1, text.size(), fp) != text.size()) {
    const int err = errno;
    std::fclose(fp);
    file_ = nullptr;
    std::remove(path_.c_str());
    MEGAMOE_FAIL(kIo, "cannot write the header of safetensors file '", path, "': ",
                 std::strerror(err), ".");
  }
}

SafetensorsWriter::~SafetensorsWriter() {
  // file_ is open only while unfinished (finish() and write errors close it): drop the partial file.
  if (file_ != nullptr) {
    std::fclose(static_cast<FILE*>(file_));
    std::remove(path_.c_str());
  }
}

void SafetensorsWriter::append(std::string_view name, std::span<const uint8_t> bytes) {
  MEGAMOE_CHECK(!finished_, kInvalidArgument, "safetensors writer for '", path_,
                "': append to tensor '", name, "' after finish().");
  MEGAMOE_CHECK(file_ != nullptr, kInvalidArgument, "safetensors writer for '", path_,
                "': append to tensor '", name, "' after an earlier write error closed the file.");
  // Tensors that are complete (zero-byte ones are complete from the start) hand over to the next
  // declared tensor; the current incomplete tensor is the only one that may receive bytes.
  while (current_ < specs_.size() && written_in_current_ == sizes_[current_] &&
         specs_[current_].name != name) {
    ++current_;
    written_in_current_ = 0;
  }
  if (current_ == specs_.size() || specs_[current_].name != name) {
    const bool declared = std::any_of(specs_.begin(), specs_.end(),
                                      [&](const TensorSpec& s) { return s.name == name; });
    MEGAMOE_CHECK(declared, kInvalidArgument, "safetensors writer for '", path_,
                  "': no tensor named '", name, "' was declared.");
    MEGAMOE_CHECK(current_ < specs_.size(), kInvalidArgument, "safetensors writer for '", path_,
                  "': tensor '", name, "' is already complete; every declared tensor has been written.");
    MEGAMOE_FAIL(kInvalidArgument, "safetensors writer for '", path_, "': append to tensor '", name,
                 "' while tensor '", specs_[current_].name, "' is being written (",
                 written_in_current_, " of ", sizes_[current_],
                 " bytes); tensors must be written completely, in declaration order.");
  }
  const uint64_t left = sizes_[current_] - written_in_current_;
  MEGAMOE_CHECK(bytes.size() <= left, kInvalidArgument, "safetensors writer for '", path_,
                "': ", bytes.size(), " bytes appended to tensor '", name, "', which has only ", left,
                " of its ", sizes_[current_], " bytes left.");
  if (bytes.empty()) return;
  FILE* fp = static_cast<FILE*>(file_);
  if (std::fwrite(bytes.data(), 1, bytes.size(), fp) != bytes.size()) {
    const int err = errno;
    std::fclose(fp);
    file_ = nullptr;
    std::remove(path_.c_str());
    MEGAMOE_FAIL(kIo, "cannot write tensor '", name, "' to safetensors file '", path_, "': ",
                 std::strerror(err), ".");
  }
  written_in_current_ += bytes.size();
}

void SafetensorsWriter::finish() {
  MEGAMOE_CHECK(!finished_, kInvalidArgument, "safetensors writer for '", path_,
                "': finish() called twice.");
  MEGAMOE_CHECK(file_ != nullptr, kInvalidArgument, "safetensors writer for '", path_,
                "': finish() after an earlier write error closed the file.");
  while (current_ < specs_.size() && written_in_current_ == sizes_[current_]) {
    ++current_;
    written_in_current_ = 0;
  }
  MEGAMOE_CHECK(current_ == specs_.size(), kInvalidArgument, "safetensors writer for '", path_,
                "': finish() with tensor '", specs_[current_].name, "' incomplete (",
                written_in_current_, " of ", sizes_[current_], " bytes written).");
  FILE* fp = static_cast<FILE*>(file_);
  file_ = nullptr;
  const bool ok = std::fflush(fp) == 0 && !std::ferror(fp);
  const int err = errno;
  if (std::fclose(fp) != 0 || !ok) {
    std::remove(path_.c_str());
    MEGAMOE_FAIL(kIo, "cannot finish safetensors file '", path_, "': ", std::strerror(err), ".");
  }
  finished_ = true;
}

void write_safetensors(const std::string& path,
                       const std::vector<std::pair<TensorSpec, std::span<const uint8_t>>>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  std::vector<TensorSpec> specs;
  specs.reserve(tensors.size());
  for (const auto& [spec, bytes] : tensors) specs.push_back(spec);
  SafetensorsWriter writer(path, std::move(specs), metadata);
  // Check each buffer against its spec here: the writer alone would report a short buffer only
  // as "the next tensor arrived early", which hides which buffer was wrong.
  for (const auto& [spec, bytes] : tensors) {
    const auto extent = checked_extent(spec.shape, spec.dtype);  // valid: the writer checked it
    MEGAMOE_CHECK(bytes.size() == extent->bytes, kInvalidArgument, "write_safetensors('", path,
                  "'): tensor '", spec.name, "' is given ", bytes.size(), " bytes, but dtype ",
                  dtype_name(spec.dtype), " and shape ", shape_string(spec.shape), " need ",
                  extent->bytes, ".");
    writer.append(spec.name, bytes);
  }
  writer.finish();
}

}  // namespace megamoe
