// CUDA runtime errors become C++ exceptions (Python RuntimeError through the bindings), naming
// the call that failed.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace ibgda {

inline void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string(what) + " failed: " + cudaGetErrorString(status) +
                             " (" + cudaGetErrorName(status) + ")");
  }
}

}  // namespace ibgda
