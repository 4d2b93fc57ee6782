// safetensors reader: the file memory-mapped, its header fully validated before any byte is
// handed out. The format: u64 little-endian header length N, N bytes of JSON, then the data
// section; every tensor's data_offsets are relative to the start of the data section.

#include "megamoe/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>
#include <tuple>

#include <nlohmann/json.hpp>

#include "checkpoint/json_file.h"
#include "checkpoint/safetensors_layout.h"
#include "megamoe/status.h"

namespace megamoe {
namespace {

using nlohmann::json;
using checkpoint_detail::checked_extent;
using checkpoint_detail::json_brief;
using checkpoint_detail::kMetadataKey;

// The reference implementation refuses headers above 100 MB; a header that large is corruption,
// not a checkpoint (the biggest real ones are a few MB), and mapping it as JSON would be slow.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
constexpr uint64_t kLengthFieldBytes = 8;
// A valid header nests three levels (the object, a tensor entry, its shape); a few more let a
// slightly wrong file get the specific message below instead of a nesting error, and the bound
// keeps a hostile header from building millions of nested values.
constexpr int kMaxHeaderDepth = 8;

constexpr DType kAllDTypes[] = {DType::BF16, DType::F16,     DType::F32,
                                DType::U8,   DType::I8,      DType::I32,
                                DType::I64,  DType::F8_E4M3, DType::F8_E5M2};

std::string supported_dtype_list() {
  std::string s;
  for (DType t : kAllDTypes) {
    if (!s.empty()) s += ", ";
    s += dtype_name(t);
  }
  return s;
}

uint64_t read_u64_le(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// JSON type names for messages ("expected an array, got string").
std::string json_kind(const json& j) { return j.type_name(); }

// Parses one tensor entry of the header; `data_size` is the size of the data section.
TensorInfo parse_entry(const std::string& path, const std::string& name, const json& entry,
                       uint64_t data_size) {
  const auto where = [&] { return detail::concat("safetensors file '", path, "': tensor '", name, "'"); };
  MEGAMOE_CHECK(entry.is_object(), kInvalidCheckpoint, where(),
                " must be a JSON object with dtype, shape and data_offsets, but is a ",
                json_kind(entry), ".");
  for (const char* field : {"dtype", "shape", "data_offsets"}) {
    MEGAMOE_CHECK(entry.contains(field), kInvalidCheckpoint, where(), " has no '", field,
                  "' field; every tensor needs dtype, shape and data_offsets.");
  }

  TensorInfo t;
  t.name = name;

  const json& dt = entry["dtype"];
  MEGAMOE_CHECK(dt.is_string(), kInvalidCheckpoint, where(), " has a dtype that is a ",
                json_kind(dt), ", not a string.");
  const auto dtype = dtype_from_name(dt.get_ref<const std::string&>());
  MEGAMOE_CHECK(dtype.has_value(), kUnsupported, where(), " has unsupported dtype '",
                dt.get_ref<const std::string&>(), "'; supported dtypes are ",
                supported_dtype_list(), ".");
  t.dtype = *dtype;

  const json& shape = entry["shape"];
  MEGAMOE_CHECK(shape.is_array(), kInvalidCheckpoint, where(), " has a shape that is a ",
                json_kind(shape), ", not an array of non-negative integers.");
  for (const json& d : shape) {
    MEGAMOE_CHECK(d.is_number_unsigned() && d.get<uint64_t>() <= uint64_t(INT64_MAX),
                  kInvalidCheckpoint, where(), " has shape ", json_brief(shape),
                  "; every dimension must be a non-negative integer.");
    t.shape.push_back(d.get<int64_t>());
  }
  const auto extent = checked_extent(t.shape, t.dtype);
  MEGAMOE_CHECK(extent.has_value(), kInvalidCheckpoint, where(), " has shape ",
                shape_string(t.shape), " whose byte size overflows 64 bits.");

  const json& offsets = entry["data_offsets"];
  MEGAMOE_CHECK(offsets.is_array() && offsets.size() == 2 && offsets[0].is_number_unsigned() &&
                    offsets[1].is_number_unsigned(),
                kInvalidCheckpoint, where(), " has data_offsets ", json_brief(offsets),
                "; expected [begin, end] with non-negative integers.");
  t.begin = offsets[0].get<uint64_t>();
  t.end = offsets[1].get<uint64_t>();
  MEGAMOE_CHECK(t.begin <= t.end, kInvalidCheckpoint, where(), " has data_offsets [", t.begin,
                ", ", t.end, "] with begin after end.");
  MEGAMOE_CHECK(t.end <= data_size, kInvalidCheckpoint, where(), " has data_offsets [", t.begin,
                ", ", t.end, "] out of bounds: the data section holds only ", data_size,
                " bytes (the file is truncated or the header is corrupt).");
  MEGAMOE_CHECK(t.end - t.begin == extent->bytes, kInvalidCheckpoint, where(), " has ",
                t.end - t.begin, " bytes of data, but dtype ", dtype_name(t.dtype), " and shape ",
                shape_string(t.shape), " need ", extent->bytes, " bytes (size mismatch).");
  return t;
}

}  // namespace

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string shape_string(std::span<const int64_t> shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

std::shared_ptr<const SafetensorsFile> SafetensorsFile::open(const std::string& path) {
  // make_shared cannot reach the private constructor; the object is never copied after this.
  std::shared_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->path_ = path;

  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer; the fstat below
  // then rejects it (and directories and devices) before anything is read or mapped.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT) {
      MEGAMOE_FAIL(kNotFound, "safetensors file '", path, "' does not exist.");
    }
    MEGAMOE_FAIL(kIo, "cannot open safetensors file '", path, "': ", std::strerror(err), ".");
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    MEGAMOE_FAIL(kIo, "cannot stat safetensors file '", path, "': ", std::strerror(err), ".");
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    MEGAMOE_FAIL(kInvalidArgument, "'", path, "' is not a regular file; expected a .safetensors file.");
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < kLengthFieldBytes) {
    ::close(fd);
    MEGAMOE_FAIL(kInvalidCheckpoint, "safetensors file '", path, "' is truncated: it has ", size,
                 " bytes, fewer than the 8-byte header length field.");
  }
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_err = errno;
  ::close(fd);  // the mapping keeps the file alive
  if (map == MAP_FAILED) {
    MEGAMOE_FAIL(kIo, "cannot memory-map safetensors file '", path, "': ", std::strerror(map_err),
                 ".");
  }
  // From here on the destructor unmaps, also when validation below throws.
  f->map_ = static_cast<const uint8_t*>(map);
  f->map_size_ = size;

