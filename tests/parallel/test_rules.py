"""Meshes and logical-axis sharding on 8 fake CPU devices: specs follow the rules table, QArray
shards hold whole blocks, and the sharded forward equals the single-device one."""

import functools

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from configs.tiny_arith import MESH_LAYOUTS
from trace_jax import models as M
from trace_jax import parallel as par
from trace_jax import quant as tq

CFG = M.tiny(num_layers=2)
# Sharding changes the per-device matmul shapes, hence the float32 accumulation order; nothing
# else differs (measured max |diff| ~3e-7 on logits of size ~1).
ATOL = 1e-5


@functools.lru_cache(maxsize=None)
def _params():
  return M.init_params(CFG, jax.random.key(0))


@functools.lru_cache(maxsize=None)
def _forward():
  return jax.jit(lambda p, t: M.forward(p, t, CFG))


def _tokens():
  return jax.random.randint(jax.random.key(1), (8, 12), 0, CFG.vocab_size)


def test_make_mesh_drops_size_one_axes_and_fills():
  mesh = par.make_mesh(par.MeshConfig(data=-1, expert=2))
  assert mesh.axis_names == ("data", "expert") and dict(mesh.shape) == {"data": 4, "expert": 2}
  one = par.make_mesh(par.MeshConfig())
  assert one.axis_names == ("data",) and one.devices.size == 1
  sub = par.make_mesh({"tensor": 2}, devices=jax.devices()[4:])
  assert [d.id for d in sub.devices.flat] == [d.id for d in jax.devices()[4:6]]
  with pytest.raises(ValueError, match="at most one"):
    par.MeshConfig(data=-1, fsdp=-1).resolve(8)
  with pytest.raises(ValueError, match="needs 16 devices"):
    par.make_mesh(par.MeshConfig(data=4, tensor=4))
  with pytest.raises(ValueError, match="do not divide"):
    par.MeshConfig(data=-1, expert=3).resolve(8)


def _expected_spec(path, ndim, mesh):
  """The spec straight from the rules table (no fallback needed for these shapes)."""
  axes = par.param_logical_axes(path, ndim)
  out = []
  for logical in axes:
    mesh_axes = [a for a in par.LOGICAL_RULES.get(logical, ()) if par.axis_size(mesh, a) > 1]
    out.append(None if not mesh_axes else mesh_axes[0])
  return jax.sharding.PartitionSpec(*out)


def test_param_and_optimizer_specs_follow_the_rules():
  mesh = par.make_mesh(MESH_LAYOUTS["fsdp2_expert2_tensor2"])
  params = _params()
  sh = par.param_shardings(params, mesh)
  e = sh["layers_0"]["moe"]["experts"]
  assert e["gate_up_proj"].spec == P("expert", "fsdp", "tensor")
  assert e["down_proj"].spec == P("expert", "tensor", "fsdp")
  assert sh["layers_1"]["attn"]["o_proj"]["kernel"].spec == P("tensor", "fsdp")
  assert sh["embed"]["embedding"].spec == P("tensor", "fsdp")
  for path, s in jax.tree_util.tree_leaves_with_path(sh):
    x = params
    for k in path:
      x = x[k.key]
    assert s.spec == _expected_spec(par.rules.path_str(path), x.ndim, mesh), path
  # AdamW moments shard exactly like the parameters they mirror; the step count is replicated.
  opt_state = optax.adamw(1e-3).init(params)
  osh = par.param_shardings(opt_state, mesh)
  assert jax.tree_util.tree_map(lambda s: s.spec, osh[0].mu) == jax.tree_util.tree_map(
      lambda s: s.spec, sh)
  assert osh[0].count.spec == P()


def test_fsdp_falls_back_to_the_largest_divisible_axis():
  mesh = par.make_mesh(dict(fsdp=8))
  # embed dim 12 does not divide by 8; the [12, 64] kernel's other dim (64) takes fsdp.
  spec = par.logical_to_spec(("embed", "heads"), mesh, (12, 64), "w", fsdp_fallback=True)
  assert spec == P(None, "fsdp")
  assert par.logical_to_spec(("embed",), mesh, (12,), "n", fsdp_fallback=True) == P(None)
  with pytest.raises(ValueError, match=r"cannot shard w .*dimension 0 \(embed, size 12\)"):
    par.logical_to_spec(("embed", "heads"), mesh, (12, 64), "w")


