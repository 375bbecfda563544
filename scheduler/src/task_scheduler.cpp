#include "qpipe/scheduler/task_scheduler.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstring>
#include <iomanip>
#include <limits>
#include <map>
#include <numeric>
#include <sstream>
#include <string_view>
#include <utility>

#include "qpipe/error.h"
#include "qpipe/hash.h"
#include "qpipe/module.h"

namespace qpipe::scheduler {

namespace {

using Clock = std::chrono::steady_clock;
using Json = nlohmann::json;

// A task's id is "w<wave>" kIndexMark "<submit index>" (TaskRecord::taskId).
constexpr std::string_view kIndexMark = "_t";

std::atomic<bool> globalDisabled{false};
// Parallel waves this process has run: every rank runs the same parallel waves in the same order
// (the agreement checks it), so the count names a wave's counter in the store uniquely.
std::atomic<int64_t> parallelWavesRun{0};
// The bytes a rank's part of a gather may take for it to be one collective
// (ProcessGroup::allGatherBytesWithin), guessed from the last such gather, whose parts every rank
// saw alike, so every rank passes the same slot: the outcomes of a parallel wave, and the synced
// tensors beyond those the outcomes announce (the default sync's and the tasks' own are announced;
// a DistributedSync's sizes each rank knows only from its own module).
constexpr int64_t kMinOutcomeSlot = 1024;
std::atomic<int64_t> outcomeSlot{4096};
std::atomic<int64_t> ownTensorsSlot{0};

// The next slot after a gather whose largest part was `largest`: half as much again, in 256 bytes.
int64_t slotAfter(int64_t largest) {
  return (largest + largest / 2 + 255) / 256 * 256;
}

double since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// A task's result travels as JSON (doubles exact to the bit; JSON has no NaN or infinity, which
// travel as {"float": "nan" | "inf" | "-inf"}).
Json toJson(const ConfigNode& node) {
  switch (node.kind()) {
    case ConfigNode::Kind::kNull:
      return nullptr;
    case ConfigNode::Kind::kBool:
      return node.asBool();
    case ConfigNode::Kind::kInt:
      return node.asInt();
    case ConfigNode::Kind::kFloat: {
      const double value = node.asFloat();
      if (std::isfinite(value)) return value;
      return {{"float", std::isnan(value) ? "nan" : (value > 0 ? "inf" : "-inf")}};
    }
    case ConfigNode::Kind::kString:
      return node.asString();
    case ConfigNode::Kind::kList: {
      Json out = Json::array();
      for (const ConfigNode& item : node.items()) out.push_back(toJson(item));
      return out;
    }
    case ConfigNode::Kind::kMap: {
      // Entries as pairs: a map's order is part of its value.
      Json out = {{"map", Json::array()}};
      for (const auto& [key, value] : node.entries()) out["map"].push_back({key, toJson(value)});
      return out;
    }
  }
  return nullptr;
}

ConfigNode fromJson(const Json& json) {
  if (json.is_null()) return ConfigNode();
  if (json.is_boolean()) return ConfigNode::boolean(json.get<bool>());
  if (json.is_number_integer()) return ConfigNode::integer(json.get<int64_t>());
  if (json.is_number()) return ConfigNode::number(json.get<double>());
  if (json.is_string()) return ConfigNode::string(json.get<std::string>());
  if (json.is_array()) {
    std::vector<ConfigNode> items;
    for (const Json& item : json) items.push_back(fromJson(item));
    return ConfigNode::list(std::move(items));
  }
  if (json.contains("float")) {
    const std::string special = json["float"].get<std::string>();
    if (special == "nan") return ConfigNode::number(std::numeric_limits<double>::quiet_NaN());
    return ConfigNode::number(special == "inf" ? std::numeric_limits<double>::infinity()
                                               : -std::numeric_limits<double>::infinity());
  }
  std::vector<ConfigNode::Entry> entries;
  for (const Json& entry : json["map"]) entries.emplace_back(entry[0].get<std::string>(), fromJson(entry[1]));
  return ConfigNode::map(std::move(entries));
}

// A value in YAML's flow style, on one line: {k: 1, list: [a, b]}.
std::string flow(const ConfigNode& node) {
  std::string out;
  if (node.isMap()) {
    for (const auto& [key, value] : node.entries()) out += (out.empty() ? "" : ", ") + key + ": " + flow(value);
    return "{" + out + "}";
  }
  if (node.isList()) {
    for (const ConfigNode& item : node.items()) out += (out.empty() ? "" : ", ") + flow(item);
    return "[" + out + "]";
  }
  out = node.toYaml();
  while (!out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

// What the ranks compare: everything that decides what a task does, in one line.
std::string describe(const Task& task) {
  std::string dependencies;
  for (const std::string& d : task.dependencies) dependencies += (dependencies.empty() ? "" : ",") + d;
  return task.name + " " + flow(task.args) + " on [" + dependencies + "]" +
         (task.sync || task.syncTensors ? " sync " + task.syncName : "") +
         (task.cost != 0 ? " cost " + flow(ConfigNode::number(task.cost)) : "");
}

// `node`'s kind and value folded into `hash`: what describe() says, without formatting it (a
// search submits thousands of tasks per wave).
uint64_t hashNode(const ConfigNode& node, uint64_t hash) {
  const auto kind = static_cast<unsigned char>(node.kind());
  hash = fnv1aBytes(&kind, 1, hash);
  switch (node.kind()) {
    case ConfigNode::Kind::kNull:
      return hash;
    case ConfigNode::Kind::kBool: {
      const unsigned char value = node.asBool() ? 1 : 0;
      return fnv1aBytes(&value, 1, hash);
    }
    case ConfigNode::Kind::kInt: {
      const int64_t value = node.asInt();
      return fnv1aBytes(&value, sizeof value, hash);
    }
    case ConfigNode::Kind::kFloat: {
      const double value = node.asFloat();
      return fnv1aBytes(&value, sizeof value, hash);
    }
    case ConfigNode::Kind::kString:
      return fnv1a(node.asString() + '\0', hash);
    case ConfigNode::Kind::kList:
      for (const ConfigNode& item : node.items()) hash = hashNode(item, hash);
      return fnv1a("]", hash);
    case ConfigNode::Kind::kMap:
      for (const auto& [key, value] : node.entries()) hash = hashNode(value, fnv1a(key + '\0', hash));
      return fnv1a("}", hash);
  }
  return hash;
}

// What the ranks compare, as describe() spells it: name, arguments, dependencies, sync name, cost.
uint64_t hashTask(const Task& task, uint64_t hash) {
  hash = hashNode(task.args, fnv1a(task.name + '\0', hash));
  for (const std::string& d : task.dependencies) hash = fnv1a(d + '\0', hash);
  hash = fnv1aBytes(&task.cost, sizeof task.cost, hash);
  return fnv1a(task.sync || task.syncTensors ? "sync " + task.syncName : "-", hash);
}

struct Wave {
  bool parallel = false;
  std::vector<size_t> tasks;  // indices into the submitted tasks
  std::vector<std::string> paths;
};

// One task as its executor saw it, exchanged after a parallel wave.
struct Outcome {
  int executor = -1;
  double seconds = 0;
  std::string error;
  int code = static_cast<int>(ErrorCode::kPlugin);
  // The default sync's tensors, as the executor holds them after the task:
  // [module path, "p"|"b", name, dtype, shape] each.
  Json tensors = Json::array();
  // A task with syncTensors: the bytes of its executor's tensors, and on the executor the tensors.
  int64_t madeBytes = 0;
  std::vector<at::Tensor> made;
};

// The modules below a task's dependencies, each with its own sync or the default one.
std::vector<std::pair<std::string, Module*>> modulesOf(Module& root, const Task& task) {
  std::vector<std::pair<std::string, Module*>> out;
  for (const std::string& dependency : task.dependencies) {
    for (auto& entry : root.getSubmodule(dependency).namedModules(dependency)) out.push_back(entry);
  }
  return out;
}

// Where a rank keeps a tensor the executor's task added to `module`: beside the module's other
// tensors (each rank's own device), on the CPU for a module that holds none.
at::Device deviceForNew(Module& module) {
  for (const auto* list : {&module.ownParameters(), &module.ownBuffers()}) {
    for (const auto& [name, tensor] : *list) {
      if (tensor.defined()) return tensor.device();
    }
  }
  return at::Device(at::kCPU);
}

// This module's own parameter or buffer `name` as the executor holds it; on the other ranks a new
// tensor of the executor's dtype and shape, for the exchange to fill (never the one held before,
// whose storage may be shared, e.g. with the checkpoint's mapping).
at::Tensor slotFor(Module& module, bool parameter, const std::string& name, at::ScalarType dtype,
                   const std::vector<int64_t>& shape, bool executor) {
  auto& list = parameter ? module.ownParameters() : module.ownBuffers();
  auto found = std::find_if(list.begin(), list.end(), [&](const auto& entry) { return entry.first == name; });
  if (executor) {
    QPIPE_CHECK(found != list.end(), "the executor lost ", name, " between its task and the sync");
    return found->second;
  }
  const at::Device device = found != list.end() ? found->second.device() : deviceForNew(module);
  const at::Tensor fresh = at::empty(shape, at::TensorOptions().dtype(dtype).device(device));
  if (found == list.end()) return parameter ? module.addParameter(name, fresh) : module.addBuffer(name, fresh);
  found->second = fresh;
  return fresh;
}

// Every executor's tensors to every rank in one exchange: fromRank[r] holds, on every rank, the
// tensors rank r executed (the same dtypes and shapes everywhere; on r itself the values to send,
// elsewhere the slots to fill). In place where the group can (ProcessGroup::exchangeInPlace: a
// gather of sizes, then the tensors point to point); else in one all-gather of their bytes
// packed, so backends without a dtype (fp8) are no obstacle: `slot` is a size every rank computed
// alike, a part within it costs one collective, a larger one a second for the rest, so that a
// rank whose view of a part differs (a DistributedSync returning other shapes on another rank)
// ends in the error below, not in mismatched collectives. One broadcast per executor cost W
// collectives a wave instead: 66 a wave at 64 ranks, most of a wave's time in the projection
// (docs/benchmarks.md). Returns the collectives it took.
int exchangeTogether(ProcessGroup& group, const std::vector<std::vector<at::Tensor>>& fromRank, int64_t slot) {
  const auto bytesOf = [](const std::vector<at::Tensor>& tensors) {
    int64_t total = 0;
    for (const at::Tensor& t : tensors) total += static_cast<int64_t>(t.nbytes());
    return total;
  };
  if (group.exchangeInPlace(fromRank)) return 2;
  const auto me = static_cast<size_t>(group.rank());
  std::string flat(static_cast<size_t>(bytesOf(fromRank[me])), '\0');
  size_t offset = 0;
  for (const at::Tensor& t : fromRank[me]) {
    const at::Tensor bytes = t.contiguous().cpu();
    std::memcpy(flat.data() + offset, bytes.const_data_ptr(), bytes.nbytes());
    offset += bytes.nbytes();
  }
  const std::vector<std::string> parts = group.allGatherBytesWithin(flat, slot);
  for (size_t r = 0; r < fromRank.size(); ++r) {
    if (r == me) continue;
    QPIPE_CHECK(static_cast<int64_t>(parts[r].size()) == bytesOf(fromRank[r]), "rank ", r, " sent ", parts[r].size(),
                " bytes of synced tensors, this rank expected ", bytesOf(fromRank[r]));
    offset = 0;
    for (const at::Tensor& t : fromRank[r]) {
      const size_t n = t.nbytes();
      if (n > 0 && t.is_cpu() && t.is_contiguous()) {
        std::memcpy(t.data_ptr(), parts[r].data() + offset, n);
      } else if (n > 0) {
        at::Tensor received = at::empty(t.sizes(), t.options().device(at::kCPU));
        std::memcpy(received.data_ptr(), parts[r].data() + offset, n);
        const_cast<at::Tensor&>(t).copy_(received);
      }
      offset += n;
    }
  }
  size_t largest = 0;
  for (const std::string& part : parts) largest = std::max(largest, part.size());
  return static_cast<int64_t>(largest) > slot ? 2 : 1;
}

}  // namespace

RunSummary& RunSummary::operator+=(const RunSummary& other) {
  name = other.name;
  tasks += other.tasks;
  myTasks += other.myTasks;
  waves += other.waves;
  parallelWaves += other.parallelWaves;
  worldSize = other.worldSize;
  rank = other.rank;
  execSeconds += other.execSeconds;
  myExecSeconds += other.myExecSeconds;
  syncSeconds += other.syncSeconds;
  agreeSeconds += other.agreeSeconds;
  settledCollectiveSeconds += other.settledCollectiveSeconds;
  settledCollectives += other.settledCollectives;
  wallSeconds += other.wallSeconds;
  return *this;
}

std::string RunSummary::line() const {
  std::ostringstream out;
  out << std::fixed << std::setprecision(3) << "tasks=" << tasks << " waves=" << waves
      << " parallel_waves=" << parallelWaves << " world_size=" << worldSize << " rank=" << rank
      << " my_tasks=" << myTasks << " exec_s=" << execSeconds << " my_exec_s=" << myExecSeconds
      << " sync_s=" << syncSeconds << " wall_s=" << wallSeconds << std::setprecision(2) << " speedup=" << speedup();
  return out.str();
}

std::vector<std::pair<std::string, double>> RunSummary::reportValues() const {
  const std::string key = "dts:" + name + ":";
  return {{key + "tasks", static_cast<double>(tasks)},
          {key + "parallel_waves", static_cast<double>(parallelWaves)},
          {key + "exec_seconds", execSeconds},
          {key + "sync_seconds", syncSeconds},
          {key + "agree_seconds", agreeSeconds},
          {key + "settled_collective_seconds", settledCollectiveSeconds},
          {key + "settled_collectives", static_cast<double>(settledCollectives)},
          {key + "wall_seconds", wallSeconds}};
}

struct DistributedTaskScheduler::Impl {
  Module& root;
  ProcessGroup& group;
  SchedulerOptions options;
  std::vector<Task> tasks;
  std::vector<Wave> waves;
  RunSummary summary;

  std::string where() const { return "scheduler '" + options.name + "'"; }

  // Inside another scheduler's parallel task the ranks run different tasks: nothing pairs up.
  bool parallelAllowed() const {
    return group.worldSize() > 1 && !options.disableParallel && !globalDisabled && !ParallelTaskScope::active();
  }

  std::string taskId(size_t wave, size_t index) const {
    return "w" + std::to_string(wave) + std::string(kIndexMark) + std::to_string(index);
  }

  void runLocal(const Wave& wave, size_t w, std::vector<TaskRecord>& records) {
    for (size_t index : wave.tasks) {
      TaskRecord& record = records[index];
      record.taskId = taskId(w, index);
      record.wave = static_cast<int64_t>(w);
      record.executorRank = group.rank();
      const auto start = Clock::now();
      record.result = tasks[index].fn(tasks[index].args);
      record.execSeconds = since(start);
      summary.execSeconds += record.execSeconds;
      summary.myExecSeconds += record.execSeconds;
      ++summary.myTasks;
    }
  }

  // Before the waves, once per run() for all its parallel waves: the same tasks on every rank,
  // else the same error on every rank, before any task runs.
  void agree() {
    uint64_t hash = kFnv1aBasis;
    for (const Wave& wave : waves) {
      if (!wave.parallel) continue;  // local waves may differ between ranks
      hash = fnv1a(std::to_string(wave.tasks.size()), hash);
      for (size_t index : wave.tasks) hash = hashTask(tasks[index], hash);
    }
    // One gather of every rank's hash decides, alike on every rank.
    const std::string mine(reinterpret_cast<const char*>(&hash), sizeof(hash));
    const std::vector<std::string> hashes = group.allGatherBytesWithin(mine, sizeof(hash));
    if (std::all_of(hashes.begin(), hashes.end(), [&](const std::string& h) { return h == hashes[0]; })) return;
    // Each parallel wave as a line "wave <index>" and its tasks' lines, on every rank.
    std::string joined;
    for (size_t w = 0; w < waves.size(); ++w) {
      if (!waves[w].parallel) continue;
      joined += "wave " + std::to_string(w) + "\n";
      for (size_t index : waves[w].tasks) {
        // One line a task, whatever its name or arguments hold.
        std::string line = describe(tasks[index]);
        for (size_t at = line.find('\n'); at != std::string::npos; at = line.find('\n', at + 2)) {
          line.replace(at, 1, "\\n");
        }
        joined += " " + line + "\n";
      }
    }
    struct Listed {
      std::string wave;
      std::vector<std::string> tasks;
    };
    std::vector<std::vector<Listed>> all;
    for (const std::string& text : group.allGatherBytes(joined)) {
      std::vector<Listed> listed;
      std::istringstream in(text);
      for (std::string line; std::getline(in, line);) {
        if (line.starts_with(' ')) {
          listed.back().tasks.push_back(line.substr(1));
        } else {
          listed.push_back({line.substr(5), {}});
        }
      }
      all.push_back(std::move(listed));
    }
    for (size_t r = 1; r < all.size(); ++r) {
      for (size_t p = 0; p < std::max(all[0].size(), all[r].size()); ++p) {
        static const Listed kNone;
        const Listed& first = p < all[0].size() ? all[0][p] : kNone;
        const Listed& other = p < all[r].size() ? all[r][p] : kNone;
        for (size_t i = 0; i < std::max(first.tasks.size(), other.tasks.size()); ++i) {
          const auto at = [i](const Listed& listed) {
            return i < listed.tasks.size() ? "'" + listed.tasks[i] + "'" : std::string("none");
          };
          if (i < first.tasks.size() && i < other.tasks.size() && first.tasks[i] == other.tasks[i]) continue;
          throw Error(
              ErrorCode::kDistributed,
              concat(where(), ": the ranks disagree on parallel wave ", first.wave.empty() ? other.wave : first.wave,
                     " (rank 0 has ", first.tasks.size(), " tasks, rank ", r, " has ", other.tasks.size(), "): task ",
                     i, " is ", at(first), " on rank 0 and ", at(other), " on rank ", r,
                     "; every rank must submit the same parallel tasks"));
        }
      }
    }
    // The hash sees every bit of a number, the description only its printed digits.
    throw Error(ErrorCode::kDistributed, concat(where(),
                                                ": the ranks disagree on the parallel waves: a task's "
                                                "numeric arguments differ below their printed precision"));
  }

  // Step 1 of a parallel wave: this rank's tasks, then every rank's outcomes.
  std::vector<Outcome> execute(const Wave& wave, size_t w, std::vector<TaskRecord>& records) {
    const int64_t n = static_cast<int64_t>(wave.tasks.size());
    const std::string counter = "dts/" + std::to_string(parallelWavesRun++);
    // The wave's positions in the order they are handed out: most costly first, stable.
    std::vector<size_t> order(wave.tasks.size());
    std::iota(order.begin(), order.end(), size_t{0});
    std::stable_sort(order.begin(), order.end(),
                     [&](size_t a, size_t b) { return tasks[wave.tasks[a]].cost > tasks[wave.tasks[b]].cost; });
    std::vector<double> costs;
    for (size_t i : order) costs.push_back(tasks[wave.tasks[i]].cost);
    const std::vector<double> weights = claimWeights(costs);
    int64_t next = group.rank();
    // Dynamic: consecutive tasks in claims of claimSize.
    int64_t claimed = 0, claimEnd = 0, seen = 0;
    const auto take = [&]() -> int64_t {
      if (options.assignment == Assignment::kRoundRobin) {
        const int64_t mine = next;
        next += group.worldSize();
        return mine;
      }
      if (claimed < claimEnd) return claimed++;
      const int64_t chunk = claimSize(std::span(weights).subspan(static_cast<size_t>(std::min(seen, n))),
                                      group.worldSize(), options.claimLimit);
      seen = group.counterAdd(counter, chunk);
      claimed = seen - chunk;
      claimEnd = std::min(seen, n);
      return claimed < claimEnd ? claimed++ : n;
    };
    Json mine = Json::array();
    std::map<size_t, std::vector<at::Tensor>> made;  // by wave position: this rank's syncTensors
    SyncContext context{root, group};
    for (int64_t claim = take(); claim < n; claim = take()) {
      const size_t i = order[static_cast<size_t>(claim)];
      const size_t index = wave.tasks[i];
      const std::string id = taskId(w, index);
      Json outcome = {{"i", i}};
      const auto start = Clock::now();
      try {
        const ParallelTaskScope scope(tasks[index].name + " " + flow(tasks[index].args));
        records[index].result = tasks[index].fn(tasks[index].args);
        if (!records[index].result.isNull()) {
          try {
            outcome["r"] = toJson(records[index].result);
            outcome["r"].dump();
          } catch (const Json::type_error&) {
            throw Error(ErrorCode::kPlugin, "its result holds a string that is not UTF-8 (results travel as JSON)");
          }
        }
        if (tasks[index].syncTensors) {
          // Taken now, so that every rank knows their size from the outcomes.
          TaskRecord executed = records[index];
          executed.taskId = id;
          executed.wave = static_cast<int64_t>(w);
          executed.executorRank = group.rank();
          std::vector<at::Tensor>& tensors = made[i];
          tensors = tasks[index].syncTensors(executed, context);
          int64_t bytes = 0;
          for (const at::Tensor& t : tensors) bytes += static_cast<int64_t>(t.nbytes());
          outcome["b"] = bytes;
        }
      } catch (const Error& e) {
        outcome["e"] = firstLine(e.what());
        outcome["c"] = static_cast<int>(e.code());
      } catch (const std::exception& e) {
        outcome["e"] = firstLine(e.what());
        outcome["c"] = static_cast<int>(ErrorCode::kInternal);
      }
      outcome["s"] = since(start);
      const bool failed = outcome.contains("e");
      if (!failed && !tasks[index].sync && !tasks[index].syncTensors) outcome["t"] = defaultTensors(tasks[index]);
      if (failed) outcome.erase("r");
      mine.push_back(std::move(outcome));
      // The others go on with the tasks left; the run fails once every rank has reported.
      if (failed) break;
    }
    std::vector<Outcome> outcomes(static_cast<size_t>(n));
    // An error message may quote bytes that are not UTF-8 (a path): replaced, not thrown on.
    const std::vector<std::string> all =
        group.allGatherBytesWithin(mine.dump(-1, ' ', false, Json::error_handler_t::replace), outcomeSlot);
    // The next wave's slot from this one's largest outcomes, which every rank saw alike.
    size_t largest = 0;
    for (const std::string& bytes : all) largest = std::max(largest, bytes.size());
    outcomeSlot = std::max(kMinOutcomeSlot, slotAfter(static_cast<int64_t>(largest)));
    for (size_t r = 0; r < all.size(); ++r) {
      for (const Json& o : Json::parse(all[r])) {
        Outcome& out = outcomes[o["i"].get<size_t>()];
        out.executor = static_cast<int>(r);
        out.seconds = o["s"].get<double>();
        if (o.contains("e")) {
          out.error = o["e"].get<std::string>();
          out.code = o["c"].get<int>();
        }
        if (o.contains("t")) out.tensors = o["t"];
        if (o.contains("b")) out.madeBytes = o["b"].get<int64_t>();
        if (o.contains("r") && static_cast<int>(r) != group.rank()) {
          records[wave.tasks[o["i"].get<size_t>()]].result = fromJson(o["r"]);
        }
      }
    }
    for (auto& [i, tensors] : made) outcomes[i].made = std::move(tensors);
    for (size_t i = 0; i < outcomes.size(); ++i) {
      const Outcome& o = outcomes[i];
      if (o.error.empty()) continue;
      const size_t index = wave.tasks[i];
      const std::string task = concat("task ", tasks[index].name, " ", flow(tasks[index].args));
      // An error that already starts with the task (ParallelTaskScope's) gets the rank after it.
      const std::string message = o.error.starts_with(task + " ")
                                      ? concat(task, " on rank ", o.executor, o.error.substr(task.size()))
                                      : concat(task, " failed on rank ", o.executor, ": ", o.error);
      throw Error(static_cast<ErrorCode>(o.code), concat(where(), ": ", message));
    }
    return outcomes;
  }

  // The executor's view of the default sync's tensors of `task`: every module below its
  // dependencies that has no sync of its own.
  Json defaultTensors(const Task& task) {
    Json out = Json::array();
    for (auto& [path, module] : modulesOf(root, task)) {
      if (dynamic_cast<DistributedSync*>(module) != nullptr) continue;
      for (const auto& [kind, list] : {std::pair{"p", &module->ownParameters()}, {"b", &module->ownBuffers()}}) {
        for (const auto& [name, tensor] : *list) {
          out.push_back({path, kind, name, static_cast<int>(tensor.scalar_type()), tensor.sizes().vec()});
        }
      }
    }
    return out;
  }

  // Step 2, on every rank in submit order: a task's own sync; else each module's own tensors
  // (level 2) or its parameters and buffers (level 3), all executors' in one exchange.
  void sync(const Wave& wave, const std::vector<Outcome>& outcomes, size_t w, std::vector<TaskRecord>& records) {
    SyncContext context{root, group};
    std::vector<std::vector<at::Tensor>> fromRank(static_cast<size_t>(group.worldSize()));
    // Each executor's bytes that its outcomes announced (level 3, and the tasks' own tensors): the
    // same on every rank, unlike the level-2 tensors, which each rank's own DistributedSync
    // returns. `sending`: all of them.
    std::vector<int64_t> agreed(static_cast<size_t>(group.worldSize()));
    std::vector<int64_t> sending(agreed.size());
    std::vector<std::pair<DistributedSync*, TaskRecord*>> own;
    std::vector<size_t> afterExchange;  // tasks with syncTensors whose sync runs after the exchange
    std::vector<TaskRecord*> batched;
    for (size_t i = 0; i < wave.tasks.size(); ++i) {
      const size_t index = wave.tasks[i];
      TaskRecord& record = records[index];
      record.taskId = taskId(w, index);
      record.wave = static_cast<int64_t>(w);
      record.executorRank = outcomes[i].executor;
      record.execSeconds = outcomes[i].seconds;
      summary.execSeconds += record.execSeconds;
      if (record.executorRank == group.rank()) {
        summary.myExecSeconds += record.execSeconds;
        ++summary.myTasks;
      }
      const Task& task = tasks[index];
      if (task.sync && !task.syncTensors) {
        const auto start = Clock::now();
        task.sync(record, context);
        record.syncSeconds = since(start);
        continue;
      }
      std::vector<at::Tensor>& sent = fromRank[static_cast<size_t>(record.executorRank)];
      const size_t before = sent.size();
      const bool executor = record.executorRank == group.rank();
      if (task.syncTensors) {
        const std::vector<at::Tensor> tensors = executor ? outcomes[i].made : task.syncTensors(record, context);
        sent.insert(sent.end(), tensors.begin(), tensors.end());
        agreed[static_cast<size_t>(record.executorRank)] += outcomes[i].madeBytes;
        afterExchange.push_back(index);
      } else {
        for (const Json& t : outcomes[i].tensors) {
          sent.push_back(slotFor(root.getSubmodule(t[0].get<std::string>()), t[1] == "p", t[2].get<std::string>(),
                                 static_cast<at::ScalarType>(t[3].get<int>()), t[4].get<std::vector<int64_t>>(),
                                 executor));
          agreed[static_cast<size_t>(record.executorRank)] += static_cast<int64_t>(sent.back().nbytes());
        }
        for (auto& [path, module] : modulesOf(root, task)) {
          if (auto* synced = dynamic_cast<DistributedSync*>(module)) {
            for (const at::Tensor& t : synced->syncTensors(record, context)) sent.push_back(t);
            own.emplace_back(synced, &record);
          }
        }
      }
      for (size_t t = before; t < sent.size(); ++t) record.syncBytes += static_cast<int64_t>(sent[t].nbytes());
      sending[static_cast<size_t>(record.executorRank)] += record.syncBytes;
      batched.push_back(&record);
    }
    const auto start = Clock::now();
    const int64_t slot = *std::max_element(agreed.begin(), agreed.end()) + ownTensorsSlot;
    // Whether to exchange at all comes from what every rank knows alike (the announced bytes, the
    // modules with a sync of their own), never from this rank's own DistributedSync tensors: a
    // rank whose module returned none still meets the others, and the exchange names the mismatch.
    const bool exchange =
        !own.empty() || std::any_of(agreed.begin(), agreed.end(), [](int64_t bytes) { return bytes > 0; });
    if (const int collectives = exchange ? exchangeTogether(group, fromRank, slot) : 0) {
      // Each rank's part as it sent it: exchangeTogether checked that every rank's view agrees.
      summary.settledCollectiveSeconds += since(start);
      summary.settledCollectives += collectives;
      int64_t own = 0;
      for (size_t r = 0; r < sending.size(); ++r) own = std::max(own, sending[r] - agreed[r]);
      ownTensorsSlot = slotAfter(own);
    }
    for (auto& [synced, record] : own) synced->syncDone(*record, context);
    for (size_t index : afterExchange) {
      if (tasks[index].sync) tasks[index].sync(records[index], context);
    }
    const double share = batched.empty() ? 0 : since(start) / static_cast<double>(batched.size());
    for (TaskRecord* record : batched) record->syncSeconds = share;
  }
};

DistributedTaskScheduler::DistributedTaskScheduler(Module& root, ProcessGroup& group, SchedulerOptions options)
    : impl_(std::make_unique<Impl>(Impl{root, group, std::move(options), {}, {}, {}})) {
  QPIPE_REQUIRE(impl_->options.claimLimit >= 0, ErrorCode::kPlugin, impl_->where(), ": claimLimit ",
                impl_->options.claimLimit, " is negative (0 takes guided chunks)");
}

DistributedTaskScheduler::~DistributedTaskScheduler() = default;

void DistributedTaskScheduler::submit(Task task) {
  Impl& s = *impl_;
  const std::string label = s.where() + ": task '" + task.name + "'";
  QPIPE_REQUIRE(!task.name.empty(), ErrorCode::kPlugin, s.where(), ": a task needs a name");
  QPIPE_REQUIRE(static_cast<bool>(task.fn), ErrorCode::kPlugin, label, " has no function");
  QPIPE_REQUIRE((!task.sync && !task.syncTensors) || !task.syncName.empty(), ErrorCode::kPlugin, label,
                " has a sync function but no syncName");
  QPIPE_REQUIRE(std::isfinite(task.cost) && task.cost >= 0, ErrorCode::kPlugin, label, " has cost ", task.cost,
                "; a cost is a finite estimate, 0 or more");
  task.cost += 0.0;  // -0 as +0: the hash reads the bits, the description prints both as 0
  for (const std::string& dependency : task.dependencies) {
    QPIPE_REQUIRE(!dependency.empty(), ErrorCode::kPlugin, label,
                  " has an empty dependency; name the modules the task changes");
    try {
      s.root.getSubmodule(dependency);
    } catch (const Error& e) {
      throw Error(ErrorCode::kPlugin, concat(label, " depends on '", dependency,
                                             "', which is not a module below the scheduler's root (", e.what(), ")"));
    }
  }
  const bool parallel = task.parallel && s.parallelAllowed();
  bool fresh = s.waves.empty() || s.waves.back().parallel != parallel;
  for (size_t d = 0; !fresh && d < task.dependencies.size(); ++d) {
    for (const std::string& path : s.waves.back().paths) fresh = fresh || pathsOverlap(task.dependencies[d], path);
  }
  if (fresh) s.waves.push_back({parallel, {}, {}});
  Wave& wave = s.waves.back();
  wave.tasks.push_back(s.tasks.size());
  wave.paths.insert(wave.paths.end(), task.dependencies.begin(), task.dependencies.end());
  s.tasks.push_back(std::move(task));
}

std::vector<TaskRecord> DistributedTaskScheduler::run() {
  Impl& s = *impl_;
  struct Emptied {
    Impl& s;
    ~Emptied() {
      s.tasks.clear();
      s.waves.clear();
    }
  } emptied{s};
  const auto start = Clock::now();
  s.summary = {.name = s.options.name,
               .tasks = static_cast<int64_t>(s.tasks.size()),
               .waves = static_cast<int64_t>(s.waves.size()),
               .worldSize = s.group.worldSize(),
               .rank = s.group.rank()};
  std::vector<TaskRecord> records(s.tasks.size());
  for (size_t i = 0; i < s.tasks.size(); ++i) {
    records[i].name = s.tasks[i].name;
    records[i].dependencies = s.tasks[i].dependencies;
    records[i].cost = s.tasks[i].cost;
  }
  const auto logger = log::logger();
  // Every rank agrees, even one whose waves are all local (it submitted nothing parallel, or
  // disabled parallel): otherwise the others would wait in a collective it never makes.
  if (s.group.worldSize() > 1 && !ParallelTaskScope::active()) {
    const auto agreeing = Clock::now();
    s.agree();
    s.summary.agreeSeconds = since(agreeing);
    s.summary.syncSeconds = s.summary.agreeSeconds;
  }
  for (size_t w = 0; w < s.waves.size(); ++w) {
    const Wave& wave = s.waves[w];
    const auto waveStart = Clock::now();
    if (!wave.parallel) {
      s.runLocal(wave, w, records);
    } else {
      ++s.summary.parallelWaves;
      const std::vector<Outcome> outcomes = s.execute(wave, w, records);
      const auto syncing = Clock::now();
      for (size_t index : wave.tasks) records[index].parallel = true;
      s.sync(wave, outcomes, w, records);
      s.summary.syncSeconds += since(syncing);
    }
    logger->debug(s.where(), ": wave ", w, wave.parallel ? " parallel" : " local", ", ", wave.tasks.size(), " tasks, ",
                  since(waveStart), " s");
  }
  s.summary.wallSeconds = since(start);
  logger->debug(s.where(), ": ", s.summary.line());
  if (s.summary.notWorthSplitting()) {
    logger->debug(s.where(), ": syncing took ", s.summary.syncSeconds, " s, more than the ",
                  s.summary.execSeconds - s.summary.myExecSeconds, " s of tasks other ranks ran: not worth splitting");
  }
  return records;
}

const RunSummary& DistributedTaskScheduler::summary() const {
  return impl_->summary;
}

void DistributedTaskScheduler::setGlobalDisableParallel(bool disabled) {
  globalDisabled = disabled;
}

bool DistributedTaskScheduler::globalDisableParallel() {
  return globalDisabled;
}

// Guided chunks: a wave of many short tasks (a search's candidates, a many-expert layer's) costs
// a few store round trips per rank instead of one per task, and the chunks shrink to single tasks
// towards the end, where a rank that is done early takes what is left. Measured by cost, a claim
// of the costliest tasks (handed out first) takes one at a time: counted, a 2-task chunk of them
// on 8 ranks left ranks idle at the end of a smoothing wave of 42 candidates (docs/benchmarks.md).
int64_t claimSize(std::span<const double> left, int worldSize, int64_t claimLimit) {
  double total = 0;
  for (double w : left) total += w;
  // With weights of 1 the products and sums are whole numbers, exact: ceil(size / 4W) tasks. The
  // margin keeps equal fractional costs to the same count (ten of 0.1 are not quite 1).
  const double parts = 4.0 * worldSize, target = total * (1 - 1e-9);
  int64_t chunk = 0;
  double taken = 0;
  while (chunk < static_cast<int64_t>(left.size()) && (chunk == 0 || taken * parts < target)) {
    taken += left[static_cast<size_t>(chunk++)];
  }
  const int64_t guided = std::max<int64_t>(1, chunk);
  return claimLimit > 0 ? std::min(guided, claimLimit) : guided;
}

std::vector<double> claimWeights(std::span<const double> costs) {
  const bool costed = std::all_of(costs.begin(), costs.end(), [](double cost) { return cost > 0; });
  return costed ? std::vector<double>(costs.begin(), costs.end()) : std::vector<double>(costs.size(), 1.0);
}

bool pathsOverlap(const std::string& a, const std::string& b) {
  const auto below = [](const std::string& path, const std::string& ancestor) {
    return ancestor.empty() || (path.size() > ancestor.size() && path.compare(0, ancestor.size(), ancestor) == 0 &&
                                path[ancestor.size()] == '.');
  };
  return a == b || below(a, b) || below(b, a);
}

int64_t submitIndex(const TaskRecord& record) {
  const size_t mark = record.taskId.find(kIndexMark);
  QPIPE_CHECK(mark != std::string::npos, "task id '", record.taskId, "' names no submit index");
  return std::stoll(record.taskId.substr(mark + kIndexMark.size()));
}

ConfigNode tensorMeta(const at::Tensor& tensor) {
  std::vector<ConfigNode> shape;
  for (int64_t d : tensor.sizes()) shape.push_back(ConfigNode::integer(d));
  return ConfigNode::map({{"shape", ConfigNode::list(std::move(shape))},
                          {"dtype", ConfigNode::string(c10::toString(tensor.scalar_type()))},
                          {"device", ConfigNode::string(tensor.device().str())}});
}

}  // namespace qpipe::scheduler
