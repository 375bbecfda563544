// safetensors, both ways (https://github.com/huggingface/safetensors, format "pt").
//
// Reading maps each file once and hands out zero-copy tensors that keep the mapping alive.
// Every file is validated when opened: header length and size limit, JSON shape, dtype names,
// offsets contiguous, in order of the data and non-overlapping, byte size = dtype size × shape,
// nothing trailing. A violation is Error(kInput) naming the file, the tensor and the rule.
//
// Writing streams one tensor at a time into size-limited shards plus the index, each file
// under a temporary name until it is complete. Several processes can write one checkpoint: each
// lays its tensors out after the previous one's (writePlaced), the owner adopts them.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace qpipe::safetensors {

// "F32", "BF16", "F8_E4M3", … <-> at::ScalarType; unknown names are Error(kInput).
at::ScalarType scalarType(std::string_view dtype);
std::string dtypeName(at::ScalarType type);
// A shape as messages write it: "[576, 576]".
std::string shapeText(at::IntArrayRef shape);

struct TensorInfo {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // byte offsets into the data section
  uint64_t end = 0;
};

class File : public std::enable_shared_from_this<File> {
 public:
  static std::shared_ptr<const File> open(const std::filesystem::path& path);
  ~File();

  const std::filesystem::path& path() const { return path_; }
  const std::vector<TensorInfo>& tensors() const { return tensors_; }  // in header order
  const TensorInfo* find(std::string_view name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // Where the data section starts in the file (TensorInfo offsets count from there).
  uint64_t dataOffset() const { return dataOffset_; }

  // A zero-copy view of the mapped bytes that keeps this file mapped. The mapping is private
  // copy-on-write: writing to the tensor never changes the file. Error(kInput) if absent.
  at::Tensor tensor(std::string_view name) const;
  // Drops the resident pages that lie wholly inside the tensor's bytes from this process
  // (madvise MADV_DONTNEED): they no longer count in RSS and are read again from the file if
  // touched. For tensors nothing uses any more; writes made through a view are lost.
  void dropPages(std::string_view name) const;

 private:
  File() = default;
  std::filesystem::path path_;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
  const uint8_t* data_ = nullptr;  // start of the data section
  uint64_t dataOffset_ = 0;
  void* mapping_ = nullptr;
  size_t mappingSize_ = 0;
};

// A checkpoint: one .safetensors file, or a folder with model.safetensors or a sharded
// model.safetensors.index.json. Every shard is mapped and validated when the checkpoint is
// opened; mapping costs no memory until a tensor's pages are read.
class Checkpoint {
 public:
  static Checkpoint open(const std::filesystem::path& fileOrDir);
  // A folder whose files are named `<filePrefix>.safetensors` or indexed by
  // `<filePrefix>.safetensors.index.json` (msmodelslim's ascendv1: "quant_model_weights").
  static Checkpoint open(const std::filesystem::path& fileOrDir, const std::string& filePrefix);

  std::vector<std::string> names() const;  // sorted
  bool contains(std::string_view name) const;
  const TensorInfo& info(std::string_view name) const;
  at::Tensor tensor(std::string_view name) const;
  void dropPages(std::string_view name) const;  // File::dropPages of the shard holding it
  uint64_t totalBytes() const;

 private:
  struct Shard {
    std::filesystem::path path;
    std::shared_ptr<const File> file;
  };
  std::vector<Shard> shards_;
  std::map<std::string, size_t, std::less<>> index_;  // tensor name -> shard
};

struct WriterOptions {
  std::string filePrefix = "model";
  uint64_t maxShardBytes = 0;                   // 0: one file
  std::map<std::string, std::string> metadata;  // "format": "pt" is always added
  // Bytes kept in front of each shard's data for its header, a multiple of 4 KiB. A header that
  // fits is written there, and the data starts after them: no byte of the data moves at finish(),
  // where a header that does not fit has the data file's pages written to disk first (or, where
  // ranges cannot be inserted, the data copied). The data starts at the larger of the reserve and
  // the header rounded up to 4 KiB, so the same reserve and tensors give the same bytes.
  uint64_t headerReserve = 0;
};

// Where a writer's next tensor goes: its shard, and the bytes of that shard before it.
struct Position {
  int64_t shard = 0;
  uint64_t bytes = 0;
};

// A tensor written by writePlaced: its shard, and its name, dtype, shape and data offsets there.
struct PlacedTensor {
  int64_t shard = 0;
  TensorInfo info;
};

class Writer {
 public:
  Writer(std::filesystem::path dir, WriterOptions options = {});
  ~Writer();
  Writer(const Writer&) = delete;
  Writer& operator=(const Writer&) = delete;

  // Writes `tensor` (any device, contiguous or not) to the current shard now; the caller may
  // free it afterwards. Names must be unique.
  void add(const std::string& name, const at::Tensor& tensor);
  Position position() const;
  // Takes tensors another process wrote into this writer's data files (writePlaced) as if add()
  // had written them; each must lie where this writer's next tensor would go.
  void adopt(const std::vector<PlacedTensor>& placed);

  // Completes the last shard, names the shards (prefix.safetensors, or
  // prefix-0000i-of-0000N.safetensors with prefix.safetensors.index.json) and returns the
  // files written. Nothing of this writer has its final name before finish().
  std::vector<std::filesystem::path> finish();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// For ranks that share a Writer's folder `dir` (created with the same `options`): lays `tensors`
// out from `start` as that writer's add() would, one after the other, calls `placed` with the
// position after the last, then writes their bytes into the writer's data files and says where
// each went (Writer::adopt). `placed` comes before the writing, so whoever writes next need not
// wait for it. The tensors are on the CPU and contiguous.
std::vector<PlacedTensor> writePlaced(const std::filesystem::path& dir, const WriterOptions& options, Position start,
                                      const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                                      const std::function<void(Position end)>& placed);

}  // namespace qpipe::safetensors