def test_qarray_shards_hold_whole_blocks_and_decode_identically():
  policy = tq.make_policy("paper", "nvfp4")
  q = jax.jit(M.quantize_params, static_argnums=1)(_params(), policy)
  mesh = par.make_mesh(dict(expert=4, tensor=2))
  qs = par.shard_params(q, mesh)
  dn = qs["layers_0"]["moe"]["experts"]["down_proj"]  # [E, F, D] blocks along F (tensor)
  assert dn.codes.sharding.spec == P("expert", "tensor", None)
  assert dn.global_scale.sharding.spec == P("expert", None, None)  # per-expert g: [E, 1, 1]
  for c, s in zip(dn.codes.addressable_shards, dn.scales.addressable_shards):
    # The shard's codes are exactly its scales' blocks: 2 codes per byte, 16 per block.
    assert c.data.shape[1] * 2 == s.data.shape[1] * dn.fmt.block
    start_code = c.index[1].start or 0
    start_scale = s.index[1].start or 0
    assert start_code * 2 == start_scale * dn.fmt.block
  is_q = lambda x: isinstance(x, tq.QArray)  # noqa: E731
  decode = jax.jit(lambda t: [tq.dequantize(x) for x in jax.tree_util.tree_leaves(t, is_leaf=is_q)
                              if is_q(x)])
  for a, b in zip(decode(q), decode(qs)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # 32 ffn rows = 2 NVFP4 blocks: a 4-way tensor axis would cut blocks in half.
  with pytest.raises(ValueError, match=r"down_proj.*2 quantization blocks of 16.*'tensor'"):
    par.param_shardings(q, par.make_mesh(dict(tensor=4)))


# data8 and fsdp8 are also exercised by the train-step and expert tests: slow here (CI time).
@pytest.mark.parametrize("layout", [
    pytest.param(name, marks=pytest.mark.slow) if name in ("data8", "fsdp8") else name
    for name in sorted(MESH_LAYOUTS)])
def test_sharded_forward_equals_single_device(layout):
  mesh = par.make_mesh(MESH_LAYOUTS[layout])
  tokens = _tokens()
  ref = _forward()(_params(), tokens)
  out = _forward()(par.shard_params(_params(), mesh),
                   jax.device_put(tokens, par.batch_shardings(tokens, mesh)))
  assert len(out.sharding.device_set) == 8
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=0, atol=ATOL)


@pytest.mark.slow  # ~15 s of compiles; the sharded rollout engine test covers FP4 compute by default
def test_sharded_fp4_prefill_with_kv_cache_equals_single_device():
  """Rollout forward: QArray weights, FP4 KV cache, sharded over data, expert and tensor."""
  policy = tq.make_policy("paper", "nvfp4")
  ctx = M.QuantContext(policy, "rollout")
  q = M.quantize_params(_params(), policy)
  tokens = _tokens()

  @jax.jit
  def run(p, tokens, cache):
    out = M.apply(p, tokens, CFG, ctx, cache=cache, cache_index=0)
    assert isinstance(out.cache.layers[0].k, tq.QArray)
    return out.logits, [tq.dequantize(l.k) for l in out.cache.layers]

  cache = M.init_cache(CFG, 8, 16, policy.kv_format)
  ref = run(q, tokens, cache)
  mesh = par.make_mesh(dict(data=2, expert=2, tensor=2))
  out = run(par.shard_params(q, mesh), jax.device_put(tokens, par.batch_shardings(tokens, mesh)),
            jax.device_put(cache, par.cache_shardings(cache, mesh)))
  k = jax.device_put(cache, par.cache_shardings(cache, mesh)).layers[0].k
  assert k.codes.sharding.spec == P(("data", "expert"), None, "tensor", None)
  for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(ref)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=ATOL)
