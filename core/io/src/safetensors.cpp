// safetensors reader and writer. Format: 8-byte little-endian header length N, N bytes of JSON
// header ({name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {str: str}}), then
// the data section; offsets are relative to the data section (huggingface/safetensors, README
// "Format" and safetensors/src/tensor.rs validation).
#include "qpipe/safetensors.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <nlohmann/json.hpp>
#include <sys/mman.h>
#include <sys/sendfile.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <optional>
#include <set>

#include "qpipe/error.h"
#include "qpipe/input_file.h"
#include "qpipe/json_input.h"

namespace qpipe::safetensors {

namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;

namespace {

// The reference implementation refuses headers above 100 MB.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

struct DtypeEntry {
  std::string_view name;
  at::ScalarType type;
};
constexpr std::array<DtypeEntry, 15> kDtypes{{
    {"F64", at::kDouble},
    {"F32", at::kFloat},
    {"F16", at::kHalf},
    {"BF16", at::kBFloat16},
    {"F8_E4M3", at::kFloat8_e4m3fn},
    {"F8_E5M2", at::kFloat8_e5m2},
    {"I64", at::kLong},
    {"I32", at::kInt},
    {"I16", at::kShort},
    {"I8", at::kChar},
    {"U8", at::kByte},
    {"U16", at::kUInt16},
    {"U32", at::kUInt32},
    {"U64", at::kUInt64},
    {"BOOL", at::kBool},
}};

[[noreturn]] void invalid(const fs::path& file, const std::string& what) {
  throw Error(ErrorCode::kInput, concat(file.string(), ": ", what));
}

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }

 private:
  int fd_;
};

// Parses one tensor entry of the header; offsets are checked later, in data order.
TensorInfo parseEntry(const fs::path& file, const std::string& name, const Json& entry) {
  const auto bad = [&](const std::string& what) { invalid(file, "tensor '" + name + "': " + what); };
  if (!entry.is_object()) bad("header entry is not a JSON object");
  for (const auto& [key, value] : entry.items()) {
    if (key != "dtype" && key != "shape" && key != "data_offsets") bad("unexpected header field '" + key + "'");
  }
  if (!entry.contains("dtype") || !entry["dtype"].is_string()) bad("'dtype' is missing or not a string");
  if (!entry.contains("shape") || !entry["shape"].is_array()) bad("'shape' is missing or not a list");
  if (!entry.contains("data_offsets") || !entry["data_offsets"].is_array() || entry["data_offsets"].size() != 2) {
    bad("'data_offsets' is missing or not a list of two offsets");
  }
  TensorInfo info;
  info.name = name;
  info.dtype = entry["dtype"].get<std::string>();
  if (std::none_of(kDtypes.begin(), kDtypes.end(), [&](const DtypeEntry& d) { return d.name == info.dtype; })) {
    bad("unknown dtype '" + info.dtype + "'");
  }
  for (const auto& dim : entry["shape"]) {
    if (!dim.is_number_unsigned()) bad("shape " + entry["shape"].dump() + " has a dimension that is not a size");
    info.shape.push_back(dim.get<int64_t>());
  }
  for (const auto& offset : entry["data_offsets"]) {
    if (!offset.is_number_unsigned()) bad("data_offsets " + entry["data_offsets"].dump() + " are not byte offsets");
  }
  info.begin = entry["data_offsets"][0].get<uint64_t>();
  info.end = entry["data_offsets"][1].get<uint64_t>();
  if (info.end < info.begin) bad("data_offsets " + entry["data_offsets"].dump() + " end before they begin");
  uint64_t bytes = at::elementSize(scalarType(info.dtype));
  for (int64_t dim : info.shape) {
    if (dim != 0 && bytes > UINT64_MAX / static_cast<uint64_t>(dim))
      bad("shape " + shapeText(info.shape) + " is too large");
    bytes *= static_cast<uint64_t>(dim);
  }
  if (bytes != info.end - info.begin) {
    bad(concat(info.dtype, " ", shapeText(info.shape), " needs ", bytes, " bytes, but data_offsets [", info.begin, ", ",
               info.end, "] span ", info.end - info.begin));
  }
  return info;
}

}  // namespace

