#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include "qpipe/safetensors.h"
#include "test_helpers.h"

namespace qpipe::safetensors {
namespace {

namespace fs = std::filesystem;

// A raw file: 8-byte little-endian header length, the header text, then `dataBytes` bytes.
fs::path rawFile(const std::string& name, const std::string& header, size_t dataBytes, int64_t lengthDelta = 0) {
  std::string bytes(8, '\0');
  const uint64_t length = header.size() + lengthDelta;
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((length >> (8 * i)) & 0xff);
  bytes += header;
  bytes.append(dataBytes, '\x01');
  return test::writeTempFile(name, bytes);
}

std::string openError(const fs::path& path) {
  return test::errorOf([&] { File::open(path); }, ErrorCode::kInput);
}

TEST(Safetensors, EveryDtypeRoundTripsByteForByte) {
  const fs::path dir = test::writeTempFile("x", "").parent_path() / "roundtrip";
  fs::remove_all(dir);
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  const at::Tensor base = at::randn({3, 5}, at::kFloat) * 100;
  for (auto type : {at::kDouble, at::kFloat, at::kHalf, at::kBFloat16, at::kFloat8_e4m3fn, at::kFloat8_e5m2, at::kLong,
                    at::kInt, at::kShort, at::kChar, at::kByte, at::kBool}) {
    tensors.emplace_back(dtypeName(type), base.to(type));
  }
  tensors.emplace_back("scalar", at::scalar_tensor(7.5));
  tensors.emplace_back("empty", at::empty({0, 4}));
  tensors.emplace_back("strided", at::arange(24, at::kFloat).view({4, 6}).t());  // not contiguous
  // Written in several pwrite calls (2 MiB each), the last one short.
  tensors.emplace_back("large", at::randint(-128, 128, {(5 << 20) + 3}, at::kChar));
  Writer writer(dir, {.metadata = {{"producer", "qpipe-test"}}});
  for (const auto& [name, tensor] : tensors) writer.add(name, tensor);
  EXPECT_EQ(writer.finish(), std::vector<fs::path>{dir / "model.safetensors"});

  const auto file = File::open(dir / "model.safetensors");
  EXPECT_EQ(file->metadata().at("format"), "pt");
  EXPECT_EQ(file->metadata().at("producer"), "qpipe-test");
  for (const auto& [name, tensor] : tensors) {
    const at::Tensor read = file->tensor(name);
    ASSERT_EQ(read.scalar_type(), tensor.scalar_type()) << name;
    ASSERT_EQ(read.sizes(), tensor.sizes()) << name;
    const at::Tensor expected = tensor.contiguous();
    // memcmp takes no null pointers, which an empty tensor's storage is.
    if (expected.nbytes() > 0) {
      EXPECT_EQ(std::memcmp(read.data_ptr(), expected.data_ptr(), expected.nbytes()), 0) << name;
    }
  }
}

TEST(Safetensors, ShardsByTheSizeLimitWithAnIndexAndReadsBack) {
  const fs::path dir = test::writeTempFile("x", "").parent_path() / "sharded";
  fs::remove_all(dir);
  Writer writer(dir, {.maxShardBytes = 100});
  for (int i = 0; i < 5; ++i) writer.add("t" + std::to_string(i), at::full({16}, i, at::kFloat));  // 64 bytes each
  const auto files = writer.finish();
  ASSERT_EQ(files.size(), 6u);
  EXPECT_EQ(files[0].filename(), "model-00001-of-00005.safetensors");
  EXPECT_EQ(files[5].filename(), "model.safetensors.index.json");
  for (const auto& entry : fs::directory_iterator(dir)) {
    EXPECT_EQ(entry.path().string().find(".tmp"), std::string::npos) << entry.path();
  }
  const Checkpoint checkpoint = Checkpoint::open(dir);
  EXPECT_EQ(checkpoint.names(), (std::vector<std::string>{"t0", "t1", "t2", "t3", "t4"}));
  EXPECT_EQ(checkpoint.totalBytes(), 5u * 64u);
  EXPECT_TRUE(at::equal(checkpoint.tensor("t3"), at::full({16}, 3, at::kFloat)));
}

// A shard's header goes in front of its data in place where the file system can insert a range
// (ext4, XFS) or the writer reserved room for it; elsewhere (tmpfs: /dev/shm) the data is copied
// behind it. All give the same bytes, with the data on a 4 KiB boundary: after the reserve where
// the header fits in it, else after the header.
TEST(Safetensors, HeadersInPlaceReservedOrCopiedGiveTheSameBytesWithTheDataOn4KiB) {
  const fs::path local = test::writeTempFile("x", "").parent_path();
  const fs::path shm = fs::path("/dev/shm") / ("qpipe-copied-" + std::to_string(::getpid()));
  ASSERT_TRUE(fs::is_directory("/dev/shm")) << "this test needs a tmpfs at /dev/shm";
  std::vector<std::pair<std::string, at::Tensor>> few{
      {"a", at::randn({7, 5})}, {"b", at::arange(11, at::kChar)}, {"c", at::randn({3}).to(at::kBFloat16)}};
  std::vector<std::pair<std::string, at::Tensor>> many;  // a header of more than 4 KiB
  for (int i = 0; i < 100; ++i) many.emplace_back("tensor_number_" + std::to_string(i), at::full({3}, i));
  const auto write = [](const fs::path& dir, uint64_t reserve, const auto& tensors) {
    fs::remove_all(dir);
    Writer writer(dir, {.headerReserve = reserve});
    for (const auto& [name, tensor] : tensors) writer.add(name, tensor);
    writer.finish();
    EXPECT_EQ(std::distance(fs::directory_iterator(dir), fs::directory_iterator()), 1) << dir;
    const std::string bytes = test::slurp(dir / "model.safetensors");
    fs::remove_all(dir);
    return bytes;
  };
  for (const uint64_t reserve : {uint64_t{0}, uint64_t{8192}}) {
    const std::string bytes = write(local / "own", reserve, few);
    EXPECT_EQ(bytes, write(shm, reserve, few)) << "reserve " << reserve;
    const fs::path file = test::writeTempFile("few.safetensors", bytes);
    const auto read = File::open(file);
    EXPECT_EQ(read->dataOffset(), reserve == 0 ? 4096u : reserve);
    EXPECT_EQ(bytes.size(), read->dataOffset() + 7 * 5 * 4 + 11 + 3 * 2);
    for (const auto& [name, tensor] : few) EXPECT_TRUE(at::equal(read->tensor(name), tensor)) << name;
  }
  const std::string unreserved = write(local / "many", 0, many);
  EXPECT_GT(File::open(test::writeTempFile("many.safetensors", unreserved))->dataOffset(), 4096u);
  EXPECT_EQ(write(local / "many-small-reserve", 4096, many), unreserved);
  EXPECT_EQ(write(shm, 4096, many), unreserved);
}

// What other processes write into a writer's data files (writePlaced), each laid out after the
// last, and the writer adopts in order is the checkpoint one writer adding everything makes,
// shard boundaries included; a placed tensor adopted out of place is an internal error.
TEST(Safetensors, PlacedAndAdoptedTensorsMakeTheOneWriterCheckpoint) {
  const fs::path root = test::writeTempFile("x", "").parent_path();
  const fs::path direct = root / "placed-direct", shared = root / "placed-shared";
  fs::remove_all(direct);
  fs::remove_all(shared);
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (int i = 0; i < 10; ++i) tensors.emplace_back("t" + std::to_string(i), at::full({5 + i}, i, at::kFloat));
  const WriterOptions options{.maxShardBytes = 100, .headerReserve = 4096};
  {
    Writer writer(direct, options);
    for (const auto& [name, tensor] : tensors) writer.add(name, tensor);
    writer.finish();
  }
  Writer owner(shared, options);
  owner.add(tensors[0].first, tensors[0].second);
  const std::vector<std::pair<std::string, at::Tensor>> first(tensors.begin() + 1, tensors.begin() + 5);
  const std::vector<std::pair<std::string, at::Tensor>> second(tensors.begin() + 5, tensors.begin() + 9);
  Position afterFirst, afterSecond;
  const auto placedFirst =
      writePlaced(shared, options, owner.position(), first, [&](Position end) { afterFirst = end; });
  const auto placedSecond = writePlaced(shared, options, afterFirst, second, [&](Position end) { afterSecond = end; });
  EXPECT_NE(test::errorOf([&] { owner.adopt(placedSecond); }, ErrorCode::kInternal)
                .find("tensor 't5' lies at shard 2 byte 0, where the writer's next tensor goes to shard 0 byte 20"),
            std::string::npos);
  owner.adopt(placedFirst);
  owner.adopt(placedSecond);
  EXPECT_EQ(owner.position().shard, afterSecond.shard);
  EXPECT_EQ(owner.position().bytes, afterSecond.bytes);
  owner.add(tensors[9].first, tensors[9].second);
  const auto files = owner.finish();
  ASSERT_EQ(files.size(), 6u);
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(direct)) names.push_back(entry.path().filename().string());
  EXPECT_EQ(names.size(), files.size());
  for (const std::string& name : names) EXPECT_EQ(test::slurp(direct / name), test::slurp(shared / name)) << name;
}

TEST(Safetensors, AnUnfinishedWriterLeavesNothing) {
  const fs::path dir = test::writeTempFile("x", "").parent_path() / "unfinished";
  fs::remove_all(dir);
  {
    Writer writer(dir);
    writer.add("a", at::ones({4}));
  }
  EXPECT_TRUE(fs::is_empty(dir));
}

TEST(Safetensors, TensorsKeepTheMappingAliveAndWritesStayPrivate) {
  const fs::path dir = test::writeTempFile("x", "").parent_path() / "alive";
  fs::remove_all(dir);
  Writer writer(dir);
  writer.add("w", at::arange(8, at::kFloat));
  writer.finish();
  at::Tensor view;
  {
    const auto file = File::open(dir / "model.safetensors");
    view = file->tensor("w");
  }
  view.add_(1);  // copy-on-write: the file is untouched
  EXPECT_TRUE(at::equal(view, at::arange(8, at::kFloat) + 1));
  EXPECT_TRUE(at::equal(File::open(dir / "model.safetensors")->tensor("w"), at::arange(8, at::kFloat)));
}

TEST(Safetensors, DroppedPagesAreReadAgainFromTheFile) {
  const fs::path dir = test::writeTempFile("x", "").parent_path() / "dropped";
  fs::remove_all(dir);
  Writer writer(dir);
  writer.add("small", at::arange(3, at::kFloat));
  writer.add("big", at::arange(1 << 16, at::kFloat));  // 256 KiB: many whole pages
  writer.add("after", at::arange(5, at::kFloat));
  writer.finish();
  const auto checkpoint = Checkpoint::open(dir);
  const at::Tensor big = checkpoint.tensor("big");
  const at::Tensor after = checkpoint.tensor("after");
  EXPECT_EQ(big.sum().item<double>(), 65535.0 * 65536 / 2);  // every page resident now
  for (const char* name : {"small", "big", "after"}) checkpoint.dropPages(name);
  EXPECT_TRUE(at::equal(big, at::arange(1 << 16, at::kFloat)));  // refaulted from the file
  EXPECT_TRUE(at::equal(after, at::arange(5, at::kFloat)));
  EXPECT_NE(test::errorOf([&] { checkpoint.dropPages("missing"); }, ErrorCode::kInput).find("'missing'"),
            std::string::npos);
}

TEST(Safetensors, TruncatedFileIsRejected) {
  const fs::path path =
      rawFile("truncated.safetensors", R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 10);
  EXPECT_EQ(openError(path), path.string() +
                                 ": tensor 'a': data_offsets [0, 16] run past the end of the data (10 "
                                 "bytes; file truncated?)");
  const fs::path tiny = test::writeTempFile("tiny.safetensors", "abc");
  EXPECT_EQ(openError(tiny), tiny.string() + ": file is 3 bytes, too short for the 8-byte header length");
}

TEST(Safetensors, CorruptedHeaderIsRejected) {
  const fs::path notJson = rawFile("corrupt.safetensors", R"({"a":{"dtype":"F32",)", 0);
  EXPECT_EQ(openError(notJson).rfind(notJson.string() + ": header is not valid JSON (", 0), 0u);
  const fs::path longHeader = rawFile("long.safetensors", "{}", 0, 1000);
  EXPECT_EQ(openError(longHeader),
            longHeader.string() + ": header length 1002 runs past the end of the file (10 bytes)");
  const fs::path huge = rawFile("huge.safetensors", "{}", 0, 200'000'000);
  EXPECT_EQ(openError(huge), huge.string() + ": header length 200000002 exceeds the limit of 100000000 bytes");
  const fs::path dtype =
      rawFile("dtype.safetensors", R"({"a":{"dtype":"F128","shape":[1],"data_offsets":[0,16]}})", 16);
  EXPECT_EQ(openError(dtype), dtype.string() + ": tensor 'a': unknown dtype 'F128'");
  const fs::path size = rawFile("size.safetensors", R"({"a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,20]}})", 20);
  EXPECT_EQ(openError(size),
            size.string() + ": tensor 'a': F32 [2, 3] needs 24 bytes, but data_offsets [0, 20] span 20");
  const fs::path extra =
      rawFile("extra.safetensors", R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":1}})", 4);
  EXPECT_EQ(openError(extra), extra.string() + ": tensor 'a': unexpected header field 'x'");
}

