"""A MoE router's gates as one Pallas kernel: from the router's float32 logits, the softmax over
experts, the top-k experts of each token and their gate weights (renormalized over the k where
the model says so).

Owns the kernel, its support check, its wrapper and its reference. The reference is the model's
own XLA ops (`topk_gates_ref`: `nn.softmax`, `lax.top_k`, the renormalization). The kernel
gives the same experts, ties to the lower index as `lax.top_k` gives them. Its weights agree to
rounding: its exponential and sums are Triton's, and the summation orders are not XLA's (tests
state the tolerance). In the 8k-capacity decode step (B 256, 128 experts, top-8) XLA's
ops are three kernels a layer (softmax, a sort-based top-k, the weights' convert; ~7.5 us a
layer on the H200, session 37's profile); this is one.

The GPU default (`dispatch.topk_gates`; `TRACE_JAX_ROUTER_TOPK=xla` opts out). On the H200
(session 38) the 4-layer decode step's kernels at that shape took 1.603 ms with it against 1.629
without, 147 kernels a step against 151; the experts equal XLA's, 3 of 2,048 weights differ by
a few float32 ulps (2.8e-7 relative at most).

The router's product inside this kernel (`router_gates`, sessions 39-45) is gone: on an H100
at B 255 it took 37 us a layer against 9.6 for XLA's bf16 product and this kernel, and its
weights were 6.4e-5 from float64 gates against XLA's 5.1e-6 (session 45, stage s45a; its code:
benchmarks/results/session45_h200_2026-12-05/router_gates.patch).

Lowering: a portable Pallas body, `interpret=True` on CPU, the Triton lowering on the GPU (as
`row_quant`). The top-k is k rounds of a row maximum, each taking the lowest index that holds
it and masking it out: the Triton lowering sorts no register arrays.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from trace_jax.kernels import row_quant as RQ
from trace_jax.kernels.attention_pallas import _pow2_at_least
from trace_jax.settings import int_setting

# Tokens a program takes (a power of two; `TRACE_JAX_ROUTER_TOPK_ROWS`): at B 256 16 gives 16
# programs, 4.4 us a call in the H200's decode step (session 38), not tuned
# (checked where a call takes it, `_gates_call`)
ROWS = int_setting("TRACE_JAX_ROUTER_TOPK_ROWS", 16, minimum=1,
                   doc="rows a program of the router gates kernel")
NUM_WARPS = 4
MAX_EXPERTS = 1024


def kernel_supported(logits, k: int) -> str | None:
  """None if the kernel takes `logits` `[N, E]` (float32, E up to MAX_EXPERTS) and top-k."""
  if logits.ndim != 2 or logits.dtype != jnp.float32:
    return f"logits {logits.dtype}{list(logits.shape)}: the kernel takes float32 [N, E]"
  if not 0 < k <= logits.shape[1] <= MAX_EXPERTS:
    return f"top-{k} of {logits.shape[1]} experts (the kernel takes up to {MAX_EXPERTS})"
  return None


def _gates(x, ok, row_ok, col, w_ref, i_ref, *, r0: int, rows: int, e_pad: int, k: int,
           normalize: bool):
  """Inside a kernel body: the softmax of logits `x [rows, e_pad]` (-inf where not `ok`), its
  top-k and their (renormalized) weights, stored at the programs' rows."""
  plt = RQ.triton_primitives()
  # nn.softmax's formula: exp(x - max) / sum
  z = jnp.exp(x - jnp.max(x, axis=1, keepdims=True))
  p = jnp.where(ok, z / jnp.sum(z, axis=1, keepdims=True), -1.0)  # padding: below every prob
  vals, idxs = [], []
  for _ in range(k):
    v = jnp.max(p, axis=1)
    i = jnp.min(jnp.where(p == v[:, None], col[None, :], e_pad), axis=1)  # ties: lowest index
    vals.append(v)
    idxs.append(i)
    p = jnp.where(col[None, :] == i[:, None], -2.0, p)
  if normalize:
    total = functools.reduce(jnp.add, vals)
    vals = [v / total for v in vals]
  for j, (v, i) in enumerate(zip(vals, idxs)):
    plt.store(w_ref.at[pl.ds(r0, rows), jnp.int32(j)], v, mask=row_ok)
    plt.store(i_ref.at[pl.ds(r0, rows), jnp.int32(j)], i.astype(jnp.int32), mask=row_ok)