std::string shapeText(at::IntArrayRef shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

at::ScalarType scalarType(std::string_view dtype) {
  for (const auto& entry : kDtypes) {
    if (entry.name == dtype) return entry.type;
  }
  throw Error(ErrorCode::kInput, concat("unknown safetensors dtype '", dtype, "'"));
}

std::string dtypeName(at::ScalarType type) {
  for (const auto& entry : kDtypes) {
    if (entry.type == type) return std::string(entry.name);
  }
  throw Error(ErrorCode::kInput, concat("dtype ", c10::toString(type), " cannot be stored in safetensors"));
}

// ---------------------------------------------------------------------------------------------
// Reading

std::shared_ptr<const File> File::open(const fs::path& path) {
  requireRegularFile(path);
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) {
    throw Error(ErrorCode::kIo, concat("cannot open '", path.string(), "': ", std::strerror(errno)));
  }
  struct stat st {};
  QPIPE_REQUIRE(::fstat(fd.get(), &st) == 0 && S_ISREG(st.st_mode), ErrorCode::kIo, "'", path.string(),
                "' is not a regular file");
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < 8) invalid(path, concat("file is ", size, " bytes, too short for the 8-byte header length"));

  std::shared_ptr<File> file(new File());
  file->path_ = path;
  file->mappingSize_ = size;
  // Private and writable: tensors handed out may be modified in place without touching the file.
  void* mapping = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd.get(), 0);
  if (mapping == MAP_FAILED) {
    throw Error(ErrorCode::kIo, concat("cannot map '", path.string(), "': ", std::strerror(errno)));
  }
  file->mapping_ = mapping;
  const auto* bytes = static_cast<const uint8_t*>(mapping);

  uint64_t headerSize = 0;
  for (int i = 7; i >= 0; --i) headerSize = (headerSize << 8) | bytes[i];
  if (headerSize > kMaxHeaderBytes) {
    invalid(path, concat("header length ", headerSize, " exceeds the limit of ", kMaxHeaderBytes, " bytes"));
  }
  if (8 + headerSize > size) {
    invalid(path, concat("header length ", headerSize, " runs past the end of the file (", size, " bytes)"));
  }
  Json header;
  std::set<std::string> names;
  // JSON keeps the last of two equal keys: a header naming a tensor twice would lose one silently.
  const Json::parser_callback_t check = [&](int depth, Json::parse_event_t event, Json& parsed) {
    if (depth > kMaxJsonDepth) invalid(path, concat("header nested deeper than ", kMaxJsonDepth, " levels"));
    if (event == Json::parse_event_t::key && depth == 1 && !names.insert(parsed.get<std::string>()).second) {
      invalid(path, concat("header names '", parsed.get<std::string>(), "' twice"));
    }
    return true;
  };
  try {
    header = Json::parse(reinterpret_cast<const char*>(bytes + 8),
                         reinterpret_cast<const char*>(bytes + 8 + headerSize), check);
  } catch (const Json::exception& e) {
    invalid(path, concat("header is not valid JSON (", e.what(), ")"));
  }
  if (!header.is_object()) invalid(path, "header is not a JSON object");

  for (const auto& [key, value] : header.items()) {
    if (key == "__metadata__") {
      if (!value.is_object()) invalid(path, "'__metadata__' is not a JSON object");
      for (const auto& [metaKey, metaValue] : value.items()) {
        if (!metaValue.is_string()) invalid(path, "'__metadata__' value of '" + metaKey + "' is not a string");
        file->metadata_[metaKey] = metaValue.get<std::string>();
      }
      continue;
    }
    file->tensors_.push_back(parseEntry(path, key, value));
  }

  // Offsets must tile the data section exactly: sorted, each starting where the last ended.
  const uint64_t dataSize = size - 8 - headerSize;
  std::vector<const TensorInfo*> byOffset;
  for (const auto& info : file->tensors_) byOffset.push_back(&info);
  std::stable_sort(byOffset.begin(), byOffset.end(),
                   [](const TensorInfo* a, const TensorInfo* b) { return a->begin < b->begin; });
  uint64_t expected = 0;
  const TensorInfo* previous = nullptr;
  for (const TensorInfo* info : byOffset) {
    if (info->begin < expected) {
      invalid(path, concat("tensor '", info->name, "': data_offsets [", info->begin, ", ", info->end,
                           "] overlap tensor '", previous->name, "' (which ends at ", expected, ")"));
    }
    if (info->begin > expected) {
      invalid(path, concat("tensor '", info->name, "': data_offsets [", info->begin, ", ", info->end,
                           "] leave a gap of ", info->begin - expected, " bytes before it"));
    }
    if (info->end > dataSize) {
      invalid(path, concat("tensor '", info->name, "': data_offsets [", info->begin, ", ", info->end,
                           "] run past the end of the data (", dataSize, " bytes; file truncated?)"));
    }
    expected = info->end;
    previous = info;
  }
  if (expected != dataSize) {
    invalid(path, concat(dataSize - expected, " bytes after the last tensor belong to no tensor"));
  }
  file->data_ = bytes + 8 + headerSize;
  file->dataOffset_ = 8 + headerSize;
  return file;
}

