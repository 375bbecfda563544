// Cross-rank observer sync (dist/include/qpipe/dist/observer_sync.h). The states are gathered
// rather than all-reduced: one collective per observer whatever its kind, ranks with nothing
// observed take part with an empty list, and since every merge is exact and commutative the
// result does not depend on the rank order it is folded in. States travel on the CPU (they are
// at most 3 x 2048 doubles) and come back to the device they lived on.
#include "qpipe/dist/observer_sync.h"

#include <ATen/ATen.h>

#include <optional>
#include <vector>

#include "qpipe/dist/ops.h"
#include "qpipe/error.h"

namespace qpipe::dist {

namespace {

at::Tensor onCpu(const at::Tensor& t) {
  return t.detach().to(at::kCPU).contiguous();
}

}  // namespace

void syncObserver(ProcessGroup& group, quant::MinMaxObserver& observer) {
  const quant::MinMaxObserver::State& state = observer.state();
  const bool mean = observer.aggregation() == quant::Aggregation::kMean;
  std::optional<at::Device> device;
  std::vector<at::Tensor> local;
  if (!observer.empty()) {
    device = mean ? state.batchMin.front().device() : state.min.device();
    if (mean) {
      for (size_t i = 0; i < state.batchMin.size(); ++i) {
        local.push_back(onCpu(state.batchMin[i]));
        local.push_back(onCpu(state.batchMax[i]));
      }
    } else {
      local = {onCpu(state.min), onCpu(state.max)};
    }
  }
  at::Tensor batches = at::tensor({state.batches}, at::kLong);
  const std::vector<at::Tensor> all = syncGatherTensorLists(group, local);
  syncBaseOperation(group, batches, SyncOp::kSum);
  QPIPE_CHECK(all.size() % 2 == 0, "minmax observer sync: ", all.size(), " gathered tensors, expected pairs");

  const at::Device target = device.value_or(at::Device(at::kCPU));
  quant::MinMaxObserver::State merged;
  for (size_t i = 0; i < all.size(); i += 2) {
    const at::Tensor min = all[i].to(target);
    const at::Tensor max = all[i + 1].to(target);
    if (mean) {
      merged.batchMin.push_back(min);
      merged.batchMax.push_back(max);
    } else {
      merged.min = merged.min.defined() ? at::minimum(merged.min, min) : min;
      merged.max = merged.max.defined() ? at::maximum(merged.max, max) : max;
    }
  }
  merged.batches = batches.item<int64_t>();
  QPIPE_CHECK(mean ? merged.batchMin.size() == static_cast<size_t>(merged.batches)
                   : merged.min.defined() == (merged.batches > 0),
              "minmax observer sync: ", all.size() / 2, " states gathered for ", merged.batches, " batches");
  observer.reset();
  observer.merge(merged);
}

void syncObserver(ProcessGroup& group, quant::HistogramObserver& observer) {
  const quant::HistogramObserver::State& state = observer.state();
  std::vector<at::Tensor> local;
  if (!observer.empty()) {
    local = {onCpu(state.histogram), onCpu(state.binMin), onCpu(state.binMax),
             at::tensor({static_cast<double>(state.exponent)}, at::kDouble)};
  }
  const std::vector<at::Tensor> all = syncGatherTensorLists(group, local);
  QPIPE_CHECK(all.size() % 4 == 0, "histogram observer sync: ", all.size(), " gathered tensors, expected fours");
  observer.reset();
  for (size_t i = 0; i < all.size(); i += 4) {
    observer.merge({all[i], all[i + 1], all[i + 2], static_cast<int>(all[i + 3].item<double>())});
  }
}

void synchronize(ProcessGroup& group, LinearQuantizer& quantizer) {
  if (!quantizer.observes() || quantizer.frozen()) return;
  if (quant::MinMaxObserver* observer = quantizer.minMaxObserver()) syncObserver(group, *observer);
  if (quant::HistogramObserver* observer = quantizer.histogramObserver()) syncObserver(group, *observer);
  quantizer.freeze();
}

}  // namespace qpipe::dist
