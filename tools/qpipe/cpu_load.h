// How busy this process's cores are with other work, measured between process start and the
// moment a command picks its thread count (docs/cli.md, "Threads on a busy machine").
#pragma once

namespace qpipe::cli {

// Reads the CPU time of the cores this process may run on and of this process itself. Called
// from the executable's .preinit_array, before LibTorch loads.
void sampleCpuLoadAtStart();

// The cores of this process's affinity mask that other processes (or the hypervisor) kept busy
// since sampleCpuLoadAtStart, rounded to whole cores; 0 if unknown or measured over less than
// 0.05 s.
int coresBusyElsewhere();

}  // namespace qpipe::cli