File::~File() {
  if (mapping_ != nullptr) ::munmap(mapping_, mappingSize_);
}

const TensorInfo* File::find(std::string_view name) const {
  for (const auto& info : tensors_) {
    if (info.name == name) return &info;
  }
  return nullptr;
}

at::Tensor File::tensor(std::string_view name) const {
  const TensorInfo* info = find(name);
  QPIPE_REQUIRE(info != nullptr, ErrorCode::kInput, path_.string(), ": no tensor '", name, "'");
  const at::ScalarType type = scalarType(info->dtype);
  auto* data = const_cast<uint8_t*>(data_ + info->begin);
  const auto options = at::TensorOptions().dtype(type);
  if (reinterpret_cast<uintptr_t>(data) % at::elementSize(type) != 0) {
    // Unpadded headers can misalign the data; kernels expect aligned elements.
    return at::from_blob(data, info->shape, options).clone();
  }
  auto keepAlive = shared_from_this();
  return at::from_blob(
      data, info->shape, [keepAlive](void*) {}, options);
}

void File::dropPages(std::string_view name) const {
  const TensorInfo* info = find(name);
  QPIPE_REQUIRE(info != nullptr, ErrorCode::kInput, path_.string(), ": no tensor '", name, "'");
  static const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  // Whole pages only: a page shared with a neighbouring tensor may still be in use.
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data_ + info->begin) + page - 1) / page * page;
  const uintptr_t end = reinterpret_cast<uintptr_t>(data_ + info->end) / page * page;
  if (end > begin) ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
}

Checkpoint Checkpoint::open(const fs::path& fileOrDir) {
  return open(fileOrDir, "model");
}

