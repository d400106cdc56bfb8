// ESFT batched rerouting on the CPU (ExpertWeave §4.3; sgl-kernel-ext/sgl_kernel_ext/
// esft_reroute.py is its wrapper and the Triton twin's): before dispatch, each token's top-k
// expert ids are rewritten by its request's adapter,
//
//     out[t, k] = pi[aid[t], ids[t, k]]   if aid[t] >= 0 and ids[t, k] >= 0
//     out[t, k] = ids[t, k]               otherwise (base-model tokens, masked entries: -1 stays)
//
// with ids [T, K] int32 or int64 (out in the same dtype), aid [T] int32 and pi [A, E] int32 (an
// adapter's physical id of each expert, which may be >= E). One pass over the T * K entries,
// each input read through its strides (a sliced or transposed ids is not copied), out a new
// contiguous tensor; tokens are split between the threads (at::parallel_for) only when there are
// enough entries to pay for waking them. With check_aid, one serial pass over aid first refuses
// a value that is not -1 or in [0, A); an ids value >= E is the caller's contract (not checked:
// it would read past pi's row).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <string>

namespace {

// Entries below which one thread does the whole pass (a gather is about a nanosecond; waking
// the OpenMP team costs microseconds).
constexpr int64_t kParallelEntries = 1 << 16;

// A dtype as Python prints it without "torch." (float32, not Float).
std::string name(at::ScalarType dtype) { return std::string(c10::getDtypeNames(dtype).first); }

template <typename I>
void reroute_tokens(const I* ids, int64_t ids_s0, int64_t ids_s1, const int32_t* aid,
                    int64_t aid_s0, const int32_t* pi, int64_t pi_s0, int64_t pi_s1, I* out,
                    int64_t top_k, int64_t begin, int64_t end) {
  for (int64_t t = begin; t < end; ++t) {
    const I* row = ids + t * ids_s0;
    I* dst = out + t * top_k;
    const int64_t a = aid[t * aid_s0];
    if (a < 0) {
      for (int64_t k = 0; k < top_k; ++k) dst[k] = row[k * ids_s1];
      continue;
    }
    const int32_t* map = pi + a * pi_s0;
    for (int64_t k = 0; k < top_k; ++k) {
      const I e = row[k * ids_s1];
      dst[k] = e < 0 ? e : static_cast<I>(map[static_cast<int64_t>(e) * pi_s1]);
    }
  }
}

at::Tensor esft_reroute(const at::Tensor& ids, const at::Tensor& aid, const at::Tensor& pi,
                        bool check_aid) {
  TORCH_CHECK_VALUE(ids.dim() == 2, "ids must be 2-d [T, K], got shape ", ids.sizes());
  TORCH_CHECK_VALUE(aid.dim() == 1 && aid.size(0) == ids.size(0), "aid must be [T] = [",
                    ids.size(0), "] (one adapter id per token), got shape ", aid.sizes());
  TORCH_CHECK_VALUE(pi.dim() == 2, "pi must be 2-d [A, E], got shape ", pi.sizes());
  TORCH_CHECK_VALUE(ids.scalar_type() == at::kInt || ids.scalar_type() == at::kLong,
                    "ids must be int32 or int64, got ", name(ids.scalar_type()));
  TORCH_CHECK_VALUE(aid.scalar_type() == at::kInt && pi.scalar_type() == at::kInt,
                    "aid and pi must be int32, got ", name(aid.scalar_type()), " and ",
                    name(pi.scalar_type()));
  TORCH_CHECK_VALUE(ids.device().is_cpu() && aid.device().is_cpu() && pi.device().is_cpu(),
                    "ids, aid and pi must be CPU tensors, got ", ids.device(), ", ",
                    aid.device(), " and ", pi.device());
  const int64_t tokens = ids.size(0), top_k = ids.size(1), adapters = pi.size(0);
  const int32_t* ap = aid.data_ptr<int32_t>();
  if (check_aid) {
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t a = ap[t * aid.stride(0)];
      TORCH_CHECK_VALUE(a >= -1 && a < adapters, "aid[", t, "] = ", a,
                        " is not -1 (the base model) or an adapter index in [0, ", adapters,
                        ")");
    }
  }
  at::Tensor out = at::empty({tokens, top_k}, ids.options());
  if (out.numel() == 0) return out;
  const int64_t grain = std::max<int64_t>(1, kParallelEntries / top_k);
  const int32_t* pp = pi.data_ptr<int32_t>();
  auto run = [&](auto* ip, auto* op) {
    at::parallel_for(0, tokens, grain, [&](int64_t begin, int64_t end) {
      reroute_tokens(ip, ids.stride(0), ids.stride(1), ap, aid.stride(0), pp, pi.stride(0),
                     pi.stride(1), op, top_k, begin, end);
    });
  };
  if (ids.scalar_type() == at::kInt) {
    run(ids.data_ptr<int32_t>(), out.data_ptr<int32_t>());
  } else {
    run(ids.data_ptr<int64_t>(), out.data_ptr<int64_t>());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sgl_kernel_ext_cpu, m) {
  m.def("esft_reroute(Tensor ids, Tensor aid, Tensor pi, bool check_aid=True) -> Tensor");
}

TORCH_LIBRARY_IMPL(sgl_kernel_ext_cpu, CPU, m) {
  m.impl("esft_reroute", &esft_reroute);
}