TEST(Safetensors, OverlappingGappedAndTrailingDataAreRejected) {
  const fs::path overlap = rawFile(
      "overlap.safetensors",
      R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
      12);
  EXPECT_EQ(openError(overlap),
            overlap.string() + ": tensor 'b': data_offsets [4, 12] overlap tensor 'a' (which ends at 8)");
  const fs::path gap = rawFile(
      "gap.safetensors",
      R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
      12);
  EXPECT_EQ(openError(gap), gap.string() + ": tensor 'b': data_offsets [8, 12] leave a gap of 4 bytes before it");
  const fs::path trailing =
      rawFile("trailing.safetensors", R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 9);
  EXPECT_EQ(openError(trailing), trailing.string() + ": 5 bytes after the last tensor belong to no tensor");
}

TEST(Safetensors, CheckpointErrorsNameTheFolderAndTensor) {
  const fs::path dir = test::writeTempFile("x", "").parent_path() / "bad-index";
  fs::remove_all(dir);
  Writer writer(dir);
  writer.add("a", at::ones({2}));
  writer.finish();
  std::ofstream(dir / "model.safetensors.index.json")
      << R"({"weight_map": {"a": "model.safetensors", "b": "model.safetensors"}})";
  EXPECT_EQ(test::errorOf([&] { Checkpoint::open(dir); }, ErrorCode::kInput),
            (dir / "model.safetensors.index.json").string() +
                ": lists tensor 'b' in model.safetensors, which does not hold it");
  // A shard outside the model folder is not followed.
  for (const std::string shard : {"../model.safetensors", "/etc/passwd", ".."}) {
    std::ofstream(dir / "model.safetensors.index.json", std::ios::trunc)
        << R"({"weight_map": {"a": ")" << shard << R"("}})";
    EXPECT_EQ(test::errorOf([&] { Checkpoint::open(dir); }, ErrorCode::kInput),
              (dir / "model.safetensors.index.json").string() + ": weight_map entry of 'a' is '" + shard +
                  "', not a file name in the model folder");
  }
  const fs::path empty = dir / "empty";
  fs::create_directories(empty);
  EXPECT_EQ(test::errorOf([&] { Checkpoint::open(empty); }, ErrorCode::kInput),
            empty.string() + ": no model.safetensors or model.safetensors.index.json");
}

}  // namespace
}  // namespace qpipe::safetensors