def _kernel(x_ref, w_ref, i_ref, *, n: int, e: int, e_pad: int, k: int, normalize: bool,
            rows: int):
  plt = RQ.triton_primitives()
  r0 = pl.program_id(0) * rows
  row_ok = (r0 + jnp.arange(rows)) < n
  col = jnp.arange(e_pad)
  ok = row_ok[:, None] & (col < e)[None, :]
  x = plt.load(x_ref.at[pl.ds(r0, rows), pl.ds(0, e_pad)], mask=ok, other=-jnp.inf)
  _gates(x, ok, row_ok, col, w_ref, i_ref, r0=r0, rows=rows, e_pad=e_pad, k=k,
         normalize=normalize)


def topk_gates(logits: jax.Array, k: int, *, normalize: bool, interpret: bool = False,
               num_warps: int = NUM_WARPS, rows: int = ROWS):
  """(weights float32 `[N, k]`, experts int32 `[N, k]`): each token's top-k experts by softmax
  probability, highest first, and their probabilities (divided by their sum with normalize).
  rows: tokens a program takes (a power of two)."""
  why = kernel_supported(logits, k)
  if why:
    raise ValueError(f"router top-k kernel: {why}")
  return _gates_call(_kernel, logits, e=logits.shape[1], k=k, normalize=normalize, rows=rows,
                     interpret=interpret, num_warps=num_warps, name="router_topk")


def _gates_call(kernel, *args, e: int, k: int, normalize: bool, rows: int, interpret: bool,
                num_warps: int, name: str, n_axis: int = 0, **kw):
  """Launch a gates kernel over the first arg's N rows (its axis n_axis), `rows` a program:
  (weights float32 `[N, k]`, experts int32 `[N, k]`)."""
  if rows < 1 or rows & (rows - 1):
    raise ValueError(f"{name} kernel: rows a program (by default TRACE_JAX_ROUTER_TOPK_ROWS) "
                     f"must be a power of two, got {rows}")
  n = args[0].shape[n_axis]
  out_shape = [jax.ShapeDtypeStruct((n, k), jnp.float32), jax.ShapeDtypeStruct((n, k), jnp.int32)]
  return RQ.launch(
      functools.partial(kernel, n=n, e=e, e_pad=_pow2_at_least(e, 16), k=k, normalize=normalize,
                        rows=rows, **kw),
      *args, programs=-(-n // rows), out_shape=out_shape, interpret=interpret,
      num_warps=num_warps, name=name)


def topk_gates_ref(logits: jax.Array, k: int, *, normalize: bool):
  """The model's ops: `nn.softmax`, `lax.top_k` (its values the weights), renormalized."""
  weights, idx = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), k)
  if normalize:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  return weights, idx


# The router's product as K parts (`router_parts`): K taken in chunks of this many, the parts
# summed by the gates kernel (`topk_gates_of_parts`) in place of XLA's reduction kernel
PART_K = 128
MAX_PARTS = 32
# Rows up to which the rollout takes the parts (`dispatch.router_gates`): decode batches. A
# prefill's parts are 16 float32 copies of its logits (H100, B 255 x 512-token prompts, 4
# layers: 181.0 against 177.9 ms of prefill kernels with them, session 45)
MAX_PARTS_ROWS = 4096


