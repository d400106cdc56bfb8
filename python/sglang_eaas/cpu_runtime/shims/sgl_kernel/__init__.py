"""Pure-torch stand-in for the CPU build of sgl-kernel, which is not published on PyPI.

SGLang 0.5.23 imports these names at module level when its CPU engine is on. Only
``assign_req_to_token_pool_cpu`` is called while serving a plain (non-speculative) model on a CPU
without AMX; the others raise ``NotImplementedError`` if a feature that needs them is used.
No ``torch.ops.sgl_kernel`` op is registered, so SGLang's AMX paths stay off.
"""

import torch

__version__ = "0.0.0+sglang_eaas.cpu_shim"


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Write each request's new KV-cache slots: ``req_to_token[r, s:e] = out_cache_loc[...]``."""
    pos = 0
    for r, s, e in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        n = e - s
        if n > 0:
            req_to_token[r, s:e] = out_cache_loc[pos : pos + n].to(req_to_token.dtype)
        pos += n


def _unimplemented(name: str):
    def fn(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} has no CPU stand-in in sglang-eaas (speculative decoding and "
            "hybrid/linear-attention models need the real CPU sgl-kernel build)"
        )

    fn.__name__ = name
    return fn


copy_all_layer_kv_cache_cpu = _unimplemented("copy_all_layer_kv_cache_cpu")
fill_accept_out_cache_loc_cpu = _unimplemented("fill_accept_out_cache_loc_cpu")
fill_bonus_tokens_cpu = _unimplemented("fill_bonus_tokens_cpu")
assign_draft_cache_locs_contiguous_cpu = _unimplemented("assign_draft_cache_locs_contiguous_cpu")
assign_extend_cache_locs_cpu = _unimplemented("assign_extend_cache_locs_cpu")
build_tree_kernel_efficient_cpu = _unimplemented("build_tree_kernel_efficient_cpu")
verify_tree_greedy_cpu = _unimplemented("verify_tree_greedy_cpu")
rotate_input_ids_cpu = _unimplemented("rotate_input_ids_cpu")
