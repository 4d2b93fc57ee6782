#include "checkpoint/json_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <set>
#include <vector>

#include "megamoe/status.h"

namespace megamoe::checkpoint_detail {

namespace {

using nlohmann::json;

// Checkpoint JSON files are kilobytes (a sharded index of a large model is a few MB); anything
// this large is not one, and reading it whole would only waste memory.
constexpr uint64_t kMaxJsonFileBytes = 100'000'000;
// config.json nests a few levels (quantization_config.config_groups.group_0.weights); 64 leaves
// room for any real file and keeps a hostile one from building millions of nested values.
constexpr int kMaxConfigDepth = 64;

constexpr size_t kBriefChars = 120;
constexpr int kBriefDepth = 2;
constexpr size_t kBriefStringChars = 60;

// The rendering of json_brief; recursion is bounded by kBriefDepth.
void append_brief(const json& v, int depth, std::string& out) {
  const auto dump = [](const json& x) { return x.dump(-1, ' ', false, json::error_handler_t::replace); };
  if (out.size() > kBriefChars) return;
  if (v.is_string()) {
    const std::string& s = v.get_ref<const std::string&>();
    if (s.size() <= kBriefStringChars) {
      out += dump(v);
    } else {
      std::string head = dump(json(s.substr(0, kBriefStringChars)));
      head.pop_back();  // the closing quote: the string goes on
      out += head + "...\" (" + std::to_string(s.size()) + " bytes)";
    }
    return;
  }
  if (!v.is_structured()) {
    out += dump(v);
    return;
  }
  const bool array = v.is_array();
  if (depth >= kBriefDepth && !v.empty()) {
    out += array ? "[... " + std::to_string(v.size()) + " elements]"
                 : "{... " + std::to_string(v.size()) + " keys}";
    return;
  }
  out += array ? '[' : '{';
  size_t i = 0;
  for (auto it = v.begin(); it != v.end(); ++it, ++i) {
    if (i) out += ", ";
    if (out.size() > kBriefChars) {
      out += "... " + std::to_string(v.size() - i) + " more";
      break;
    }
    if (!array) {
      append_brief(json(it.key()), kBriefDepth, out);
      out += ": ";
    }
    append_brief(*it, depth + 1, out);
  }
  out += array ? ']' : '}';
}

}  // namespace

std::string json_brief(const json& value) {
  std::string out;
  append_brief(value, 0, out);
  return out;
}

json parse_json_strict(std::string_view text, int max_depth,
                       const std::function<std::string()>& where) {
  if (const void* nul = std::memchr(text.data(), '\0', text.size())) {
    MEGAMOE_FAIL(kInvalidCheckpoint, where(), " holds a NUL byte at offset ",
                 static_cast<const char*>(nul) - text.data(),
                 " of its JSON text; JSON text cannot contain one (nlohmann would stop reading "
                 "there and ignore the rest).");
  }
  // One set of keys per open object (and an empty marker per open array), innermost last, with
  // the key under which each value was opened for messages.
  struct Open {
    bool object;
    std::set<std::string> keys;
    std::string last_key;
  };
  std::vector<Open> open;
  const auto path = [&] {
    std::string p;
    for (size_t i = 0; i + 1 < open.size(); ++i) {
      p += open[i].object ? "'" + open[i].last_key + "' > " : "[] > ";
    }
    return p.empty() ? std::string("the top-level object") : p.substr(0, p.size() - 3);
  };
  const json::parser_callback_t check = [&](int depth, json::parse_event_t event, json& parsed) {
    switch (event) {
      case json::parse_event_t::object_start:
      case json::parse_event_t::array_start:
        MEGAMOE_CHECK(depth < max_depth, kInvalidCheckpoint, where(),
                      " nests JSON arrays and objects more than ", max_depth,
                      " levels deep; at most ", max_depth, " are allowed.");
        open.push_back({event == json::parse_event_t::object_start, {}, {}});
        break;
      case json::parse_event_t::object_end:
      case json::parse_event_t::array_end:
        if (!open.empty()) open.pop_back();
        break;
      case json::parse_event_t::key: {
        Open& o = open.back();
        o.last_key = parsed.get<std::string>();
        MEGAMOE_CHECK(o.keys.insert(o.last_key).second, kInvalidCheckpoint, where(),
                      " has the key '", o.last_key, "' twice in ", path(),
                      "; every key of a JSON object must be unique.");
        break;
      }
      case json::parse_event_t::value:
        break;
    }
    return true;
  };
  try {
    return json::parse(text.begin(), text.end(), check);
  } catch (const json::exception& e) {
    MEGAMOE_FAIL(kInvalidCheckpoint, where(), " is not valid JSON: ", e.what());
  }
}

json read_json_file(const std::filesystem::path& path, const char* what) {
  const std::string name = path.string();
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer; the fstat below
  // then rejects it (and directories and devices) without reading.
  const int fd = ::open(name.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    MEGAMOE_CHECK(err != ENOENT, kNotFound, what, " '", name, "' does not exist.");
    MEGAMOE_FAIL(kIo, "cannot open ", what, " '", name, "': ", std::strerror(err), ".");
  }
  struct stat st {};
  const bool stat_ok = ::fstat(fd, &st) == 0;
  if (!stat_ok || !S_ISREG(st.st_mode) || uint64_t(st.st_size) > kMaxJsonFileBytes) {
    const int err = errno;
    ::close(fd);
    MEGAMOE_CHECK(stat_ok, kIo, "cannot stat ", what, " '", name, "': ", std::strerror(err), ".");
    MEGAMOE_CHECK(S_ISREG(st.st_mode), kInvalidArgument, what, " '", name,
                  "' is not a regular file (a directory, FIFO or device); expected a JSON file.");
    MEGAMOE_FAIL(kInvalidCheckpoint, what, " '", name, "' has ", uint64_t(st.st_size),
                 " bytes; at most ", kMaxJsonFileBytes, " are allowed for a JSON file.");
  }
  std::string text(static_cast<size_t>(st.st_size), '\0');
  size_t done = 0;
  errno = 0;  // a short read (the file shrank) leaves it 0, and the message says so
  while (done < text.size()) {
    const ssize_t n = ::read(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;  // an error, or the file shrank: parse what was read
    done += static_cast<size_t>(n);
  }
  const int err = errno;
  ::close(fd);
  MEGAMOE_CHECK(done == text.size(), kIo, "cannot read ", what, " '", name, "': ",
                done < text.size() && err != 0 ? std::strerror(err) : "short read", ".");
  return parse_json_strict(text, kMaxConfigDepth,
                           [&] { return std::string(what) + " '" + name + "'"; });
}

}  // namespace megamoe::checkpoint_detail
