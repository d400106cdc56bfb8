// The client's one-sided operations across nodes: the same put_signal / wait_flag / read as
// peer_kernels.cuh, on a region in an NVSHMEM symmetric heap of PE `pe`, issued by the GPU itself
// (IBGDA: the GPU rings the NIC's doorbell, no host proxy). Built only with --nvshmem.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "sections.h"

namespace ibgda {

// NVSHMEM job membership (unique-id bootstrap: rank 0 makes the id, all ranks pass it in).
std::string nvshmem_unique_id();
void nvshmem_join(int rank, int nranks, const std::string& unique_id);
void nvshmem_leave();
uintptr_t nvshmem_alloc_region(uint64_t size);  // collective: same size on every PE
void nvshmem_free_region(uintptr_t ptr);

// Sections are put in order, fenced, then the flag word is set atomically: PE `pe` never sees
// the flag before the payload.
void launch_nvshmem_put_signal(uint8_t* region, const Sections& sections, int64_t flag_offset,
                               uint32_t value, int pe, cudaStream_t stream);
void launch_nvshmem_wait_flag(const uint8_t* region, uint64_t flag_offset, uint32_t value,
                              uint64_t timeout_ns, uint32_t* status, int pe,
                              cudaStream_t stream);
void launch_nvshmem_read(uint8_t* out, const uint8_t* region, uint64_t offset, uint64_t nbytes,
                         int pe, cudaStream_t stream);

}  // namespace ibgda
