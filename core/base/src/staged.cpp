#include "qpipe/staged.h"

#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <exception>
#include <vector>

#include "qpipe/error.h"

#if defined(__SANITIZE_ADDRESS__)
#define QPIPE_ASAN_FIBERS 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define QPIPE_ASAN_FIBERS 1
#endif
#endif
#ifdef QPIPE_ASAN_FIBERS
#include <sanitizer/common_interface_defs.h>
#endif

namespace qpipe {

namespace {

// AddressSanitizer tracks one stack per thread; without being told of each switch it takes a
// task's frames for wild writes and cannot unwind an exception thrown on a task's stack. These
// tell it which stack runs next (a null `save` when the fiber leaving will not come back).
struct FiberStack {
  const void* bottom = nullptr;
  size_t size = 0;
};

void leaveFiber([[maybe_unused]] void** save, [[maybe_unused]] const FiberStack& to) {
#ifdef QPIPE_ASAN_FIBERS
  __sanitizer_start_switch_fiber(save, to.bottom, to.size);
#endif
}

void enterFiber([[maybe_unused]] void* saved, [[maybe_unused]] FiberStack* from) {
#ifdef QPIPE_ASAN_FIBERS
  __sanitizer_finish_switch_fiber(saved, from != nullptr ? &from->bottom : nullptr,
                                  from != nullptr ? &from->size : nullptr);
#endif
}

// Reserved per task, committed only as touched; ATen ops keep their buffers on the heap, so a task
// uses a few pages of it.
constexpr size_t kStackBytes = size_t{8} << 20;

enum class State { kNew, kRunning, kWaiting, kDone };

// Thrown into waiting tasks to unwind them when another task or a settle step failed. Not a
// std::exception, so code that handles those does not take it for an error of its own.
struct Aborted {};

struct Task {
  ucontext_t context{};
  void* stack = nullptr;  // the mapping, guard page included
  State state = State::kNew;
  const void* point = nullptr;                    // while waiting
  const std::function<void()>* settle = nullptr;  // while waiting: lives in the task's frame
  std::exception_ptr error;
  void* fakeStack = nullptr;  // ASan's, saved while the task is switched out
};

struct Run {
  const std::function<void(int64_t)>* body = nullptr;
  std::vector<Task> tasks;
  ucontext_t scheduler{};
  FiberStack schedulerStack;  // learned on the first switch into a task
  void* schedulerFakeStack = nullptr;
  int64_t current = -1;
  bool aborting = false;
  size_t stackBytes = 0;  // guard page included
};

thread_local Run* active = nullptr;

void taskEntry() {
  Run& run = *active;
  const int64_t index = run.current;
  Task& task = run.tasks[static_cast<size_t>(index)];
  enterFiber(nullptr, &run.schedulerStack);
  try {
    (*run.body)(index);
  } catch (const Aborted&) {
  } catch (...) {
    task.error = std::current_exception();
  }
  task.state = State::kDone;
  // Returning resumes uc_link, the scheduler; this stack is not entered again.
  leaveFiber(nullptr, run.schedulerStack);
}

void releaseStack(Task& task, size_t bytes) {
  if (task.stack != nullptr) ::munmap(task.stack, bytes);
  task.stack = nullptr;
}

void start(Run& run, Task& task) {
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  void* mapping = ::mmap(nullptr, run.stackBytes, PROT_READ | PROT_WRITE,
                         MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_STACK, -1, 0);
  QPIPE_REQUIRE(mapping != MAP_FAILED, ErrorCode::kInternal, "staged run: cannot map a task stack of ", run.stackBytes,
                " bytes");
  task.stack = mapping;
  // A stack overflow faults on the guard page instead of writing over the next mapping.
  ::mprotect(mapping, page, PROT_NONE);
  QPIPE_CHECK(::getcontext(&task.context) == 0, "staged run: getcontext failed");
  task.context.uc_stack.ss_sp = static_cast<char*>(mapping) + page;
  task.context.uc_stack.ss_size = run.stackBytes - page;
  task.context.uc_link = &run.scheduler;
  ::makecontext(&task.context, taskEntry, 0);
}

// Runs task `index` until it waits or finishes.
void resume(Run& run, int64_t index) {
  Task& task = run.tasks[static_cast<size_t>(index)];
  if (task.state == State::kNew) start(run, task);
  task.state = State::kRunning;
  run.current = index;
  leaveFiber(&run.schedulerFakeStack, {task.context.uc_stack.ss_sp, task.context.uc_stack.ss_size});
  const int swapped = ::swapcontext(&run.scheduler, &task.context);
  enterFiber(run.schedulerFakeStack, nullptr);
  QPIPE_CHECK(swapped == 0, "staged run: swapcontext failed");
  run.current = -1;
  if (task.state == State::kDone) releaseStack(task, run.stackBytes);
}

// Unwinds every waiting task (their settlePoint throws Aborted), then rethrows `error`.
[[noreturn]] void abortRun(Run& run, const std::exception_ptr& error) {
  run.aborting = true;
  for (size_t i = 0; i < run.tasks.size(); ++i) {
    if (run.tasks[i].state == State::kWaiting) resume(run, static_cast<int64_t>(i));
  }
  std::rethrow_exception(error);
}

}  // namespace

void runStaged(int64_t n, const std::function<void(int64_t task)>& task) {
  QPIPE_CHECK(active == nullptr, "runStaged does not nest");
  if (n <= 0) return;
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  Run run;
  run.body = &task;
  run.tasks.resize(static_cast<size_t>(n));
  run.stackBytes = kStackBytes + page;
  active = &run;
  struct Reset {
    Run& run;
    ~Reset() {
      for (Task& t : run.tasks) releaseStack(t, run.stackBytes);
      active = nullptr;
    }
  } reset{run};

  for (;;) {
    // A round: every unfinished task, in order, runs until it waits or finishes.
    for (int64_t i = 0; i < n; ++i) {
      Task& t = run.tasks[static_cast<size_t>(i)];
      if (t.state == State::kDone) continue;
      resume(run, i);
      if (t.error) abortRun(run, t.error);
    }
    int64_t first = -1;
    int64_t finishedNow = -1;
    for (int64_t i = 0; i < n; ++i) {
      const Task& t = run.tasks[static_cast<size_t>(i)];
      if (t.state == State::kWaiting && first < 0) first = i;
      if (t.state == State::kDone && finishedNow < 0) finishedNow = i;
    }
    if (first < 0) return;
    const Task& waiting = run.tasks[static_cast<size_t>(first)];
    try {
      QPIPE_CHECK(finishedNow < 0, "staged run: task ", finishedNow, " finished while task ", first,
                  " waits at a settle point (the modules did not run the same way for every sample)");
      for (int64_t i = first + 1; i < n; ++i) {
        QPIPE_CHECK(run.tasks[static_cast<size_t>(i)].point == waiting.point, "staged run: tasks ", first, " and ", i,
                    " wait at different settle points (the modules did not run the same way for every sample)");
      }
      (*waiting.settle)();
    } catch (...) {
      abortRun(run, std::current_exception());
    }
  }
}

void settlePoint(const void* point, const std::function<void()>& settle) {
  QPIPE_CHECK(active != nullptr && active->current >= 0, "settlePoint outside a staged run");
  Run& run = *active;
  const int64_t index = run.current;
  Task& task = run.tasks[static_cast<size_t>(index)];
  task.state = State::kWaiting;
  task.point = point;
  task.settle = &settle;
  leaveFiber(&task.fakeStack, run.schedulerStack);
  const int swapped = ::swapcontext(&task.context, &run.scheduler);
  enterFiber(task.fakeStack, nullptr);
  QPIPE_CHECK(swapped == 0, "staged run: swapcontext failed");
  task.point = nullptr;
  task.settle = nullptr;
  if (run.aborting) throw Aborted{};
}

bool inStagedRun() {
  return active != nullptr && active->current >= 0;
}

int64_t stagedTask() {
  return active != nullptr ? active->current : -1;
}

}  // namespace qpipe
