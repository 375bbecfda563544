#include "qpipe/dist/ops.h"

#include <ATen/Functions.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <string>

#include "qpipe/error.h"

namespace qpipe::dist {

namespace {
// The header of an empty list in syncGatherTensorLists.
constexpr int64_t kNoDtype = -1;

ReduceOp toReduceOp(SyncOp op) {
  switch (op) {
    case SyncOp::kMin:
      return ReduceOp::kMin;
    case SyncOp::kMax:
      return ReduceOp::kMax;
    case SyncOp::kSum:
    case SyncOp::kMean:
      return ReduceOp::kSum;
    case SyncOp::kProd:
      return ReduceOp::kProd;
  }
  QPIPE_CHECK(false, "unknown SyncOp ", static_cast<int>(op));
}
}  // namespace

void syncBaseOperation(ProcessGroup& group, at::Tensor& tensor, SyncOp op) {
  if (group.worldSize() == 1) return;
  group.allReduce(tensor, toReduceOp(op));
  // Mean as sum then divide, as msmodelslim (HCCL has no average).
  if (op == SyncOp::kMean) tensor.div_(group.worldSize());
}

std::vector<at::Tensor> syncGatherTensors(ProcessGroup& group, const at::Tensor& tensor, bool variableShapes,
                                          bool onCpu) {
  std::vector<at::Tensor> gathered;
  if (group.worldSize() == 1) {
    gathered = {tensor};
  } else {
    gathered = group.allGather(tensor);
    QPIPE_REQUIRE(variableShapes || std::all_of(gathered.begin(), gathered.end(),
                                                [&](const at::Tensor& t) { return t.sizes() == tensor.sizes(); }),
                  ErrorCode::kDistributed, "syncGatherTensors: ranks hold different shapes (this rank ", tensor.sizes(),
                  "); pass variableShapes=true");
  }
  if (onCpu) {
    for (at::Tensor& t : gathered) t = t.cpu();
  }
  return gathered;
}

std::vector<at::Tensor> syncGatherTensorLists(ProcessGroup& group, const std::vector<at::Tensor>& tensors) {
  if (group.worldSize() == 1) return tensors;
  // One gather of a header (dtype, device type, shapes) and one of the data, concatenated: a
  // rank with an empty list still takes part, with the dtype and device its peers use.
  std::vector<int64_t> header{kNoDtype, 0};
  for (const at::Tensor& t : tensors) {
    QPIPE_REQUIRE(t.scalar_type() == tensors.front().scalar_type() && t.device() == tensors.front().device(),
                  ErrorCode::kDistributed, "syncGatherTensorLists: the list mixes ", tensors.front().scalar_type(),
                  " on ", tensors.front().device(), " with ", t.scalar_type(), " on ", t.device());
    header[0] = static_cast<int64_t>(t.scalar_type());
    header[1] = static_cast<int64_t>(t.device().type());
    header.push_back(t.dim());
    header.insert(header.end(), t.sizes().begin(), t.sizes().end());
  }
  const std::vector<std::string> headers =
      group.allGatherBytes(std::string(reinterpret_cast<const char*>(header.data()), header.size() * sizeof(int64_t)));
  std::vector<std::vector<int64_t>> decoded;
  std::optional<at::TensorOptions> common;
  for (const std::string& bytes : headers) {
    std::vector<int64_t>& values = decoded.emplace_back(bytes.size() / sizeof(int64_t));
    std::memcpy(values.data(), bytes.data(), values.size() * sizeof(int64_t));
    if (values[0] != kNoDtype && !common) {
      common = at::TensorOptions()
                   .dtype(static_cast<at::ScalarType>(values[0]))
                   .device(static_cast<c10::DeviceType>(values[1]));
    }
  }
  if (!common) return {};

  std::vector<at::Tensor> flat;
  flat.reserve(tensors.size());
  for (const at::Tensor& t : tensors) flat.push_back(t.reshape({-1}));
  const at::Tensor local = tensors.empty() ? at::empty({0}, *common) : at::cat(flat);
  const std::vector<at::Tensor> data = group.allGather(local);

  std::vector<at::Tensor> result;
  for (size_t r = 0; r < decoded.size(); ++r) {
    const std::vector<int64_t>& values = decoded[r];
    int64_t start = 0;
    for (size_t i = 2; i < values.size(); i += 1 + values[i]) {
      const std::vector<int64_t> shape(values.begin() + i + 1, values.begin() + i + 1 + values[i]);
      const int64_t numel = c10::multiply_integers(shape);
      result.push_back(data[r].narrow(0, start, numel).view(shape));
      start += numel;
    }
  }
  return result;
}

std::vector<at::Tensor> gatherInSampleOrder(ProcessGroup& group, const std::vector<at::Tensor>& localItems) {
  const int worldSize = group.worldSize();
  if (worldSize == 1) return localItems;
  std::vector<int64_t> counts;
  for (const std::string& count : group.allGatherBytes(std::to_string(localItems.size()))) {
    counts.push_back(std::stoll(count));
  }
  const std::vector<at::Tensor> byRank = syncGatherTensorLists(group, localItems);
  // byRank holds rank 0's items, then rank 1's, ...; global item r + j·W is rank r's item j.
  std::vector<int64_t> firstOfRank(worldSize, 0);
  for (int r = 1; r < worldSize; ++r) firstOfRank[r] = firstOfRank[r - 1] + counts[r - 1];
  const int64_t total = firstOfRank.back() + counts.back();
  std::vector<at::Tensor> ordered;
  ordered.reserve(total);
  for (int64_t i = 0; i < total; ++i) {
    const int r = static_cast<int>(i % worldSize);
    const int64_t j = i / worldSize;
    QPIPE_REQUIRE(j < counts[r], ErrorCode::kDistributed, "gatherInSampleOrder: rank ", r, " holds ", counts[r],
                  " items, but global item ", i, " is its item ", j, " (samples are not dealt round-robin)");
    ordered.push_back(byRank[firstOfRank[r] + j]);
  }
  return ordered;
}

}  // namespace qpipe::dist
