// Python's safetensors reads what qpipe writes and qpipe reads what Python writes, with the
// tensors byte-identical both ways.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <iomanip>
#include <sstream>

#include "qpipe/safetensors.h"
#include "test_helpers.h"

namespace qpipe::safetensors {
namespace {

namespace fs = std::filesystem;

// The raw bytes in hex; the fixtures are small.
std::string hexBytes(const at::Tensor& tensor) {
  const at::Tensor t = tensor.contiguous();
  const auto* bytes = static_cast<const unsigned char*>(t.data_ptr());
  std::ostringstream hex;
  for (size_t i = 0; i < t.nbytes(); ++i) hex << std::hex << std::setw(2) << std::setfill('0') << int{bytes[i]};
  return hex.str();
}

std::string torchName(at::ScalarType type) {
  switch (type) {
    case at::kDouble:
      return "float64";
    case at::kFloat:
      return "float32";
    case at::kHalf:
      return "float16";
    case at::kBFloat16:
      return "bfloat16";
    case at::kFloat8_e4m3fn:
      return "float8_e4m3fn";
    case at::kFloat8_e5m2:
      return "float8_e5m2";
    case at::kLong:
      return "int64";
    case at::kInt:
      return "int32";
    case at::kShort:
      return "int16";
    case at::kChar:
      return "int8";
    case at::kByte:
      return "uint8";
    case at::kBool:
      return "bool";
    default:
      return c10::toString(type);
  }
}

// The same "name dtype [shape] hex" lines the oracle prints.
std::string describe(const File& file) {
  std::vector<std::string> lines;
  for (const auto& info : file.tensors()) {
    const at::Tensor t = file.tensor(info.name);
    std::ostringstream line;
    line << info.name << " " << torchName(t.scalar_type()) << " [";
    for (size_t i = 0; i < info.shape.size(); ++i) line << (i ? ", " : "") << info.shape[i];
    line << "] " << hexBytes(t);
    lines.push_back(line.str());
  }
  std::sort(lines.begin(), lines.end());
  std::string out;
  for (const auto& line : lines) out += line + "\n";
  return out;
}

TEST(SafetensorsOracle, PythonReadsOurFilesByteIdentical) {
  const fs::path dir = test::writeTempFile("x", "").parent_path() / "ours";
  fs::remove_all(dir);
  Writer writer(dir);
  const at::Tensor base = at::randn({5, 7}) * 30;
  for (auto type : {at::kDouble, at::kFloat, at::kHalf, at::kBFloat16, at::kFloat8_e4m3fn, at::kFloat8_e5m2, at::kLong,
                    at::kInt, at::kShort, at::kChar, at::kByte, at::kBool}) {
    writer.add("t_" + torchName(type), base.to(type));
  }
  writer.finish();
  const std::string expected = describe(*File::open(dir / "model.safetensors"));
  EXPECT_EQ(test::runOracle("safetensors_oracle.py", "dump " + (dir / "model.safetensors").string()), expected);
}

TEST(SafetensorsOracle, WeReadPythonFilesByteIdentical) {
  const fs::path dir = test::writeTempFile("x", "").parent_path();
  test::runOracle("safetensors_oracle.py", "write " + dir.string());
  const auto file = File::open(dir / "python.safetensors");
  EXPECT_EQ(file->metadata().at("producer"), "python");
  EXPECT_EQ(describe(*file), test::runOracle("safetensors_oracle.py", "dump " + (dir / "python.safetensors").string()));
}

}  // namespace
}  // namespace qpipe::safetensors
