// Region memory shared within a node over CUDA IPC: the owner allocates and exports a handle,
// a peer process opens it and gets a pointer its kernels can store to directly.
#pragma once

#include <cstdint>
#include <string>

namespace ibgda {

constexpr size_t kIpcHandleBytes = 64;  // sizeof(cudaIpcMemHandle_t)

uintptr_t alloc_region(uint64_t size);  // zeroed device memory
void free_region(uintptr_t ptr);
std::string export_region(uintptr_t ptr);  // the IPC handle, to send to peers
uintptr_t open_region(const std::string& handle);  // a peer's region, mapped here
void close_region(uintptr_t ptr);

}  // namespace ibgda