Checkpoint Checkpoint::open(const fs::path& fileOrDir, const std::string& filePrefix) {
  Checkpoint checkpoint;
  const auto addShard = [&](const fs::path& path) {
    checkpoint.shards_.push_back({path, File::open(path)});
    return checkpoint.shards_.size() - 1;
  };
  // There, or there but unreadable (a link loop): File::open then names why it cannot be read.
  const auto present = [](const fs::path& path) {
    std::error_code ec;
    return fs::exists(path, ec) || ec;
  };
  std::error_code ec;
  if (fs::is_regular_file(fileOrDir, ec)) {
    addShard(fileOrDir);
  } else {
    QPIPE_REQUIRE(fs::is_directory(fileOrDir, ec), ErrorCode::kIo, "'", fileOrDir.string(),
                  "': no such file or folder");
    const fs::path index = fileOrDir / (filePrefix + ".safetensors.index.json");
    if (present(index)) {
      Json json;
      try {
        json = Json::parse(readInputFile(index), jsonDepthLimit<Json>(index.string()));
      } catch (const Json::exception& e) {
        invalid(index, concat("not valid JSON (", e.what(), ")"));
      }
      if (!json.is_object() || !json.contains("weight_map") || !json["weight_map"].is_object()) {
        invalid(index, "has no 'weight_map' object");
      }
      std::map<std::string, size_t> shardByFile;
      for (const auto& [name, fileName] : json["weight_map"].items()) {
        if (!fileName.is_string()) invalid(index, "weight_map entry of '" + name + "' is not a file name");
        const std::string shardName = fileName.get<std::string>();
        // A shard is a file of the model folder: a path elsewhere ("../x") is not followed.
        if (shardName.empty() || shardName == "." || shardName == ".." ||
            shardName.find_first_of("/\\") != std::string::npos) {
          invalid(index,
                  "weight_map entry of '" + name + "' is '" + shardName + "', not a file name in the model folder");
        }
        if (!shardByFile.count(shardName)) shardByFile[shardName] = addShard(fileOrDir / shardName);
        const size_t shard = shardByFile[shardName];
        if (checkpoint.shards_[shard].file->find(name) == nullptr) {
          invalid(index, "lists tensor '" + name + "' in " + shardName + ", which does not hold it");
        }
        checkpoint.index_[name] = shard;
      }
      for (size_t shard = 0; shard < checkpoint.shards_.size(); ++shard) {
        for (const TensorInfo& info : checkpoint.shards_[shard].file->tensors()) {
          const auto listed = checkpoint.index_.find(info.name);
          if (listed != checkpoint.index_.end() && listed->second != shard) {
            invalid(index, concat("tensor '", info.name, "' is in two shards, ",
                                  checkpoint.shards_[listed->second].path.filename().string(), " and ",
                                  checkpoint.shards_[shard].path.filename().string()));
          }
        }
      }
      return checkpoint;
    }
    const std::string single = filePrefix + ".safetensors";
    QPIPE_REQUIRE(present(fileOrDir / single), ErrorCode::kInput, fileOrDir.string(), ": no ", single, " or ",
                  filePrefix, ".safetensors.index.json");
    addShard(fileOrDir / single);
  }
  for (const auto& info : checkpoint.shards_[0].file->tensors()) checkpoint.index_[info.name] = 0;
  return checkpoint;
}

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> out;
  for (const auto& [name, shard] : index_) out.push_back(name);
  return out;
}

bool Checkpoint::contains(std::string_view name) const {
  return index_.find(name) != index_.end();
}

const TensorInfo& Checkpoint::info(std::string_view name) const {
  const auto it = index_.find(name);
  QPIPE_REQUIRE(it != index_.end(), ErrorCode::kInput, "checkpoint ",
                shards_.empty() ? std::string() : shards_[0].path.parent_path().string(), ": no tensor '", name, "'");
  return *shards_[it->second].file->find(name);
}

at::Tensor Checkpoint::tensor(std::string_view name) const {
  const TensorInfo& meta = info(name);
  return shards_[index_.find(name)->second].file->tensor(meta.name);
}

void Checkpoint::dropPages(std::string_view name) const {
  const TensorInfo& meta = info(name);
  shards_[index_.find(name)->second].file->dropPages(meta.name);
}

uint64_t Checkpoint::totalBytes() const {
  uint64_t total = 0;
  for (const auto& [name, shard] : index_) {
    const TensorInfo* meta = shards_[shard].file->find(name);
    total += meta->end - meta->begin;
  }
  return total;
}

// ---------------------------------------------------------------------------------------------
// Writing: each shard's data goes to its own temporary file, `.<prefix>-<i>.data.tmp`, at the
// offset it has in the shard; finish() puts the header in front and renames the file. Processes
// that share the folder write their tensors into the same data files (writePlaced), so a
// checkpoint that several ranks wrote is written once, as one writer's is.

namespace {

// A shard's data starts on a 4 KiB boundary: safetensors lets the header end in spaces, and with
// the header so padded finish() can put it in front of a shard's data in place, in the bytes the
// data file reserved for it or in a range inserted in front of the data (FALLOC_FL_INSERT_RANGE:
// a metadata operation on ext4 and XFS, whose blocks are 4 KiB, but one that first writes every
// dirty page of the file to disk) instead of copying every byte of the data behind it. Either
// way the file's bytes are the same.
constexpr uint64_t kDataAlignment = 4096;

// The most bytes one pwrite of tensor data hands the kernel. On a KVM guest with a virtio balloon
// (Linux 6.18, ext4) one 400 MB pwrite from pages the process had already touched ran at about
// 300 MB/s, nearly all of it the kernel's copy into the page cache, where pwrites of 2 MiB of the
// same bytes ran at 2–3 GB/s; elsewhere the cap costs one system call per 2 MiB
// (docs/benchmarks.md).
constexpr uint64_t kWriteChunk = uint64_t{2} << 20;

fs::path dataPath(const fs::path& dir, const WriterOptions& options, int64_t shard) {
  return dir / concat(".", options.filePrefix, "-", shard, ".data.tmp");
}

// Where a tensor of `bytes` goes after `at`: there, or at the start of the next shard when it
// would overflow this one (which holds at least one tensor).
Position advance(Position at, uint64_t bytes, uint64_t maxShardBytes) {
  if (maxShardBytes > 0 && at.bytes > 0 && at.bytes + bytes > maxShardBytes) return {at.shard + 1, 0};
  return at;
}

// Opens a shard's data file for writing: created when missing, never truncated (other processes
// may have written their tensors into it already).
int openData(const fs::path& path) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
  QPIPE_REQUIRE(fd >= 0, ErrorCode::kIo, "cannot write '", path.string(), "': ", std::strerror(errno));
  return fd;
}