def router_parts(x: jax.Array, w: jax.Array, part_k: int = PART_K) -> jax.Array:
  """The router's float32 logits of bf16 x `[N, D]` and w `[D, E]` as D / part_k parts
  `[S, N, E]`, each a bf16 product with float32 accumulation over its part_k of D: one batched
  product for XLA (its own plain product of this shape is a split-K product of 16 parts and a
  reduction kernel, deviceless compile for the H200)."""
  why = parts_supported(x, w, 1, part_k)
  if why:
    raise ValueError(f"router parts: {why}")
  n, d = x.shape
  s = d // part_k
  return jnp.einsum("nsk,ske->sne", x.reshape(n, s, part_k), w.reshape(s, part_k, -1),
                    preferred_element_type=jnp.float32)


def parts_supported(x, w, k: int, part_k: int = PART_K) -> str | None:
  """None if `router_parts` and `topk_gates_of_parts` take bf16 `x [N, D]`, `w [D, E]`, top-k."""
  if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
    return f"x {list(x.shape)} and w {list(w.shape)}: the parts take [N, D] @ [D, E]"
  if x.dtype != jnp.bfloat16 or w.dtype != jnp.bfloat16:
    return f"x {x.dtype} and w {w.dtype}: the parts take bf16 (exact products in float32)"
  if x.shape[1] % part_k or not 0 < x.shape[1] // part_k <= MAX_PARTS:
    return f"model width {x.shape[1]}: the parts take 1-{MAX_PARTS} multiples of {part_k}"
  if x.shape[0] > MAX_PARTS_ROWS:
    return f"{x.shape[0]} rows: the parts take up to {MAX_PARTS_ROWS} (decode batches)"
  return kernel_supported(jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32), k)


def _parts_kernel(p_ref, w_ref, i_ref, *, n: int, e: int, e_pad: int, k: int, normalize: bool,
                  rows: int, parts: int):
  plt = RQ.triton_primitives()
  r0 = pl.program_id(0) * rows
  row_ok = (r0 + jnp.arange(rows)) < n
  col = jnp.arange(e_pad)
  ok = row_ok[:, None] & (col < e)[None, :]
  x = plt.load(p_ref.at[jnp.int32(0), pl.ds(r0, rows), pl.ds(0, e_pad)], mask=ok, other=0.0)
  for s in range(1, parts):  # in order: `sum_parts`' sum
    x = x + plt.load(p_ref.at[jnp.int32(s), pl.ds(r0, rows), pl.ds(0, e_pad)], mask=ok,
                     other=0.0)
  _gates(jnp.where(ok, x, -jnp.inf), ok, row_ok, col, w_ref, i_ref, r0=r0, rows=rows,
         e_pad=e_pad, k=k, normalize=normalize)


def sum_parts(parts: jax.Array) -> jax.Array:
  """The logits of `router_parts`' parts as `topk_gates_of_parts` sums them: in order, part 0
  first, in float32."""
  return functools.reduce(jnp.add, list(parts))


def topk_gates_of_parts(parts: jax.Array, k: int, *, normalize: bool, interpret: bool = False,
                        num_warps: int = NUM_WARPS, rows: int = ROWS):
  """`topk_gates` of the logits `sum_parts(parts)` (parts float32 `[S, N, E]`), the sum taken in
  the kernel: XLA's reduction of the router's split-K parts is not a kernel of its own."""
  if parts.ndim != 3 or not 0 < parts.shape[0] <= MAX_PARTS:
    raise ValueError(f"router top-k kernel: parts {list(parts.shape)}: it takes [S, N, E], S "
                     f"up to {MAX_PARTS}")
  why = kernel_supported(parts[0], k)
  if why:
    raise ValueError(f"router top-k kernel: {why}")
  return _gates_call(_parts_kernel, parts, e=parts.shape[2], k=k, normalize=normalize,
                     rows=rows, interpret=interpret, num_warps=num_warps,
                     name="router_topk_parts", parts=parts.shape[0], n_axis=1)
