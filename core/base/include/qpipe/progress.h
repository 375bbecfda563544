// A one-line progress bar with rate and ETA on stderr, drawn only when stderr is a terminal
// (logs and CI output stay clean).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace qpipe {

class ProgressBar {
 public:
  ProgressBar(std::string label, int64_t total, std::string unit);
  ~ProgressBar();  // ends the line if one was drawn

  // `done` of `total` finished; `note` is appended (e.g. "ppl 12.3").
  void update(int64_t done, const std::string& note = {});

 private:
  std::string label_;
  int64_t total_;
  std::string unit_;
  bool enabled_;
  bool drawn_ = false;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace qpipe