// The shards' data files of one writer's folder, as a writer (or writePlaced) writes into them:
// the file of the shard written last stays open.
class DataFiles {
 public:
  DataFiles(const fs::path& dir, const WriterOptions& options) : dir_(dir), options_(options) {}

  // A CPU contiguous tensor's bytes where a tensor placed at `at` lies in its shard's file.
  void write(const Position& at, const at::Tensor& tensor) {
    const fs::path path = dataPath(dir_, options_, at.shard);
    if (shard_ != at.shard) {
      fd_.emplace(openData(path));
      shard_ = at.shard;
    }
    const auto* bytes = static_cast<const char*>(tensor.data_ptr());
    const uint64_t offset = options_.headerReserve + at.bytes;
    for (uint64_t done = 0; done < tensor.nbytes();) {
      const ssize_t written = ::pwrite(fd_->get(), bytes + done, std::min(tensor.nbytes() - done, kWriteChunk),
                                       static_cast<off_t>(offset + done));
      QPIPE_REQUIRE(written > 0, ErrorCode::kIo, "writing '", path.string(),
                    "' failed (disk full?): ", std::strerror(errno));
      done += static_cast<uint64_t>(written);
    }
  }
  void close() {
    fd_.reset();
    shard_ = -1;
  }

 private:
  const fs::path& dir_;
  const WriterOptions& options_;
  std::optional<Fd> fd_;
  int64_t shard_ = -1;
};

}  // namespace

struct Writer::Impl {
  struct Shard {
    std::vector<TensorInfo> tensors;
    uint64_t bytes = 0;
  };

  fs::path dir;
  WriterOptions options;
  DataFiles data{dir, options};
  std::vector<Shard> shards{1};
  std::set<std::string> names;
  bool finished = false;

  Position position() const { return {static_cast<int64_t>(shards.size()) - 1, shards.back().bytes}; }

  // Records a tensor of `bytes` at the writer's next position, which must be `at`.
  void record(const Position& at, const std::string& name, std::string dtype, std::vector<int64_t> shape,
              uint64_t bytes) {
    const Position next = advance(position(), bytes, options.maxShardBytes);
    QPIPE_CHECK(next.shard == at.shard && next.bytes == at.bytes, "tensor '", name, "' lies at shard ", at.shard,
                " byte ", at.bytes, ", where the writer's next tensor goes to shard ", next.shard, " byte ",
                next.bytes);
    QPIPE_REQUIRE(names.insert(name).second, ErrorCode::kInternal, "tensor '", name, "' written twice");
    if (static_cast<size_t>(at.shard) == shards.size()) shards.emplace_back();
    Shard& shard = shards[static_cast<size_t>(at.shard)];
    shard.tensors.push_back({name, std::move(dtype), std::move(shape), at.bytes, at.bytes + bytes});
    shard.bytes += bytes;
  }

  void removeTemporaries() {
    data.close();
    std::error_code ignored;
    for (size_t i = 0; i < shards.size(); ++i) fs::remove(dataPath(dir, options, static_cast<int64_t>(i)), ignored);
  }
};

