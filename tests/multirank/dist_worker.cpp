// qpipe_dist_worker <scenario>: one rank of a multirank test. Joins the group from RANK,
// WORLD_SIZE, MASTER_ADDR, MASTER_PORT and QPIPE_DIST_TIMEOUT_S, runs the scenario and prints
// its results, one "name: values" line each. An error prints "error: <message>", is reported to
// the peers (as qpipe's top-level handler does) and exits with the error's code.
#include <ATen/Functions.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <iostream>
#include <limits>
#include <memory>
#include <sstream>
#include <string>
#include <thread>

#include "qpipe/dist/dist_helper.h"
#include "qpipe/dist/ops.h"
#include "qpipe/dist/process_group.h"
#include "qpipe/error.h"
#include "qpipe/module.h"
#include "qpipe/scheduler/task_scheduler.h"

namespace {

// The group this worker joined; the group of one until then.
std::shared_ptr<qpipe::ProcessGroup> joined = qpipe::ProcessGroup::single();
qpipe::ProcessGroup& world() {
  return *joined;
}

using namespace qpipe::dist;
using qpipe::ProcessGroup;
using qpipe::ReduceOp;

std::string values(const at::Tensor& tensor) {
  std::ostringstream os;
  const at::Tensor flat = tensor.to(at::kDouble).reshape({-1});
  for (int64_t i = 0; i < flat.numel(); ++i) os << (i ? " " : "") << flat[i].item<double>();
  return os.str();
}

std::string shape(const at::Tensor& tensor) {
  std::ostringstream os;
  for (int64_t d = 0; d < tensor.dim(); ++d) os << (d ? "x" : "") << tensor.size(d);
  return os.str();
}

std::string escaped(const std::string& bytes) {
  std::string out;
  for (char c : bytes) {
    if (c == '\0') {
      out += "\\0";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

void collectives() {
  ProcessGroup& group = world();
  const int rank = group.rank();
  const int world = group.worldSize();
  const float r1 = static_cast<float>(rank + 1);
  const at::Tensor v = at::tensor({r1, 2 * r1, -r1});
  const std::pair<SyncOp, const char*> ops[] = {{SyncOp::kMin, "min"},
                                                {SyncOp::kMax, "max"},
                                                {SyncOp::kSum, "sum"},
                                                {SyncOp::kProd, "prod"},
                                                {SyncOp::kMean, "mean"}};
  for (const auto& [op, name] : ops) {
    at::Tensor t = v.clone();
    syncBaseOperation(group, t, op);
    std::cout << name << ": " << values(t) << "\n";
  }
  // A non-contiguous tensor is reduced in place all the same.
  at::Tensor strided = at::stack({v, v}, 1).select(1, 0);
  group.allReduce(strided, ReduceOp::kSum);
  std::cout << "strided sum: " << values(strided) << "\n";

  // Rank r holds (r+1) x 2 values 10r, 10r+1, ...
  const at::Tensor rows = at::arange(2 * (rank + 1), at::kFloat).reshape({rank + 1, 2}).add(10 * rank);
  const auto gathered = syncGatherTensors(group, rows, /*variableShapes=*/true);
  for (size_t r = 0; r < gathered.size(); ++r) {
    std::cout << "gather " << r << ": " << shape(gathered[r]) << " " << values(gathered[r]) << "\n";
  }
  const auto same = syncGatherTensors(group, at::full({2}, static_cast<int64_t>(rank), at::kLong));
  std::cout << "gather equal:";
  for (const at::Tensor& t : same) std::cout << " " << values(t);
  std::cout << "\n";

  // Rank r holds r tensors (rank 0 none), tensor i of shape (i+1) filled with 100r + i.
  std::vector<at::Tensor> list;
  for (int i = 0; i < rank; ++i) list.push_back(at::full({i + 1}, static_cast<float>(100 * rank + i)));
  std::cout << "lists:";
  for (const at::Tensor& t : syncGatherTensorLists(group, list)) std::cout << " " << shape(t) << "=" << values(t[0]);
  std::cout << "\n";

  // Seven samples dealt round-robin; sample i has i%3+1 values equal to i.
  std::vector<at::Tensor> samples;
  for (int i = rank; i < 7; i += world) samples.push_back(at::full({i % 3 + 1}, static_cast<float>(i)));
  std::cout << "sample order:";
  for (const at::Tensor& t : gatherInSampleOrder(group, samples)) std::cout << " " << shape(t) << "=" << values(t[0]);
  std::cout << "\n";

  at::Tensor broadcast = at::full({3}, static_cast<double>(rank + 10), at::kDouble);
  group.broadcast(broadcast, world - 1);
  std::cout << "broadcast: " << values(broadcast) << "\n";

  const auto bytes = group.allGatherBytes("rank" + std::to_string(rank) + std::string(rank, '\0') + "\n");
  std::cout << "bytes:";
  for (const std::string& b : bytes) std::cout << " " << escaped(b);
  std::cout << "\n";
  // Rank r passes 2 + 4r bytes: slot 0 sends everything as overflow, slot 6 only rank 2's tail
  // (rank 1 fills it exactly), slot 64 nothing.
  for (const int64_t slot : {0, 6, 64}) {
    const auto within =
        group.allGatherBytesWithin(std::to_string(rank) + std::string(4 * rank, 'x') + std::string(1, '\0'), slot);
    std::cout << "within " << slot << ":";
    for (const std::string& b : within) std::cout << " " << escaped(b);
    std::cout << "\n";
  }
  group.barrier();
  std::cout << "done" << std::endl;
}

// Rank r's part of an exchange, as its sender holds it (`values`) or as a receiver's slots: small
// tensors (one message), an empty one, a large one whose size depends on r (rank 2's part spans
// two of the host channel's rounds) and a large and a small one whose slots are not contiguous
// (the small one sent from a tensor that is not contiguous either).
std::vector<at::Tensor> exchangePart(int r, bool values) {
  const auto filled = [&](at::Tensor slot, const at::Tensor& value) { return values ? value : slot; };
  const at::Tensor wide = at::arange(20000, at::kFloat).reshape({100, 200}).add(r);
  const at::Tensor narrow = at::arange(8, at::kFloat).reshape({2, 4}).add(100 * r).t().contiguous().t();
  return {
      filled(at::empty({3}), at::full({3}, r + 0.5)),
      filled(at::empty({2}, at::kDouble), at::full({2}, 10.0 * r, at::kDouble)),
      at::empty({0}),
      filled(at::empty({r + 1, 20000}), at::arange((r + 1) * 20000, at::kFloat).reshape({r + 1, 20000}).add(1000 * r)),
      filled(at::empty({200, 100}).t(), wide),
      filled(at::empty({4, 2}).t(), narrow)};
}

void exchange() {
  ProcessGroup& group = world();
  std::vector<std::vector<at::Tensor>> parts;
  for (int r = 0; r < group.worldSize(); ++r) parts.push_back(exchangePart(r, r == group.rank()));
  std::cout << "in place: " << group.exchangeInPlace(parts) << "\n";
  for (int r = 0; r < group.worldSize(); ++r) {
    const std::vector<at::Tensor> expected = exchangePart(r, true);
    std::cout << "part " << r << ": " << values(parts[r][0]) << " | " << values(parts[r][1]) << " | "
              << shape(parts[r][3]) << " " << parts[r][3][r][19999].item<float>() << " | "
              << parts[r][4][99][199].item<float>() << " | " << values(parts[r][5]) << " |";
    for (size_t i = 0; i < expected.size(); ++i) std::cout << " " << at::equal(parts[r][i], expected[i]);
    std::cout << "\n";
  }
  group.barrier();
  std::cout << "done" << std::endl;
}

// Rank 1 takes rank 0's part for two floats, rank 0 sends three; or, with `layout`, the same four
// floats as one tensor on rank 0 and as two on rank 1.
void exchangeMismatch(bool layout) {
  ProcessGroup& group = world();
  std::vector<std::vector<at::Tensor>> parts{{at::zeros({group.rank() == 1 ? 2 : 3})}, {}};
  if (layout) {
    parts[0] = group.rank() == 1 ? std::vector<at::Tensor>{at::zeros({2}), at::zeros({2})}
                                 : std::vector<at::Tensor>{at::zeros({4})};
  }
  group.exchangeInPlace(parts);
}

// Every rank holds model.layers.0.{self_attn,mlp.experts.0}; the last rank also holds
// mlp.experts.1 (an expert-parallel expert).
void distHelper() {
  auto root = std::make_shared<qpipe::Module>("Model");
  auto layer = std::make_shared<qpipe::Module>("Layer");
  auto mlp = std::make_shared<qpipe::Module>("Mlp");
  auto experts = std::make_shared<qpipe::Module>("Experts");
  experts->addChild("0", std::make_shared<qpipe::Module>("Expert"));
  if (world().rank() == world().worldSize() - 1) experts->addChild("1", std::make_shared<qpipe::Module>("Expert"));
  mlp->addChild("experts", experts);
  layer->addChild("self_attn", std::make_shared<qpipe::Module>("Attention"));
  layer->addChild("mlp", mlp);
  auto layers = std::make_shared<qpipe::Module>("Layers");
  layers->addChild("0", layer);
  auto model = std::make_shared<qpipe::Module>("Body");
  model->addChild("layers", layers);
  root->addChild("model", model);

  const DistHelper helper(world(), *layer, "model.layers.0");
  for (const std::string name : {"model.layers.0", "model.layers.0.self_attn", "model.layers.0.mlp.experts.0",
                                 "model.layers.0.mlp.experts.1", "model.layers.0.mlp.experts.2"}) {
    std::cout << name << ": shared " << helper.isShared(name) << " local " << helper.isLocal(name) << " localOnly "
              << helper.isLocalOnly(name) << "\n";
  }
  std::cout << "slice:";
  for (const std::string& name : helper.sharedModulesSlice("model.layers.0.mlp")) std::cout << " " << name;
  std::cout << "\n";
  std::cout << "done" << std::endl;
}

// The last rank fails in its own code while the others wait in a collective: an all-reduce
// (Gloo), or a small gather (the host channel where the ranks share one).
void peerFails(bool report, bool gather = false) {
  ProcessGroup& group = world();
  if (group.rank() == group.worldSize() - 1) {
    if (!report) ::raise(SIGKILL);
    throw qpipe::Error(qpipe::ErrorCode::kInput, "layer 3: calibration sample 7 is empty");
  }
  if (gather) {
    group.allGatherBytesWithin("x", 8);
    std::cout << "unexpected: gathered" << std::endl;
    return;
  }
  at::Tensor t = at::ones({4});
  group.allReduce(t, ReduceOp::kSum);
  std::cout << "unexpected: " << values(t) << std::endl;
}

// The ranks' collectives do not pair up: the last rank passes another slot (`size`), or calls
// another collective; through shared memory every rank fails, instead of reading bytes that are
// not what it asked for.
void collectivesDiffer(bool size) {
  ProcessGroup& group = world();
  const bool last = group.rank() == group.worldSize() - 1;
  if (last && !size) {
    group.allGather(at::ones({2}));
  } else {
    group.allGatherBytesWithin("x", last ? 64 : 8);
  }
  std::cout << "unexpected: gathered" << std::endl;
}

// The same over Gloo (QPIPE_DIST_SHM=0), where the ranks wait until their timeout: the last rank
// enters a broadcast, half a second late, where the others enter an allReduce.
void backendCollectivesDiffer() {
  ProcessGroup& group = world();
  at::Tensor t = at::ones({4});
  if (group.rank() == group.worldSize() - 1) {
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    group.broadcast(t, 0);
  } else {
    group.allReduce(t, ReduceOp::kSum);
  }
  std::cout << "unexpected: " << values(t) << std::endl;
}

// The last rank closes its group, then lingers: the others, waiting for it in a gather, fail
// without waiting for the timeout.
void peerClosesGroup() {
  ProcessGroup& group = world();
  if (group.rank() == group.worldSize() - 1) {
    joined = ProcessGroup::single();
    std::this_thread::sleep_for(std::chrono::seconds(4));
    return;
  }
  group.allGatherBytesWithin("x", 8);
  std::cout << "unexpected: gathered" << std::endl;
}

// Many small gathers in a row, parts of other sizes on every rank and some past the slot or past
// the host channel's part (the second gather, over Gloo), each byte checked; then concurrent
// claims from one counter (each value handed out once), from one whose key fills a table slot
// (51 bytes and the NUL) and from ones whose key the table cannot hold (the store's): one byte
// longer, much longer, or holding a NUL.
void hostChannel() {
  ProcessGroup& group = world();
  std::cout << "host channel: " << sharesHostMemory(group) << "\n";
  const auto partOf = [](int r, int i) {
    const size_t size = static_cast<size_t>((i * 37 + r * 11) % 700) + (i % 97 == r ? 300000 : 0);
    std::string part(size, '\0');
    for (size_t k = 0; k < size; ++k) part[k] = static_cast<char>((r * 31 + i + k) % 251);
    return part;
  };
  int wrong = 0;
  constexpr int kGathers = 2000;
  for (int i = 0; i < kGathers; ++i) {
    const std::vector<std::string> all = group.allGatherBytesWithin(partOf(group.rank(), i), 512);
    for (int r = 0; r < group.worldSize(); ++r) wrong += all[static_cast<size_t>(r)] == partOf(r, i) ? 0 : 1;
  }
  std::cout << "gathers: " << kGathers << " wrong " << wrong << "\n";
  for (const std::string& key : std::vector<std::string>{"claims", std::string(51, 'm'), std::string(52, 'n'),
                                                         std::string(80, 'k'), std::string("a\0b", 3)}) {
    constexpr int kClaims = 300;
    std::string mine;
    for (int i = 0; i < kClaims; ++i) mine += std::to_string(group.counterAdd(key, 1)) + " ";
    std::vector<int> seen(static_cast<size_t>(kClaims * group.worldSize()) + 1, 0);
    for (const std::string& part : group.allGatherBytes(mine)) {
      std::istringstream in(part);
      for (int64_t value = 0; in >> value;) {
        if (value >= 1 && value < static_cast<int64_t>(seen.size())) ++seen[static_cast<size_t>(value)];
      }
    }
    std::cout << "claims of a " << key.size() << "-byte key: each once "
              << (std::count(seen.begin() + 1, seen.end(), 1) == kClaims * group.worldSize()) << "\n";
  }
  group.barrier();
  std::cout << "done" << std::endl;
}

// The last rank stops answering (stuck, not dead) for `timeouts` times the others' timeout. In the
// gather, rank 0 comes 3/4 of a timeout after the others, so that they give up first and rank 0,
// still waiting, sees one of them go.
void peerHangs(bool gather, int timeouts) {
  ProcessGroup& group = world();
  const int timeout = std::stoi(std::getenv("QPIPE_DIST_TIMEOUT_S"));
  if (group.rank() == group.worldSize() - 1) {
    std::this_thread::sleep_for(std::chrono::seconds(timeouts * timeout));
    return;
  }
  if (gather) {
    if (group.rank() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(750 * timeout));
    group.allGatherBytesWithin("x", 8);
    std::cout << "unexpected: gathered" << std::endl;
    return;
  }
  at::Tensor t = at::ones({4});
  group.allReduce(t, ReduceOp::kSum);
  std::cout << "unexpected: " << values(t) << std::endl;
}

// Rank 0, which hosts the store, fails after the first collective.
void masterFails() {
  ProcessGroup& group = world();
  at::Tensor t = at::ones({4});
  group.allReduce(t, ReduceOp::kSum);
  if (group.rank() == 0) throw qpipe::Error(qpipe::ErrorCode::kIo, "cannot write shard 2: disk full");
  group.allReduce(t, ReduceOp::kSum);
  std::cout << "unexpected: " << values(t) << std::endl;
}

// ---- The task scheduler (qpipe/scheduler/task_scheduler.h, tests/multirank/test_scheduler.cpp)

namespace dts = qpipe::scheduler;

// A module whose own sync (level 2) sends its value and counts the calls.
class SelfSynced final : public qpipe::Module, public qpipe::DistributedSync {
 public:
  SelfSynced() : Module("SelfSynced") { addParameter("value", at::zeros({3})); }
  std::vector<at::Tensor> syncTensors(const qpipe::TaskRecord&, qpipe::SyncContext&) override {
    ++syncs;
    return {parameter("value")};
  }
  void syncDone(const qpipe::TaskRecord&, qpipe::SyncContext&) override { ++done; }
  int syncs = 0;
  int done = 0;
};

// Modules a, b, c, d (and e below d) with a parameter w; c syncs itself.
std::shared_ptr<qpipe::Module> schedulerModel() {
  auto root = std::make_shared<qpipe::Module>("Root");
  for (const char* name : {"a", "b", "d"}) {
    auto module = std::make_shared<qpipe::Module>("Leaf");
    module->addParameter("w", at::zeros({4}));
    root->addChild(name, module);
  }
  root->addChild("c", std::make_shared<SelfSynced>());
  auto e = std::make_shared<qpipe::Module>("Leaf");
  e->addParameter("w", at::zeros({2}));
  root->getSubmodule("d").addChild("e", e);
  return root;
}

void printState(qpipe::Module& root) {
  for (auto& [name, tensor] : root.namedParameters()) {
    std::cout << "state " << name << ": " << c10::toString(tensor->scalar_type()) << " " << shape(*tensor) << " "
              << values(*tensor) << "\n";
  }
  for (auto& [name, tensor] : root.namedBuffers()) {
    std::cout << "state " << name << ": " << c10::toString(tensor->scalar_type()) << " " << shape(*tensor) << " "
              << values(*tensor) << "\n";
  }
}

// Tasks at every sync level, twice over (so the waves repeat), then a local task: the final state
// is the same on every rank and for any assignment (the 1-rank run's).
void schedulerLevels(dts::SchedulerOptions options) {
  ProcessGroup& group = world();
  auto root = schedulerModel();
  dts::DistributedTaskScheduler scheduler(*root, group, options);
  const auto args = [](int64_t k) { return qpipe::ConfigNode::map({{"k", qpipe::ConfigNode::integer(k)}}); };
  for (int64_t round = 0; round < 2; ++round) {
    // Level 3: the executor's values broadcast.
    scheduler.submit({.name = "fill_a",
                      .fn =
                          [&root](const qpipe::ConfigNode& a) {
                            root->getSubmodule("a").parameter("w").add_(a.at("k").asInt() + 1);
                            return qpipe::ConfigNode::integer(a.at("k").asInt() * 10);
                          },
                      .args = args(round),
                      .dependencies = {"a"}});
    // Level 3 on a changed structure: w gets another shape and dtype, a buffer appears.
    scheduler.submit(
        {.name = "reshape_b",
         .fn =
             [&root](const qpipe::ConfigNode& a) {
               qpipe::Module& b = root->getSubmodule("b");
               b.parameter("w") =
                   at::arange(6, at::kDouble).reshape({2, 3}).mul(static_cast<double>(a.at("k").asInt() + 1));
               if (!b.hasParameter("extra") && b.ownBuffers().empty()) b.addBuffer("extra", at::ones({1}, at::kLong));
               // More than the scheduler's first outcome slot (4096 bytes): its overflow travels too.
               const int64_t k = a.at("k").asInt();
               return qpipe::ConfigNode::string(std::string(static_cast<size_t>(6000 + k), static_cast<char>('p' + k)));
             },
         .args = args(round),
         .dependencies = {"b"}});
    // Level 2.
    scheduler.submit({.name = "set_c",
                      .fn =
                          [&root](const qpipe::ConfigNode& a) {
                            root->getSubmodule("c").parameter("value").fill_(
                                static_cast<double>(a.at("k").asInt() + 7));
                            return qpipe::ConfigNode::null({});
                          },
                      .args = args(round),
                      .dependencies = {"c"}});
    // Level 1: d and its child e, synced by the task's own function.
    scheduler.submit({.name = "set_d",
                      .fn =
                          [&root](const qpipe::ConfigNode& a) {
                            root->getSubmodule("d").parameter("w").fill_(static_cast<double>(a.at("k").asInt() - 3));
                            root->getSubmodule("d.e").parameter("w").fill_(5.0);
                            return qpipe::ConfigNode::null({});
                          },
                      .args = args(round),
                      .dependencies = {"d"},
                      .sync =
                          [&root](const qpipe::TaskRecord& record, qpipe::SyncContext& context) {
                            context.group.broadcast(root->getSubmodule("d").parameter("w"), record.executorRank);
                            context.group.broadcast(root->getSubmodule("d.e").parameter("w"), record.executorRank);
                            std::cout << "level 1 sync of " << record.taskId << "\n";
                          },
                      .syncName = "broadcast_d"});
  }
  // Level 1 by tensors: each task computes a tensor that every rank then holds; it joins the last
  // wave (no dependency), and its sync runs after the exchange, with the values there.
  std::vector<at::Tensor> carried(2);
  for (int64_t k = 0; k < 2; ++k) {
    scheduler.submit({.name = "carry",
                      .fn =
                          [&carried](const qpipe::ConfigNode& a) {
                            const int64_t k = a.at("k").asInt();
                            carried[k] = at::arange(k + 2, at::kDouble).mul(static_cast<double>(k + 1));
                            return qpipe::ConfigNode::null({});
                          },
                      .args = args(k),
                      .sync =
                          [&carried, k](const qpipe::TaskRecord& record, qpipe::SyncContext&) {
                            std::cout << "tensor sync of " << record.taskId << ": " << values(carried[k]) << "\n";
                          },
                      .syncTensors =
                          [&carried, k](const qpipe::TaskRecord& record, qpipe::SyncContext& context) {
                            if (record.executorRank != context.group.rank())
                              carried[k] = at::empty({k + 2}, at::kDouble);
                            return std::vector<at::Tensor>{carried[k]};
                          },
                      .syncName = "carry"});
  }
  // A local task: every rank runs it.
  scheduler.submit({.name = "local_a",
                    .fn =
                        [&root](const qpipe::ConfigNode&) {
                          root->getSubmodule("a").parameter("w").mul_(2);
                          return qpipe::ConfigNode::null({});
                        },
                    .dependencies = {"a"},
                    .parallel = false});
  const std::vector<qpipe::TaskRecord> records = scheduler.run();
  for (const qpipe::TaskRecord& record : records) {
    std::cout << "record " << record.taskId << " " << record.name << " parallel " << record.parallel;
    if (options.assignment == dts::Assignment::kRoundRobin || !record.parallel) {
      std::cout << " executor " << record.executorRank;
    }
    if (record.result.kind() == qpipe::ConfigNode::Kind::kString) {
      const std::string& text = record.result.asString();
      std::cout << " result " << text.size() << " chars of "
                << (text.find_first_not_of(text.front()) == std::string::npos ? text.substr(0, 1) : "mixed");
    } else if (!record.result.isNull()) {
      std::cout << " result " << record.result.asInt();
    }
    std::cout << "\n";
  }
  const auto& c = static_cast<SelfSynced&>(root->getSubmodule("c"));
  std::cout << "level 2 syncs: " << c.syncs << " done " << c.done << "\n";
  std::cout << "waves: " << scheduler.summary().waves << " parallel " << scheduler.summary().parallelWaves << "\n";
  std::cout << "executed everywhere: " << scheduler.summary().tasks << "\n";
  printState(*root);
  std::cout << "carried: " << values(carried[0]) << " | " << values(carried[1]) << "\n";
  std::cout << "done" << std::endl;
}

// The last rank submits a task with other arguments.
void schedulerDisagree() {
  ProcessGroup& group = world();
  auto root = schedulerModel();
  dts::DistributedTaskScheduler scheduler(*root, group, {.name = "test"});
  for (const char* name : {"a", "b"}) {
    const int64_t k = std::string(name) == "b" && group.rank() == group.worldSize() - 1 ? 2 : 1;
    scheduler.submit({.name = "noop",
                      .fn = [](const qpipe::ConfigNode&) { return qpipe::ConfigNode::null({}); },
                      .args = qpipe::ConfigNode::map({{"k", qpipe::ConfigNode::integer(k)}}),
                      .dependencies = {name}});
  }
  scheduler.run();
  std::cout << "unexpected: ran" << std::endl;
}

// The ranks agree on wave 0 and differ in wave 2 (after a local wave 1): every rank fails before
// any task ran (a task would print).
void schedulerDisagreeLater() {
  ProcessGroup& group = world();
  auto root = schedulerModel();
  dts::DistributedTaskScheduler scheduler(*root, group, {.name = "test"});
  const auto noisy = [](const qpipe::ConfigNode&) {
    std::cout << "unexpected: a task ran" << std::endl;
    return qpipe::ConfigNode::null({});
  };
  const bool last = group.rank() == group.worldSize() - 1;
  scheduler.submit({.name = "noop", .fn = noisy, .dependencies = {"a"}});
  scheduler.submit({.name = "noop", .fn = noisy, .dependencies = {"a"}, .parallel = false});
  scheduler.submit({.name = last ? "other" : "noop", .fn = noisy, .dependencies = {"b"}});
  scheduler.run();
}

// The last rank submits nothing parallel (its task is local): it still meets the others in the
// agreement, and every rank fails there instead of waiting for it.
void schedulerNothingParallelOnOneRank() {
  ProcessGroup& group = world();
  auto root = schedulerModel();
  dts::DistributedTaskScheduler scheduler(*root, group, {.name = "test"});
  const bool last = group.rank() == group.worldSize() - 1;
  scheduler.submit({.name = "noop",
                    .fn = [](const qpipe::ConfigNode&) { return qpipe::ConfigNode::null({}); },
                    .dependencies = {"a"},
                    .parallel = !last});
  scheduler.run();
  std::cout << "unexpected: ran" << std::endl;
}

// A module whose own sync returns its tensors on the executor only: the other ranks still enter
// the exchange, which names the mismatch on every rank.
class SyncedOnExecutorOnly final : public qpipe::Module, public qpipe::DistributedSync {
 public:
  SyncedOnExecutorOnly() : Module("SyncedOnExecutorOnly") { addParameter("value", at::zeros({3})); }
  std::vector<at::Tensor> syncTensors(const qpipe::TaskRecord& record, qpipe::SyncContext& context) override {
    if (record.executorRank != context.group.rank()) return {};
    return {parameter("value")};
  }
};

void schedulerOwnSyncOnExecutorOnly() {
  ProcessGroup& group = world();
  auto root = std::make_shared<qpipe::Module>("Root");
  root->addChild("c", std::make_shared<SyncedOnExecutorOnly>());
  dts::DistributedTaskScheduler scheduler(*root, group, {.name = "test", .assignment = dts::Assignment::kRoundRobin});
  scheduler.submit({.name = "set_c",
                    .fn = [](const qpipe::ConfigNode&) { return qpipe::ConfigNode::null({}); },
                    .dependencies = {"c"}});
  scheduler.run();
  std::cout << "unexpected: ran" << std::endl;
}

// Results JSON cannot hold (NaN, infinities, also inside a list and a map) reach every rank as the
// executor has them.
void schedulerSpecialResults() {
  ProcessGroup& group = world();
  auto root = schedulerModel();
  dts::DistributedTaskScheduler scheduler(*root, group, {.name = "test", .assignment = dts::Assignment::kRoundRobin});
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  const std::vector<qpipe::ConfigNode> results{
      qpipe::ConfigNode::number(nan), qpipe::ConfigNode::number(inf), qpipe::ConfigNode::number(-inf),
      qpipe::ConfigNode::map(
          {{"loss", qpipe::ConfigNode::number(nan)},
           {"grid", qpipe::ConfigNode::list({qpipe::ConfigNode::number(0.25), qpipe::ConfigNode::number(-inf)})}})};
  for (size_t i = 0; i < results.size(); ++i) {
    scheduler.submit({.name = "special",
                      .fn = [result = results[i]](const qpipe::ConfigNode&) { return result; },
                      .dependencies = {std::string(1, static_cast<char>('a' + i))}});
  }
  for (const qpipe::TaskRecord& record : scheduler.run()) {
    std::cout << "result " << record.taskId << " executor " << record.executorRank << ": " << record.result.toYaml()
              << "\n";
  }
  std::cout << "done" << std::endl;
}

// A task's result holds bytes that are not UTF-8: its executor fails it, naming it.
void schedulerResultNotUtf8() {
  ProcessGroup& group = world();
  auto root = schedulerModel();
  dts::DistributedTaskScheduler scheduler(*root, group, {.name = "test", .assignment = dts::Assignment::kRoundRobin});
  scheduler.submit({.name = "latin1",
                    .fn = [](const qpipe::ConfigNode&) { return qpipe::ConfigNode::string("caf\xe9"); },
                    .dependencies = {"a"}});
  scheduler.run();
  std::cout << "unexpected: ran" << std::endl;
}

// A parallel task calls a collective.
void schedulerCollective() {
  ProcessGroup& group = world();
  auto root = schedulerModel();
  dts::DistributedTaskScheduler scheduler(*root, group, {.name = "test", .assignment = dts::Assignment::kRoundRobin});
  scheduler.submit({.name = "reduce",
                    .fn =
                        [&group](const qpipe::ConfigNode&) {
                          at::Tensor t = at::ones({1});
                          group.allReduce(t, ReduceOp::kSum);
                          return qpipe::ConfigNode::null({});
                        },
                    .dependencies = {"a"}});
  scheduler.run();
  std::cout << "unexpected: ran" << std::endl;
}

// Task 2 of 4 throws on the rank that runs it (rank 2 mod W, round-robin).
void schedulerTaskFails() {
  ProcessGroup& group = world();
  auto root = schedulerModel();
  dts::DistributedTaskScheduler scheduler(*root, group, {.name = "test", .assignment = dts::Assignment::kRoundRobin});
  for (const char* name : {"a", "b", "c", "d"}) {
    scheduler.submit({.name = "maybe_fail",
                      .fn =
                          [name](const qpipe::ConfigNode&) {
                            QPIPE_REQUIRE(std::string(name) != "c", qpipe::ErrorCode::kInput, "module ", name,
                                          ": weights are NaN");
                            return qpipe::ConfigNode::null({});
                          },
                      .args = qpipe::ConfigNode::map({{"module", qpipe::ConfigNode::string(name)}}),
                      .dependencies = {name}});
  }
  scheduler.run();
  std::cout << "unexpected: ran" << std::endl;
}

// Round-robin over four tasks whose costs are 1, 4, 0, 4 (the last rank gives the third 2 when
// `disagree`): handed out as t1, t3, t0, t2, the i-th of them to rank i mod W.
void schedulerCosts(bool disagree) {
  ProcessGroup& group = world();
  auto root = schedulerModel();
  dts::DistributedTaskScheduler scheduler(*root, group, {.name = "test", .assignment = dts::Assignment::kRoundRobin});
  const bool last = group.rank() == group.worldSize() - 1;
  const std::vector<double> costs = {1, 4, disagree && last ? 2.0 : 0.0, 4};
  for (size_t i = 0; i < costs.size(); ++i) {
    scheduler.submit({.name = "noop",
                      .fn = [](const qpipe::ConfigNode&) { return qpipe::ConfigNode::null({}); },
                      .args = qpipe::ConfigNode::map({{"k", qpipe::ConfigNode::integer(static_cast<int64_t>(i))}}),
                      .cost = costs[i]});
  }
  for (const qpipe::TaskRecord& record : scheduler.run()) {
    std::cout << "record " << record.taskId << " executor " << record.executorRank << " cost " << record.cost << "\n";
  }
  std::cout << "done" << std::endl;
}

// Split layers' mechanics: four parallel tasks, each running a scheduler of its own (whose waves
// are then local: no collective, every task here) and passing a running sum to the next task
// through the store, as the runner's probe chain does.
void schedulerNestedAndChained() {
  ProcessGroup& group = world();
  auto root = schedulerModel();
  dts::DistributedTaskScheduler scheduler(*root, group, {.name = "outer"});
  if (group.rank() == 0) group.storeSet("chain/0", "0");
  const std::vector<std::string> names = {"a", "b", "c", "d"};
  for (size_t i = 0; i < names.size(); ++i) {
    scheduler.submit({.name = "outer_task",
                      .fn =
                          [&, i](const qpipe::ConfigNode&) {
                            dts::DistributedTaskScheduler inner(*root, group, {.name = "inner"});
                            for (const char* d : {"a", "b"}) {
                              inner.submit({.name = "inner_task",
                                            .fn = [](const qpipe::ConfigNode&) { return qpipe::ConfigNode::null({}); },
                                            .dependencies = {d}});
                            }
                            int64_t parallel = 0;
                            for (const qpipe::TaskRecord& record : inner.run()) parallel += record.parallel ? 1 : 0;
                            const int64_t sum = std::stoll(group.storeGet("chain/" + std::to_string(i)));
                            group.storeSet("chain/" + std::to_string(i + 1), std::to_string(sum + 10 * (i + 1)));
                            return qpipe::ConfigNode::integer(parallel);
                          },
                      .args = qpipe::ConfigNode::map({{"i", qpipe::ConfigNode::integer(static_cast<int64_t>(i))}}),
                      .dependencies = {names[i]},
                      .sync = [](const qpipe::TaskRecord&, qpipe::SyncContext&) {},
                      .syncName = "none"});
  }
  int64_t nestedParallel = 0;
  for (const qpipe::TaskRecord& record : scheduler.run()) nestedParallel += record.result.asInt();
  std::cout << "outer parallel waves: " << scheduler.summary().parallelWaves << "\n";
  std::cout << "inner parallel tasks: " << nestedParallel << "\n";
  std::cout << "chain: " << group.storeGet("chain/4") << "\n";
  std::cout << "done" << std::endl;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string scenario = argc > 1 ? argv[1] : "";
  try {
    const auto options = optionsFromEnvironment();
    QPIPE_REQUIRE(options, qpipe::ErrorCode::kUsage, "RANK and WORLD_SIZE are not set");
    joined = connect(*options);
    std::cout << "connected: rank " << world().rank() << " of " << world().worldSize() << std::endl;
    if (scenario == "connect") {
      world().barrier();
    } else if (scenario == "collectives") {
      collectives();
    } else if (scenario == "exchange") {
      exchange();
    } else if (scenario == "exchange_mismatch") {
      exchangeMismatch(false);
    } else if (scenario == "exchange_layout_mismatch") {
      exchangeMismatch(true);
    } else if (scenario == "dist_helper") {
      distHelper();
    } else if (scenario == "peer_reports") {
      peerFails(true);
    } else if (scenario == "peer_killed") {
      peerFails(false);
    } else if (scenario == "peer_reports_in_gather") {
      peerFails(true, true);
    } else if (scenario == "peer_killed_in_gather") {
      peerFails(false, true);
    } else if (scenario == "gather_sizes_differ") {
      collectivesDiffer(true);
    } else if (scenario == "collectives_differ") {
      collectivesDiffer(false);
    } else if (scenario == "backend_collectives_differ") {
      backendCollectivesDiffer();
    } else if (scenario == "peer_closes_group") {
      peerClosesGroup();
    } else if (scenario == "host_channel") {
      hostChannel();
    } else if (scenario == "peer_hangs") {
      peerHangs(false, 10);
    } else if (scenario == "peer_hangs_in_gather") {
      peerHangs(true, 3);
    } else if (scenario == "master_fails") {
      masterFails();
    } else if (scenario == "dts_dynamic") {
      schedulerLevels({.name = "test"});
    } else if (scenario == "dts_round_robin") {
      schedulerLevels({.name = "test", .assignment = dts::Assignment::kRoundRobin});
    } else if (scenario == "dts_disabled") {
      schedulerLevels({.name = "test", .disableParallel = true});
    } else if (scenario == "dts_disagree") {
      schedulerDisagree();
    } else if (scenario == "dts_disagree_later") {
      schedulerDisagreeLater();
    } else if (scenario == "dts_collective") {
      schedulerCollective();
    } else if (scenario == "dts_nothing_parallel_on_one_rank") {
      schedulerNothingParallelOnOneRank();
    } else if (scenario == "dts_own_sync_on_executor_only") {
      schedulerOwnSyncOnExecutorOnly();
    } else if (scenario == "dts_special_results") {
      schedulerSpecialResults();
    } else if (scenario == "dts_result_not_utf8") {
      schedulerResultNotUtf8();
    } else if (scenario == "dts_task_fails") {
      schedulerTaskFails();
    } else if (scenario == "dts_costs") {
      schedulerCosts(false);
    } else if (scenario == "dts_costs_disagree") {
      schedulerCosts(true);
    } else if (scenario == "dts_nested_chain") {
      schedulerNestedAndChained();
    } else {
      throw qpipe::Error(qpipe::ErrorCode::kUsage, "unknown scenario '" + scenario + "'");
    }
    return 0;
  } catch (const qpipe::Error& e) {
    std::cout << "error: " << e.what() << std::endl;
    world().reportFailure(e.what());
    return static_cast<int>(e.code());
  }
}
