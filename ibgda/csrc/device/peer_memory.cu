#include <cuda_runtime.h>

#include <cstring>
#include <stdexcept>

#include "cuda_check.h"
#include "peer_memory.h"

namespace ibgda {

static_assert(sizeof(cudaIpcMemHandle_t) == kIpcHandleBytes, "IPC handle size changed");

uintptr_t alloc_region(uint64_t size) {
  void* ptr = nullptr;
  check_cuda(cudaMalloc(&ptr, size), "cudaMalloc of a region");
  const cudaError_t zeroed = cudaMemset(ptr, 0, size);
  if (zeroed != cudaSuccess) {
    cudaFree(ptr);
    check_cuda(zeroed, "cudaMemset of a new region");
  }
  return reinterpret_cast<uintptr_t>(ptr);
}

void free_region(uintptr_t ptr) {
  check_cuda(cudaFree(reinterpret_cast<void*>(ptr)), "cudaFree of a region");
}

std::string export_region(uintptr_t ptr) {
  cudaIpcMemHandle_t handle;
  check_cuda(cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(ptr)), "cudaIpcGetMemHandle");
  return std::string(reinterpret_cast<const char*>(&handle), sizeof(handle));
}

uintptr_t open_region(const std::string& bytes) {
  if (bytes.size() != kIpcHandleBytes) {
    throw std::invalid_argument("a CUDA IPC handle has " + std::to_string(kIpcHandleBytes) +
                                " bytes, not " + std::to_string(bytes.size()));
  }
  cudaIpcMemHandle_t handle;
  std::memcpy(&handle, bytes.data(), sizeof(handle));
  void* ptr = nullptr;
  check_cuda(cudaIpcOpenMemHandle(&ptr, handle, cudaIpcMemLazyEnablePeerAccess),
             "cudaIpcOpenMemHandle");
  return reinterpret_cast<uintptr_t>(ptr);
}

void close_region(uintptr_t ptr) {
  check_cuda(cudaIpcCloseMemHandle(reinterpret_cast<void*>(ptr)), "cudaIpcCloseMemHandle");
}

}  // namespace ibgda