Writer::Writer(fs::path dir, WriterOptions options) : impl_(std::make_unique<Impl>()) {
  impl_->dir = std::move(dir);
  impl_->options = std::move(options);
  std::error_code ec;
  fs::create_directories(impl_->dir, ec);
  QPIPE_REQUIRE(fs::is_directory(impl_->dir), ErrorCode::kIo, "cannot create folder '", impl_->dir.string(), "'");
  QPIPE_CHECK(impl_->options.headerReserve % kDataAlignment == 0, "headerReserve ", impl_->options.headerReserve,
              " is not a multiple of ", kDataAlignment);
}

Writer::~Writer() {
  if (!impl_->finished) impl_->removeTemporaries();
}

void Writer::add(const std::string& name, const at::Tensor& tensor) {
  QPIPE_CHECK(!impl_->finished, "Writer::add after finish");
  QPIPE_REQUIRE(!impl_->names.count(name), ErrorCode::kInternal, "tensor '", name, "' written twice");
  const at::Tensor cpu = tensor.detach().to(at::kCPU).contiguous();
  const Position at = advance(impl_->position(), cpu.nbytes(), impl_->options.maxShardBytes);
  impl_->data.write(at, cpu);
  impl_->record(at, name, dtypeName(cpu.scalar_type()), cpu.sizes().vec(), cpu.nbytes());
}

Position Writer::position() const {
  return impl_->position();
}

void Writer::adopt(const std::vector<PlacedTensor>& placed) {
  QPIPE_CHECK(!impl_->finished, "Writer::adopt after finish");
  for (const PlacedTensor& tensor : placed) {
    impl_->record({tensor.shard, tensor.info.begin}, tensor.info.name, tensor.info.dtype, tensor.info.shape,
                  tensor.info.end - tensor.info.begin);
  }
}

std::vector<PlacedTensor> writePlaced(const fs::path& dir, const WriterOptions& options, Position start,
                                      const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                                      const std::function<void(Position end)>& placed) {
  std::vector<PlacedTensor> out;
  Position at = start;
  for (const auto& [name, tensor] : tensors) {
    QPIPE_CHECK(tensor.device().is_cpu() && tensor.is_contiguous(), "writePlaced: tensor '", name,
                "' is not a contiguous CPU tensor");
    const uint64_t bytes = tensor.nbytes();
    at = advance(at, bytes, options.maxShardBytes);
    out.push_back(
        {at.shard, {name, dtypeName(tensor.scalar_type()), tensor.sizes().vec(), at.bytes, at.bytes + bytes}});
    at.bytes += bytes;
  }
  placed(at);
  DataFiles data(dir, options);
  for (size_t i = 0; i < out.size(); ++i) data.write({out[i].shard, out[i].info.begin}, tensors[i].second);
  return out;
}

