// ibgda._device_cuda: the device backend's native side for Python. Pointers and streams are
// plain integers (tensor.data_ptr(), torch.cuda.current_stream().cuda_stream), so the module
// does not depend on torch's C++ ABI.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "peer_kernels.cuh"
#include "peer_memory.h"
#ifdef IBGDA_WITH_NVSHMEM
#include "nvshmem_kernels.cuh"
#endif

namespace py = pybind11;
using SectionList = std::vector<std::tuple<uintptr_t, uint64_t, uint64_t>>;

namespace {

template <typename T>
T* ptr(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

cudaStream_t stream_of(uintptr_t stream) { return reinterpret_cast<cudaStream_t>(stream); }

}  // namespace

PYBIND11_MODULE(_device_cuda, m) {
  m.doc() = "CUDA IPC regions and the one-sided put_signal / wait_flag / read kernels";
  py::register_exception<ibgda::OutOfRegion>(m, "OutOfRegion", PyExc_ValueError);
  m.attr("IPC_HANDLE_BYTES") = ibgda::kIpcHandleBytes;
  m.attr("MAX_SECTIONS") = ibgda::kMaxSections;

  m.def("alloc_region", &ibgda::alloc_region, py::arg("size"), "Zeroed device memory.");
  m.def("free_region", &ibgda::free_region, py::arg("ptr"));
  m.def("export_region", [](uintptr_t p) { return py::bytes(ibgda::export_region(p)); },
        py::arg("ptr"), "The CUDA IPC handle of a region, for peers on this node.");
  m.def("open_region", [](py::bytes h) { return ibgda::open_region(std::string(h)); },
        py::arg("handle"), "Map a peer's region; returns its address here.");
  m.def("close_region", &ibgda::close_region, py::arg("ptr"));

  m.def(
      "put_signal",
      [](uintptr_t region, uint64_t size, const SectionList& sections, int64_t flag_offset,
         uint32_t value, uintptr_t arrivals, uintptr_t stream) {
        if (flag_offset >= 0) ibgda::check_flag(size, flag_offset);
        ibgda::launch_put_signal(ptr<uint8_t>(region), ibgda::make_sections(size, sections),
                                 flag_offset, value, ptr<uint32_t>(arrivals), stream_of(stream));
      },
      py::arg("region"), py::arg("size"), py::arg("sections"), py::arg("flag_offset"),
      py::arg("value"), py::arg("arrivals"), py::arg("stream"),
      "Copy (src, offset, nbytes) sections into the region, then release-store the flag word "
      "(flag_offset < 0: no flag). One launch on `stream`.");
  m.def(
      "wait_flag",
      [](uintptr_t region, uint64_t size, uint64_t flag_offset, uint32_t value,
         uint64_t timeout_ns, uintptr_t status, uintptr_t stream) {
        ibgda::check_flag(size, flag_offset);
        ibgda::launch_wait_flag(ptr<const uint8_t>(region), flag_offset, value, timeout_ns,
                                ptr<uint32_t>(status), stream_of(stream));
      },
      py::arg("region"), py::arg("size"), py::arg("flag_offset"), py::arg("value"),
      py::arg("timeout_ns"), py::arg("status"), py::arg("stream"),
      "Acquire-poll the flag's low byte until it equals value; status = [reached, last seen].");
  m.def(
      "read",
      [](uintptr_t region, uint64_t size, uint64_t offset, uintptr_t out, uint64_t nbytes,
         uintptr_t stream) {
        ibgda::check_bounds(size, offset, nbytes);
        ibgda::launch_read(ptr<uint8_t>(out), ptr<const uint8_t>(region), offset, nbytes,
                           stream_of(stream));
      },
      py::arg("region"), py::arg("size"), py::arg("offset"), py::arg("out"), py::arg("nbytes"),
      py::arg("stream"));

#ifdef IBGDA_WITH_NVSHMEM
  m.attr("HAS_NVSHMEM") = true;
  m.def("nvshmem_unique_id", [] { return py::bytes(ibgda::nvshmem_unique_id()); });
  m.def("nvshmem_join", [](int rank, int nranks, py::bytes id) {
    ibgda::nvshmem_join(rank, nranks, std::string(id));
  }, py::arg("rank"), py::arg("nranks"), py::arg("unique_id"));
  m.def("nvshmem_leave", &ibgda::nvshmem_leave);
  m.def("nvshmem_alloc_region", &ibgda::nvshmem_alloc_region, py::arg("size"));
  m.def("nvshmem_free_region", &ibgda::nvshmem_free_region, py::arg("ptr"));
  m.def(
      "nvshmem_put_signal",
      [](uintptr_t region, uint64_t size, const SectionList& sections, int64_t flag_offset,
         uint32_t value, int pe, uintptr_t stream) {
        if (flag_offset >= 0) ibgda::check_flag(size, flag_offset);
        ibgda::launch_nvshmem_put_signal(ptr<uint8_t>(region),
                                         ibgda::make_sections(size, sections), flag_offset,
                                         value, pe, stream_of(stream));
      },
      py::arg("region"), py::arg("size"), py::arg("sections"), py::arg("flag_offset"),
      py::arg("value"), py::arg("pe"), py::arg("stream"));
  m.def(
      "nvshmem_wait_flag",
      [](uintptr_t region, uint64_t size, uint64_t flag_offset, uint32_t value,
         uint64_t timeout_ns, uintptr_t status, int pe, uintptr_t stream) {
        ibgda::check_flag(size, flag_offset);
        ibgda::launch_nvshmem_wait_flag(ptr<const uint8_t>(region), flag_offset, value,
                                        timeout_ns, ptr<uint32_t>(status), pe,
                                        stream_of(stream));
      },
      py::arg("region"), py::arg("size"), py::arg("flag_offset"), py::arg("value"),
      py::arg("timeout_ns"), py::arg("status"), py::arg("pe"), py::arg("stream"));
  m.def(
      "nvshmem_read",
      [](uintptr_t region, uint64_t size, uint64_t offset, uintptr_t out, uint64_t nbytes, int pe,
         uintptr_t stream) {
        ibgda::check_bounds(size, offset, nbytes);
        ibgda::launch_nvshmem_read(ptr<uint8_t>(out), ptr<const uint8_t>(region), offset, nbytes,
                                   pe, stream_of(stream));
      },
      py::arg("region"), py::arg("size"), py::arg("offset"), py::arg("out"), py::arg("nbytes"),
      py::arg("pe"), py::arg("stream"));
#else
  m.attr("HAS_NVSHMEM") = false;
#endif
}
