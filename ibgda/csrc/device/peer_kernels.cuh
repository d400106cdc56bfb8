// The client's one-sided operations as kernels on a peer region the GPU can address directly
// (CUDA IPC peer memory within a node). The same algorithm as ibgda/kernels.py (Triton), which
// the CPU tests run under the interpreter.
#pragma once

#include <cuda_runtime.h>

#include "sections.h"

namespace ibgda {

constexpr int kThreads = 256;
constexpr uint64_t kBytesPerBlock = 64 * 1024;

// put_signal: every section copied into the region, then (flag_offset >= 0) `value` stored
// into the flag word with release semantics by the last block to finish. `arrivals` is a zeroed
// device u32 owned by the caller (one per connection); the last block resets it.
void launch_put_signal(uint8_t* region, const Sections& sections, int64_t flag_offset,
                       uint32_t value, uint32_t* arrivals, cudaStream_t stream);

// wait_flag: one thread acquire-polls the low byte of the flag word until it equals `value` or
// `timeout_ns` passes; status[0] = reached (1/0), status[1] = the last byte seen.
void launch_wait_flag(const uint8_t* region, uint64_t flag_offset, uint32_t value,
                      uint64_t timeout_ns, uint32_t* status, cudaStream_t stream);

// read: out[0:nbytes] = region[offset : offset + nbytes].
void launch_read(uint8_t* out, const uint8_t* region, uint64_t offset, uint64_t nbytes,
                 cudaStream_t stream);

}  // namespace ibgda
