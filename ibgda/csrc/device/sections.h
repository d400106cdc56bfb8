// The arguments of a one-sided put: up to kMaxSections byte ranges copied into a peer's region,
// checked on the host against the region's size before any kernel sees them.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

namespace ibgda {

constexpr int kMaxSections = 4;  // header, hidden states, expert ids, router weights

struct Section {
  const uint8_t* src;   // device memory of the caller
  uint64_t dst_offset;  // into the peer's region
  uint64_t nbytes;
};

// Passed by value as one kernel argument, so a captured CUDA graph holds it whole.
struct Sections {
  Section items[kMaxSections];
  int count;
  uint64_t longest;
};

// Raised as Python's ValueError by the bindings: an access outside the registered region.
struct OutOfRegion : std::out_of_range {
  using std::out_of_range::out_of_range;
};

inline void check_bounds(uint64_t region_size, uint64_t offset, uint64_t nbytes) {
  if (offset > region_size || nbytes > region_size - offset) {
    throw OutOfRegion("access [" + std::to_string(offset) + ", " +
                      std::to_string(offset + nbytes) + ") is outside the " +
                      std::to_string(region_size) + "-byte region");
  }
}

inline void check_flag(uint64_t region_size, uint64_t flag_offset) {
  check_bounds(region_size, flag_offset, 4);
  if (flag_offset % 4) {
    throw std::invalid_argument("flags are u32 words: offset " + std::to_string(flag_offset) +
                                " is not 4-aligned");
  }
}

// (src pointer, destination offset, length) triples from Python, bounds-checked.
inline Sections make_sections(uint64_t region_size,
                              const std::vector<std::tuple<uintptr_t, uint64_t, uint64_t>>& in) {
  if (in.size() > kMaxSections) {
    throw std::invalid_argument("at most " + std::to_string(kMaxSections) +
                                " sections per put_signal");
  }
  Sections out{};
  for (const auto& [src, offset, nbytes] : in) {
    check_bounds(region_size, offset, nbytes);
    out.items[out.count++] = {reinterpret_cast<const uint8_t*>(src), offset, nbytes};
    out.longest = nbytes > out.longest ? nbytes : out.longest;
  }
  return out;
}

}  // namespace ibgda
