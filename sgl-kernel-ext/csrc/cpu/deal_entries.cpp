// Dealing one exchange's top-k entries to expert servers by load, on the CPU (the client's host
// path: python/sglang_eaas/placement.py's ExpertRouting.assign calls it; python/sglang_eaas/
// dealing.py is the same rule in NumPy, and sgl_kernel_ext/deal_entries_kernel.py the device
// path's Triton twin). docs/balancing.md, "Dealing replicated experts", gives the rule:
//
//   1. count: each valid entry (id >= 0) of an expert with one holder goes to that holder, and
//      counts for it;
//   2. deal, in rounds: the replicated experts with entries in order of count (most first, then
//      ascending id); in round q each of them with more than q entries deals its q-th entry to
//      its holder with the fewest entries so far; ties go to the first in the rotated order
//      start, start + 1, ... (mod r), start = (sum of the exchange's valid ids + expert) mod r;
//   3. place: an expert's q-th entry in flat (token, k) order goes where its q-th dealt entry
//      went.
//
// ids: any shape, int32 or int64 (< 0: no entry, out -1); holders [E, W] int64, row e the
// servers holding expert e in its first replicas[e] columns (one column of NO_HOLDER, -2, for
// an expert no server holds: its entries get -2 and count nowhere); replicas [E] int64 >= 1.
// out: int64 in ids' shape. Serial: an exchange is at most a few thousand entries, and what this
// replaces costs microseconds, so there is nothing for threads to win.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace {

std::string name(at::ScalarType dtype) { return std::string(c10::getDtypeNames(dtype).first); }

template <typename I>
void deal(const I* ids, int64_t n, const int64_t* holders, int64_t width, const int64_t* replicas,
          int64_t experts, int64_t servers, int64_t* out) {
  std::vector<int64_t> count(experts, 0), load(servers, 0);
  int64_t offset = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t e = ids[i];
    if (e < 0) continue;
    TORCH_CHECK_VALUE(e < experts, "expert id ", e, " at entry ", i, " is not below ", experts,
                      " (the routing table's experts)");
    ++count[e];
    offset += e;
  }
  for (int64_t e = 0; e < experts; ++e) {  // 1. single holders
    const int64_t h = holders[e * width];
    if (replicas[e] == 1 && count[e] && h >= 0) load[h] += count[e];
  }
  // 2. deal: the replicated experts with entries, most entries first (ids ascending among
  // equals: a stable sort of ascending ids); the experts dealing in round q are a prefix
  std::vector<int64_t> order, first(experts, 0);
  int64_t valid = 0;
  for (int64_t e = 0; e < experts; ++e) {
    first[e] = valid;  // expert e's dealt entries: dealt[first[e] + q]
    valid += count[e];
    if (replicas[e] > 1 && count[e]) order.push_back(e);
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return count[a] > count[b]; });
  std::vector<int64_t> dealt(valid);
  for (int64_t q = 0; !order.empty() && q < count[order[0]]; ++q) {
    for (const int64_t e : order) {
      if (count[e] <= q) break;
      const int64_t r = replicas[e];
      const int64_t* row = holders + e * width;
      const int64_t start = (offset + e) % r;
      int64_t best = start;
      for (int64_t step = 1; step < r; ++step) {
        const int64_t j = (start + step) % r;
        if (load[row[j]] < load[row[best]]) best = j;
      }
      dealt[first[e] + q] = row[best];
      ++load[row[best]];
    }
  }
  // 3. place: the q-th entry of an expert where its q-th dealt entry went
  std::vector<int64_t> seen(experts, 0);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t e = ids[i];
    if (e < 0) {
      out[i] = -1;
    } else if (replicas[e] == 1) {
      out[i] = holders[e * width];
    } else {
      out[i] = dealt[first[e] + seen[e]++];
    }
  }
}

at::Tensor deal_entries(const at::Tensor& ids, const at::Tensor& holders,
                        const at::Tensor& replicas, int64_t num_servers) {
  TORCH_CHECK_VALUE(ids.scalar_type() == at::kInt || ids.scalar_type() == at::kLong,
                    "ids must be int32 or int64, got ", name(ids.scalar_type()));
  TORCH_CHECK_VALUE(holders.dim() == 2 && holders.scalar_type() == at::kLong,
                    "holders must be int64 [E, W], got ", name(holders.scalar_type()), " ",
                    holders.sizes());
  TORCH_CHECK_VALUE(replicas.dim() == 1 && replicas.size(0) == holders.size(0) &&
                        replicas.scalar_type() == at::kLong,
                    "replicas must be int64 [E] = [", holders.size(0), "], got ",
                    name(replicas.scalar_type()), " ", replicas.sizes());
  TORCH_CHECK_VALUE(ids.device().is_cpu() && holders.device().is_cpu() &&
                        replicas.device().is_cpu(),
                    "ids, holders and replicas must be CPU tensors");
  const int64_t experts = holders.size(0), width = holders.size(1);
  const at::Tensor h = holders.contiguous(), r = replicas.contiguous(), flat = ids.contiguous();
  const int64_t* hp = h.data_ptr<int64_t>();
  const int64_t* rp = r.data_ptr<int64_t>();
  for (int64_t e = 0; e < experts; ++e) {  // E reads: the table is small beside what it routes
    TORCH_CHECK_VALUE(rp[e] >= 1 && rp[e] <= width, "replicas[", e, "] = ", rp[e],
                      " is not in [1, ", width, "]");
    for (int64_t j = 0; j < rp[e]; ++j) {
      const int64_t s = hp[e * width + j];
      TORCH_CHECK_VALUE(s < num_servers && (s >= 0 || (s == -2 && rp[e] == 1)), "holders[", e,
                        ", ", j, "] = ", s, " is not a server index below ", num_servers);
    }
  }
  at::Tensor out = at::empty(ids.sizes(), ids.options().dtype(at::kLong));
  if (flat.scalar_type() == at::kInt) {
    deal(flat.data_ptr<int32_t>(), flat.numel(), hp, width, rp, experts, num_servers,
         out.data_ptr<int64_t>());
  } else {
    deal(flat.data_ptr<int64_t>(), flat.numel(), hp, width, rp, experts, num_servers,
         out.data_ptr<int64_t>());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sgl_kernel_ext_cpu, m) {
  m.def("deal_entries(Tensor ids, Tensor holders, Tensor replicas, int num_servers) -> Tensor");
}

TORCH_LIBRARY_IMPL(sgl_kernel_ext_cpu, CPU, m) {
  m.impl("deal_entries", &deal_entries);
}
