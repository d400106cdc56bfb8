#include "cuda_check.h"
#include "ordering.cuh"
#include "peer_kernels.cuh"

namespace ibgda {
namespace {

// Copies this block's share of [0, nbytes): 16-byte vectors when both ends allow, else bytes.
__device__ void copy_block(uint8_t* dst, const uint8_t* src, uint64_t nbytes) {
  const uint64_t begin = blockIdx.x * kBytesPerBlock;
  if (begin >= nbytes) return;
  const uint64_t end = min(nbytes, begin + kBytesPerBlock);
  const bool vectors = ((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) |
                         begin | end) % sizeof(uint4)) == 0;
  if (vectors) {
    for (uint64_t i = begin + threadIdx.x * sizeof(uint4); i < end; i += blockDim.x * sizeof(uint4))
      *reinterpret_cast<uint4*>(dst + i) = *reinterpret_cast<const uint4*>(src + i);
  } else {
    for (uint64_t i = begin + threadIdx.x; i < end; i += blockDim.x) dst[i] = src[i];
  }
}

__global__ void put_signal_kernel(uint8_t* region, Sections sections, int64_t flag_offset,
                                  uint32_t value, uint32_t* arrivals) {
  for (int s = 0; s < sections.count; ++s) {
    const Section& section = sections.items[s];
    copy_block(region + section.dst_offset, section.src, section.nbytes);
  }
  if (flag_offset < 0) return;
  __syncthreads();  // this block's copies are done...
  if (threadIdx.x != 0) return;
  __threadfence_system();  // ...and visible system-wide before this block arrives
  if (atomicAdd(arrivals, 1u) != gridDim.x - 1) return;
  // Last block: every other block fenced its copies before arriving.
  __threadfence_system();
  *arrivals = 0;
  store_release_sys(reinterpret_cast<uint32_t*>(region + flag_offset), value);
}

__global__ void wait_flag_kernel(const uint8_t* region, uint64_t flag_offset, uint32_t value,
                                 uint64_t timeout_ns, uint32_t* status) {
  const auto* flag = reinterpret_cast<const uint32_t*>(region + flag_offset);
  const uint64_t start = global_timer_ns();
  uint32_t seen = load_acquire_sys(flag) & 0xFF;
  while (seen != value && global_timer_ns() - start < timeout_ns) {
    __nanosleep(100);
    seen = load_acquire_sys(flag) & 0xFF;
  }
  status[0] = seen == value;
  status[1] = seen;
}

__global__ void read_kernel(uint8_t* out, const uint8_t* region, uint64_t nbytes) {
  copy_block(out, region, nbytes);
}

uint32_t blocks_for(uint64_t nbytes) {
  return static_cast<uint32_t>(nbytes == 0 ? 1 : (nbytes + kBytesPerBlock - 1) / kBytesPerBlock);
}

}  // namespace

void launch_put_signal(uint8_t* region, const Sections& sections, int64_t flag_offset,
                       uint32_t value, uint32_t* arrivals, cudaStream_t stream) {
  put_signal_kernel<<<blocks_for(sections.longest), kThreads, 0, stream>>>(
      region, sections, flag_offset, value, arrivals);
  check_cuda(cudaGetLastError(), "put_signal launch");
}

void launch_wait_flag(const uint8_t* region, uint64_t flag_offset, uint32_t value,
                      uint64_t timeout_ns, uint32_t* status, cudaStream_t stream) {
  wait_flag_kernel<<<1, 1, 0, stream>>>(region, flag_offset, value, timeout_ns, status);
  check_cuda(cudaGetLastError(), "wait_flag launch");
}

void launch_read(uint8_t* out, const uint8_t* region, uint64_t offset, uint64_t nbytes,
                 cudaStream_t stream) {
  read_kernel<<<blocks_for(nbytes), kThreads, 0, stream>>>(out, region + offset, nbytes);
  check_cuda(cudaGetLastError(), "read launch");
}

}  // namespace ibgda