  const uint64_t header_len = read_u64_le(f->map_);
  MEGAMOE_CHECK(header_len <= size - kLengthFieldBytes, kInvalidCheckpoint, "safetensors file '",
                path, "' declares a ", header_len, "-byte header, but only ",
                size - kLengthFieldBytes,
                " bytes follow the length field (the file is truncated or not safetensors).");
  MEGAMOE_CHECK(header_len <= kMaxHeaderBytes, kInvalidCheckpoint, "safetensors file '", path,
                "' declares a ", header_len, "-byte header; at most ", kMaxHeaderBytes,
                " bytes are allowed.");
  f->data_start_ = kLengthFieldBytes + header_len;
  const uint64_t data_size = size - f->data_start_;

  // Strict: a NUL byte (nlohmann would stop there and ignore the rest), a key twice in one
  // object (two tensors of one name, or two dtypes in one entry: nlohmann keeps the last) and
  // deep nesting are errors.
  const char* text = reinterpret_cast<const char*>(f->map_ + kLengthFieldBytes);
  const json header =
      checkpoint_detail::parse_json_strict(std::string_view(text, header_len), kMaxHeaderDepth, [&] {
        return detail::concat("safetensors file '", path, "': the header");
      });
  MEGAMOE_CHECK(header.is_object(), kInvalidCheckpoint, "safetensors file '", path,
                "' has a header that is a JSON ", json_kind(header), "; expected a JSON object.");

