#include "qpipe/progress.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string_view>

namespace qpipe {

namespace {

// Ranks share their parent's terminal: only rank 0 (or a single process) draws.
bool drawsHere() {
  const char* rank = std::getenv("RANK");
  return ::isatty(STDERR_FILENO) == 1 && (rank == nullptr || std::string_view(rank) == "0");
}

std::string clock(double seconds) {
  const auto s = static_cast<long>(seconds + 0.5);
  char text[32];
  std::snprintf(text, sizeof text, "%ld:%02ld:%02ld", s / 3600, (s / 60) % 60, s % 60);
  return text;
}

}  // namespace

ProgressBar::ProgressBar(std::string label, int64_t total, std::string unit)
    : label_(std::move(label)),
      total_(total),
      unit_(std::move(unit)),
      enabled_(drawsHere()),
      start_(std::chrono::steady_clock::now()) {}

ProgressBar::~ProgressBar() {
  if (drawn_) std::fputc('\n', stderr);
}

void ProgressBar::update(int64_t done, const std::string& note) {
  if (!enabled_ || total_ <= 0) return;
  constexpr int kWidth = 30;
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  const double fraction = static_cast<double>(done) / static_cast<double>(total_);
  const int filled = static_cast<int>(fraction * kWidth);
  const double rate = elapsed > 0 ? static_cast<double>(done) / elapsed : 0;
  const std::string eta = rate > 0 ? clock(static_cast<double>(total_ - done) / rate) : "?";
  std::fprintf(stderr, "\r%s [%s%s] %lld/%lld %s, %.2f %s/s, ETA %s %s\x1b[K", label_.c_str(),
               std::string(filled, '#').c_str(), std::string(kWidth - filled, '.').c_str(),
               static_cast<long long>(done), static_cast<long long>(total_), unit_.c_str(), rate, unit_.c_str(),
               eta.c_str(), note.c_str());
  std::fflush(stderr);
  drawn_ = true;
}

}  // namespace qpipe
