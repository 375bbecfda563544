#include "qpipe/input_file.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <string>

#include "qpipe/error.h"

namespace qpipe {

namespace {

const char* kindOf(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a file";
}

}  // namespace

void requireRegularFile(const std::filesystem::path& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    throw Error(ErrorCode::kIo,
                concat("cannot open '", path.string(), "': ", errno == ENOENT ? "no such file" : std::strerror(errno)));
  }
  QPIPE_REQUIRE(S_ISREG(st.st_mode), ErrorCode::kInput, "'", path.string(), "' is not a regular file (",
                kindOf(st.st_mode), ")");
}

std::string readInputFile(const std::filesystem::path& path) {
  requireRegularFile(path);
  std::ifstream in(path, std::ios::binary);
  QPIPE_REQUIRE(in.good(), ErrorCode::kIo, "cannot open '", path.string(), "': ", std::strerror(errno));
  // Blocks, not a character at a time (5 ms for a 2 MB tokenizer.json), until the end, whatever
  // the size was at the stat.
  std::string text;
  constexpr size_t kBlock = size_t{1} << 20;
  for (;;) {
    const size_t done = text.size();
    text.resize(done + kBlock);
    in.read(text.data() + done, static_cast<std::streamsize>(kBlock));
    text.resize(done + static_cast<size_t>(in.gcount()));
    if (!in) break;
  }
  QPIPE_REQUIRE(in.eof(), ErrorCode::kIo, "reading '", path.string(), "' failed: ", std::strerror(errno));
  return text;
}

std::filesystem::path modelFile(const std::filesystem::path& dir, const std::string& name) {
  std::filesystem::path path = dir / name;
  // Absent, not unreadable (a link loop): the reader names why it cannot read that.
  std::error_code unreadable;
  QPIPE_REQUIRE(std::filesystem::exists(path, unreadable) || unreadable, ErrorCode::kInput, "model folder '",
                dir.string(), "' has no ", name,
                "; a Hugging Face model folder holds config.json, its *.safetensors and tokenizer.json (a GGUF "
                "file converts to one with 'qpipe convert gguf')");
  return path;
}

}  // namespace qpipe