  for (const auto& [name, entry] : header.items()) {
    if (name == kMetadataKey) {
      MEGAMOE_CHECK(entry.is_object(), kInvalidCheckpoint, "safetensors file '", path,
                    "' has a __metadata__ that is a ", json_kind(entry),
                    "; expected an object of string values.");
      for (const auto& [key, value] : entry.items()) {
        MEGAMOE_CHECK(value.is_string(), kInvalidCheckpoint, "safetensors file '", path,
                      "' has __metadata__ entry '", key, "' that is a ", json_kind(value),
                      "; metadata values must be strings.");
        f->metadata_.emplace(key, value.get<std::string>());
      }
      continue;
    }
    f->tensors_.push_back(parse_entry(path, name, entry, data_size));
  }

  // Sorted by offset, the tensors must cover the data section exactly, as the reference
  // implementation requires: each starts where the previous ones end (zero-byte tensors may share
  // an offset with a neighbour, none may sit inside another), and the last one ends where the
  // file does. A hole or trailing bytes mean a corrupt header: a length field short by a few
  // bytes of padding, for one, shifts every tensor onto its neighbour's bytes and leaves
  // trailing bytes.
  std::sort(f->tensors_.begin(), f->tensors_.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
  });
  uint64_t furthest_end = 0;
  const TensorInfo* furthest = nullptr;
  for (const TensorInfo& t : f->tensors_) {
    MEGAMOE_CHECK(t.begin >= furthest_end, kInvalidCheckpoint, "safetensors file '", path,
                  "': tensor '", t.name, "' (bytes [", t.begin, ", ", t.end,
                  ")) overlaps tensor '", furthest->name, "' (bytes [", furthest->begin, ", ",
                  furthest->end, ")).");
    MEGAMOE_CHECK(t.begin == furthest_end, kInvalidCheckpoint, "safetensors file '", path,
                  "': tensor '", t.name, "' starts at byte ", t.begin,
                  " of the data section, but the tensors before it end at byte ", furthest_end,
                  "; the tensors must cover the data section without holes (the header's offsets "
                  "or its length field are wrong).");
    if (t.end > furthest_end || furthest == nullptr) {
      furthest_end = t.end;
      furthest = &t;
    }
  }
  MEGAMOE_CHECK(furthest_end == data_size, kInvalidCheckpoint, "safetensors file '", path,
                "': the tensors end at byte ", furthest_end, " of the data section, but it holds ",
                data_size, " bytes; ", data_size - furthest_end,
                " trailing bytes belong to no tensor (the header's offsets or its length field "
                "are wrong).");
  for (size_t i = 0; i < f->tensors_.size(); ++i) f->index_.emplace(f->tensors_[i].name, i);
  return f;
}

SafetensorsFile::~SafetensorsFile() {
  if (map_ != nullptr) ::munmap(const_cast<uint8_t*>(map_), map_size_);
}

const TensorInfo* SafetensorsFile::find(std::string_view name) const {
  const auto it = index_.find(std::string(name));
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

std::span<const uint8_t> SafetensorsFile::bytes(const TensorInfo& t) const {
  // A TensorInfo from another file (or a hand-made one) must not read outside this mapping.
  MEGAMOE_CHECK(t.begin <= t.end && t.end <= map_size_ - data_start_, kInvalidArgument,
                "tensor '", t.name, "' with bytes [", t.begin, ", ", t.end,
                ") is outside the data section of safetensors file '", path_, "' (",
                map_size_ - data_start_, " bytes).");
  return {map_ + data_start_ + t.begin, static_cast<size_t>(t.end - t.begin)};
}

}  // namespace megamoe
