// Collective helpers for processors (docs/multirank.md, "dist ops"), over a process group (a
// processor's ProcessorContext::group). With one rank every call returns its input unchanged, so
// processors call them unconditionally.
//
// Results that depend on the order of floating-point reduction (sum, mean, concatenation) are
// made independent of the number of ranks by gathering and reducing in global sample order:
// with samples dealt round-robin (sample i on rank i mod W), the local item j of rank r is
// global item r + j·W.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "qpipe/process_group.h"

namespace qpipe::dist {

enum class SyncOp { kMin, kMax, kSum, kMean, kProd };

// In place on every rank. kMin/kMax are exact in any order. kSum, kProd and kMean depend on
// the order of the floating-point reduction, hence on the world size: kMean is kSum divided by
// the world size (msmodelslim's definition: the mean of the ranks' values, not of the samples).
// Use gatherInSampleOrder when the result must not depend on the world size.
void syncBaseOperation(ProcessGroup& group, at::Tensor& tensor, SyncOp op);

// Every rank's tensor in rank order. `variableShapes`: ranks may hold different shapes (the
// shapes are gathered first). `onCpu`: the result is on the CPU whatever the input's device.
std::vector<at::Tensor> syncGatherTensors(ProcessGroup& group, const at::Tensor& tensor, bool variableShapes = false,
                                          bool onCpu = false);

// Every rank's list flattened in rank order (rank 0's items, then rank 1's, ...). Lists may be
// empty and of different lengths; tensors may differ in shape but not in dtype.
std::vector<at::Tensor> syncGatherTensorLists(ProcessGroup& group, const std::vector<at::Tensor>& tensors);

// Every rank's per-sample items put back in global sample order (the inverse of the
// round-robin deal), so a reduction over the result is the one a single rank would compute.
std::vector<at::Tensor> gatherInSampleOrder(ProcessGroup& group, const std::vector<at::Tensor>& localItems);

}  // namespace qpipe::dist
