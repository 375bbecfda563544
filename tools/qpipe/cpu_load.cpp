#include "cpu_load.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>

namespace qpipe::cli {
namespace {

struct Sample {
  bool valid = false;
  long long busy = 0;   // ticks the affinity mask's cores ran anything but idle and iowait
  long long total = 0;  // all their ticks
  long long self = 0;   // this process's user + system ticks
  int cores = 0;
};

Sample started;

// Plain stdio: this runs before the C++ libraries' initializers.
Sample sample() {
  Sample s;
  cpu_set_t mask;
  if (::sched_getaffinity(0, sizeof(mask), &mask) != 0) return s;
  FILE* stat = std::fopen("/proc/stat", "r");
  if (stat == nullptr) return s;
  char line[512];
  while (std::fgets(line, sizeof(line), stat) != nullptr) {
    int cpu = 0;
    long long v[8] = {};  // user nice system idle iowait irq softirq steal
    if (std::sscanf(line, "cpu%d %lld %lld %lld %lld %lld %lld %lld %lld", &cpu, &v[0], &v[1], &v[2], &v[3], &v[4],
                    &v[5], &v[6], &v[7]) != 9 ||
        cpu < 0 || cpu >= CPU_SETSIZE || !CPU_ISSET(cpu, &mask)) {
      continue;
    }
    long long all = 0;
    for (long long t : v) all += t;
    s.total += all;
    s.busy += all - v[3] - v[4];
    ++s.cores;
  }
  std::fclose(stat);
  FILE* self = std::fopen("/proc/self/stat", "r");
  if (self == nullptr) return s;
  char text[1024] = {};
  const size_t read = std::fread(text, 1, sizeof(text) - 1, self);
  std::fclose(self);
  text[read] = '\0';
  // Fields after the command name, which may hold spaces and ends at the last ')': utime and
  // stime are the 12th and 13th of them.
  const char* rest = std::strrchr(text, ')');
  unsigned long long utime = 0, stime = 0;
  if (rest == nullptr ||
      std::sscanf(rest + 1, " %*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &utime, &stime) != 2) {
    return s;
  }
  s.self = static_cast<long long>(utime + stime);
  s.valid = s.cores > 0;
  return s;
}

}  // namespace

void sampleCpuLoadAtStart() {
  started = sample();
}

int coresBusyElsewhere() {
  const Sample now = sample();
  if (!started.valid || !now.valid || now.cores != started.cores) return 0;
  const double perCore = static_cast<double>(now.total - started.total) / now.cores;
  if (perCore < 0.05 * static_cast<double>(::sysconf(_SC_CLK_TCK))) return 0;
  const double others = static_cast<double>((now.busy - started.busy) - (now.self - started.self));
  return static_cast<int>(std::lround(std::max(0.0, others) / perCore));
}

}  // namespace qpipe::cli