namespace {

// The 8-byte length and the header, padded with spaces to at least `reserve` bytes and to a
// multiple of kDataAlignment.
std::string headerBytes(std::string text, uint64_t reserve) {
  const uint64_t minimal = (8 + text.size() + kDataAlignment - 1) / kDataAlignment * kDataAlignment;
  text.append(std::max(reserve, minimal) - 8 - text.size(), ' ');
  std::string head(8, '\0');
  for (size_t i = 0; i < 8; ++i) head[i] = static_cast<char>((text.size() >> (8 * i)) & 0xff);
  return head + text;
}

// `head` in front of the shard's data, `bytes` from `reserve` in its data file, which is renamed
// to finalPath; false, with nothing changed, where the file is not that or the file system cannot
// insert the range the reserve lacks.
bool headerInPlace(const fs::path& finalPath, const std::string& head, const fs::path& data, uint64_t reserve,
                   uint64_t bytes) {
  std::error_code ec;
  const uint64_t size = fs::file_size(data, ec);
  if (ec || size != reserve + bytes || size == 0) return false;
  Fd fd(::open(data.c_str(), O_RDWR | O_CLOEXEC));
  if (fd.get() < 0) return false;
  if (head.size() > reserve &&
      ::fallocate(fd.get(), FALLOC_FL_INSERT_RANGE, 0, static_cast<off_t>(head.size() - reserve)) != 0) {
    return false;
  }
  for (uint64_t done = 0; done < head.size();) {
    const ssize_t written = ::pwrite(fd.get(), head.data() + done, head.size() - done, static_cast<off_t>(done));
    QPIPE_REQUIRE(written > 0, ErrorCode::kIo, "writing '", data.string(), "' failed: ", std::strerror(errno));
    done += static_cast<uint64_t>(written);
  }
  fs::rename(data, finalPath);
  return true;
}

// `head` + `bytes` of `data` from `offset` (a kernel-side copy) under a temporary name, renamed.
void writeAtomically(const fs::path& finalPath, const std::string& head, const fs::path& data, uint64_t offset,
                     uint64_t bytes) {
  const fs::path temporary = finalPath.string() + ".tmp";
  {
    std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
    QPIPE_REQUIRE(out.good(), ErrorCode::kIo, "cannot write '", temporary.string(), "'");
    out.write(head.data(), static_cast<std::streamsize>(head.size()));
    QPIPE_REQUIRE(out.good(), ErrorCode::kIo, "writing '", temporary.string(), "' failed (disk full?)");
  }
  // sendfile refuses O_APPEND descriptors: seek to the end instead.
  Fd out(::open(temporary.c_str(), O_WRONLY | O_CLOEXEC));
  QPIPE_REQUIRE(out.get() >= 0 && ::lseek(out.get(), 0, SEEK_END) >= 0, ErrorCode::kIo, "cannot reopen '",
                temporary.string(), "'");
  // A writer that got no tensor never made its data file.
  Fd in(::open(data.c_str(), O_RDONLY | O_CLOEXEC | O_CREAT, 0644));
  QPIPE_REQUIRE(in.get() >= 0, ErrorCode::kIo, "cannot read '", data.string(), "'");
  auto from = static_cast<off_t>(offset);
  for (uint64_t remaining = bytes; remaining > 0;) {
    const ssize_t copied = ::sendfile(out.get(), in.get(), &from, static_cast<size_t>(remaining));
    QPIPE_REQUIRE(copied > 0, ErrorCode::kIo, "writing '", temporary.string(), "' failed: ", std::strerror(errno));
    remaining -= static_cast<uint64_t>(copied);
  }
  fs::rename(temporary, finalPath);
}

}  // namespace

std::vector<fs::path> Writer::finish() {
  QPIPE_CHECK(!impl_->finished, "Writer::finish called twice");
  impl_->data.close();
  auto& shards = impl_->shards;
  const auto& prefix = impl_->options.filePrefix;
  std::vector<fs::path> written;
  Json weightMap = Json::object();
  uint64_t totalSize = 0;
  for (size_t i = 0; i < shards.size(); ++i) {
    std::string fileName = prefix + ".safetensors";
    if (shards.size() > 1) {
      std::array<char, 32> numbering{};
      std::snprintf(numbering.data(), numbering.size(), "-%05zu-of-%05zu", i + 1, shards.size());
      fileName = prefix + numbering.data() + ".safetensors";
    }
    Json header = Json::object();
    Json metadata = Json::object();
    for (const auto& [key, value] : impl_->options.metadata) metadata[key] = value;
    metadata["format"] = "pt";
    header["__metadata__"] = metadata;
    for (const auto& info : shards[i].tensors) {
      header[info.name] = {{"dtype", info.dtype}, {"shape", info.shape}, {"data_offsets", {info.begin, info.end}}};
      weightMap[info.name] = fileName;
      totalSize += info.end - info.begin;
    }
    const std::string head = headerBytes(header.dump(), impl_->options.headerReserve);
    const fs::path data = dataPath(impl_->dir, impl_->options, static_cast<int64_t>(i));
    const uint64_t reserve = impl_->options.headerReserve;
    if (!headerInPlace(impl_->dir / fileName, head, data, reserve, shards[i].bytes)) {
      writeAtomically(impl_->dir / fileName, head, data, reserve, shards[i].bytes);
      fs::remove(data);
    }
    written.push_back(impl_->dir / fileName);
  }
  if (shards.size() > 1) {
    const Json index = {{"metadata", {{"total_size", totalSize}}}, {"weight_map", weightMap}};
    const fs::path indexPath = impl_->dir / (prefix + ".safetensors.index.json");
    const fs::path temporary = indexPath.string() + ".tmp";
    std::ofstream(temporary) << index.dump(2) << "\n";
    fs::rename(temporary, indexPath);
    written.push_back(indexPath);
  }
  impl_->finished = true;
  return written;
}

}  // namespace qpipe::safetensors
