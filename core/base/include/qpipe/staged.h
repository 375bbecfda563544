// Staged runs: n tasks (one calibration sample's forward through a layer each) that wait for one
// another at settle points. The runner uses it for the one-pass static calibration
// (docs/quantization.md): a quantizer observes a sample's input, waits until every sample's input
// was observed, and the last arrival's settle step (the cross-rank sync and freeze) fixes its
// parameters before any sample goes on past it. So each module is observed on the inputs it will
// see, with everything upstream already final, in one forward.
//
// The tasks are coroutines on the calling thread with stacks of their own: they run one at a time,
// always in task order, so ATen, OpenMP and thread-local state see one ordinary thread, and
// observers see samples in the same order as a loop over them would.
#pragma once

#include <cstdint>
#include <functional>

namespace qpipe {

// Runs task(0) … task(n - 1). Each runs until it finishes or reaches a settle point; when every
// unfinished task waits at the same point, its settle step runs once (on the caller's stack) and
// the tasks go on, in order. Rethrows the first task's or settle step's exception after unwinding
// every other task. Tasks that wait at different points, or some that finished while others wait,
// are an error: the layer's modules did not run the same way for every sample.
void runStaged(int64_t n, const std::function<void(int64_t task)>& task);

// Inside runStaged: waits until every task has arrived at `point` (any address identifying it),
// then returns after `settle` ran. Calling it outside runStaged is an internal error.
void settlePoint(const void* point, const std::function<void()>& settle);

// True while the caller is one of runStaged's tasks.
bool inStagedRun();
// The running task's index inside runStaged (what a hook uses to tell which sample it sees);
// -1 outside.
int64_t stagedTask();

}  // namespace qpipe
