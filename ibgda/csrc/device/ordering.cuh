// Memory ordering of the slot protocol on the GPU: "payload, then flag (release)" on the
// writer, "flag (acquire), then payload" on the reader, at system scope so the other side may be
// another GPU (CUDA IPC peer memory), the host, or a NIC (NVSHMEM/IBGDA).
#pragma once

#include <cstdint>

namespace ibgda {

// Every earlier store of this thread is visible to whoever observes `value` at `addr`.
__device__ __forceinline__ void store_release_sys(uint32_t* addr, uint32_t value) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(addr), "r"(value) : "memory");
}

// Later loads of this thread see everything the releasing writer stored before `addr`.
__device__ __forceinline__ uint32_t load_acquire_sys(const uint32_t* addr) {
  uint32_t value;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(value) : "l"(addr) : "memory");
  return value;
}

// Nanoseconds since an arbitrary epoch, the same on every SM: the wait kernels' timeout clock.
__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t ns;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
  return ns;
}

}  // namespace ibgda
