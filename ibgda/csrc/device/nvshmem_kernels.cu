#include <nvshmem.h>
#include <nvshmemx.h>

#include "cuda_check.h"
#include "nvshmem_kernels.cuh"
#include "ordering.cuh"

namespace ibgda {
namespace {

constexpr int kThreads = 256;

void check_nvshmem(int status, const char* what) {
  if (status != 0) {
    throw std::runtime_error(std::string(what) + " failed with NVSHMEM status " +
                             std::to_string(status));
  }
}

// One block issues every put: NVSHMEM orders puts to one PE only across nvshmem_fence().
__global__ void put_signal_kernel(uint8_t* region, Sections sections, int64_t flag_offset,
                                  uint32_t value, int pe) {
  for (int s = 0; s < sections.count; ++s) {
    const Section& section = sections.items[s];
    nvshmemx_putmem_nbi_block(region + section.dst_offset, section.src, section.nbytes, pe);
  }
  if (flag_offset < 0) return;
  __syncthreads();
  if (threadIdx.x == 0) {
    nvshmem_fence();  // the payload is delivered before the flag
    nvshmem_uint32_atomic_set(reinterpret_cast<uint32_t*>(region + flag_offset), value, pe);
  }
}

__global__ void wait_flag_kernel(const uint8_t* region, uint64_t flag_offset, uint32_t value,
                                 uint64_t timeout_ns, uint32_t* status, int pe) {
  auto* flag = reinterpret_cast<uint32_t*>(const_cast<uint8_t*>(region) + flag_offset);
  const uint64_t start = global_timer_ns();
  uint32_t seen = nvshmem_uint32_atomic_fetch(flag, pe) & 0xFF;
  while (seen != value && global_timer_ns() - start < timeout_ns) {
    __nanosleep(1000);  // each poll is a remote atomic: poll gently
    seen = nvshmem_uint32_atomic_fetch(flag, pe) & 0xFF;
  }
  status[0] = seen == value;
  status[1] = seen;
}

__global__ void read_kernel(uint8_t* out, const uint8_t* region, uint64_t nbytes, int pe) {
  nvshmemx_getmem_block(out, region, nbytes, pe);
}

}  // namespace

std::string nvshmem_unique_id() {
  nvshmemx_uniqueid_t id;
  check_nvshmem(nvshmemx_get_uniqueid(&id), "nvshmemx_get_uniqueid");
  return std::string(reinterpret_cast<const char*>(&id), sizeof(id));
}

void nvshmem_join(int rank, int nranks, const std::string& unique_id) {
  nvshmemx_uniqueid_t id;
  if (unique_id.size() != sizeof(id)) {
    throw std::invalid_argument("an NVSHMEM unique id has " + std::to_string(sizeof(id)) +
                                " bytes, not " + std::to_string(unique_id.size()));
  }
  std::memcpy(&id, unique_id.data(), sizeof(id));
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  check_nvshmem(nvshmemx_set_attr_uniqueid_args(rank, nranks, &id, &attr),
                "nvshmemx_set_attr_uniqueid_args");
  check_nvshmem(nvshmemx_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr), "nvshmemx_init_attr");
}

void nvshmem_leave() { nvshmem_finalize(); }

uintptr_t nvshmem_alloc_region(uint64_t size) {
  void* ptr = nvshmem_malloc(size);
  if (ptr == nullptr) throw std::runtime_error("nvshmem_malloc of a region failed");
  check_cuda(cudaMemset(ptr, 0, size), "cudaMemset of a new region");
  nvshmem_barrier_all();  // no peer writes into the region before it is zeroed everywhere
  return reinterpret_cast<uintptr_t>(ptr);
}

void nvshmem_free_region(uintptr_t ptr) { nvshmem_free(reinterpret_cast<void*>(ptr)); }

void launch_nvshmem_put_signal(uint8_t* region, const Sections& sections, int64_t flag_offset,
                               uint32_t value, int pe, cudaStream_t stream) {
  put_signal_kernel<<<1, kThreads, 0, stream>>>(region, sections, flag_offset, value, pe);
  check_cuda(cudaGetLastError(), "nvshmem put_signal launch");
}

void launch_nvshmem_wait_flag(const uint8_t* region, uint64_t flag_offset, uint32_t value,
                              uint64_t timeout_ns, uint32_t* status, int pe,
                              cudaStream_t stream) {
  wait_flag_kernel<<<1, 1, 0, stream>>>(region, flag_offset, value, timeout_ns, status, pe);
  check_cuda(cudaGetLastError(), "nvshmem wait_flag launch");
}

void launch_nvshmem_read(uint8_t* out, const uint8_t* region, uint64_t offset, uint64_t nbytes,
                         int pe, cudaStream_t stream) {
  read_kernel<<<1, kThreads, 0, stream>>>(out, region + offset, nbytes, pe);
  check_cuda(cudaGetLastError(), "nvshmem read launch");
}

}  // namespace ibgda
