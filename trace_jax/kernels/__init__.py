"""Matmul and attention entry points the model calls, with pure-`jnp` references that define
their results.

`matmul(x, w)` and `grouped_matmul(x, w, group_sizes)` accept plain arrays, FP4 `QArray`
weights (and FP4 `QArray` activations for W4A4), or FP4 weights in the kernel layout
(`PackedWeight`, made once at weight sync by `prepare_weight(qarray)`, or for a whole parameter
tree by `prepare_tree(params)`). Dispatch: on a GPU backend with a `PackedWeight`, the Pallas
Mosaic GPU kernel (`fp4_mgpu.py`); on a GPU otherwise the XLA path (bf16 decode, tokamax or XLA
grouped matmul); on CPU the reference in `reference.py`.

Which GPUs: the kernels (here "on GPU") run on NVIDIA Hopper GPUs (compute capability 9.0),
the architecture they were written and checked for (`kernels_on`). On any other GPU (Ampere,
Ada, Blackwell, ROCm) every call takes the XLA path, which the kernels are checked against, so
results agree with a Hopper's to rounding; `TRACE_JAX_KERNELS=on` tries the kernels on any GPU,
`=off` keeps them off everywhere.

`decode_attention(q, k, v, valid)` (one query token over a bf16/FP8/FP4 KV cache): on GPU the
Mosaic NVFP4 kernel of `attention_mgpu.py` where it applies, else the Pallas kernel of
`attention_pallas.py` (`TRACE_JAX_DECODE_ATTENTION=kernel|reference` choose otherwise), else
the reference `attention_ref.decode_attention_ref`. `prefill_attention(q, k, v, key_mask,
q_start)` (a prompt's tokens over the cache that holds them): on GPU the flash-style Pallas
kernel of `attention_pallas.py` (`TRACE_JAX_PREFILL_ATTENTION=reference` opts out), else
`prefill_attention_ref`. `attention` is the model's attention formula itself.

Rollout glue as Pallas kernels on the GPU by default (`TRACE_JAX_KV_APPEND=xla`,
`TRACE_JAX_ROW_QUANT=xla`, `TRACE_JAX_ROW_QUANT_OPERAND=xla`, `TRACE_JAX_SWIGLU_QUANT=xla` opt
out; bit-exact against numpy-checked XLA paths in interpret mode and on the H200): `append_kv`
writes a decode step's NVFP4 K/V rows into the cache (`kv_append.py`), `quantize_rows`
quantizes an activation site (`row_quant.py`; `quantize_rows_to_operand` also lays the value
out as the expert kernel's operand, each token's row at its pairs' sorted rows),
`swiglu_quantize_rows` makes the expert down input (SwiGLU, its site's codes and the down
kernel's operand) from the gate/up kernel's rows left ungathered (`ChunkRows`,
`swiglu_quant.py`), `topk_gates` makes a router's gates in one kernel (`router_topk.py`,
`TRACE_JAX_ROUTER_TOPK=xla` opts out; opt-in `router_gates` sums the router product's split-K
parts there too, `TRACE_JAX_ROUTER_SUM=kernel`), `decode_qkv` makes a decode step's q (norm, rope,
the Mosaic attention's head_dim order) and writes its K/V rows in one kernel
(`qkv_append.py`, `TRACE_JAX_DECODE_QKV=xla` opts out), `add_rms_norm` a decode step's
residual adds and the norms after them (`add_norm.py`, `TRACE_JAX_ADD_NORM=xla`),
`combine_add_rms_norm` the MoE's output (its gates' weighted sum of the down kernel's
rows, left there where `combine_in_kernel`), the residual add and the next norm
(`moe_combine.py`, `TRACE_JAX_MOE_COMBINE=xla`); each returns None where the XLA path
applies.
`sort_by_group` / `count_by_group` (or `route`, with the FP4 grouped kernel's chunk
tables) build the MoE routing tables; `float32_dot` computes the router's logits (a batch-1 row
as a two-row product on the GPU, as the bf16 XLA path does).
"""

from trace_jax.kernels.attention_ref import attention, decode_attention_ref, prefill_attention_ref
from trace_jax.kernels.dispatch import (add_rms_norm, append_kv,
                                        combine_add_rms_norm, combine_in_kernel, count_by_group,
                                        norm_rows_padded,
                                        decode_attention,
                                        decode_qkv, float32_dot, grouped_backend, grouped_matmul,
                                        import_gpu_libraries, kernels_on, kv_packing,
                                        matmul, on_gpu,
                                        prefill_attention, quantize_rows,
                                        quantize_rows_to_operand, route, router_gates,
                                        sort_by_group, swiglu_quantize_rows, topk_gates)
from trace_jax.kernels.layout import (ChunkRows, KParts, OperandRows, PackedWeight, PaddedRows,
                                      decode_packed,
                                      fuse_projections, prepare_tree, prepare_weight)
from trace_jax.kernels.repeatable_gather import take_copies, take_rows

__all__ = ["ChunkRows", "KParts", "OperandRows", "PackedWeight", "PaddedRows", "add_rms_norm",
           "append_kv", "attention",
           "combine_add_rms_norm", "combine_in_kernel", "count_by_group", "decode_attention",
           "decode_qkv",
           "decode_attention_ref", "decode_packed", "float32_dot", "fuse_projections",
           "grouped_backend",
           "grouped_matmul", "import_gpu_libraries", "kernels_on", "kv_packing", "matmul",
           "norm_rows_padded", "on_gpu", "prefill_attention", "prefill_attention_ref",
           "prepare_tree",
           "prepare_weight", "quantize_rows", "quantize_rows_to_operand", "route",
           "router_gates", "sort_by_group", "swiglu_quantize_rows", "take_copies", "take_rows",
           "topk_gates"]
