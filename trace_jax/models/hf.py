"""Hugging Face checkpoint import/export: `config.json` + (sharded) `*.safetensors`.

Layouts: Qwen3-MoE (`mlp.experts.{j}.{gate,up,down}_proj`, `mlp.gate`), Mixtral
(`block_sparse_moe.experts.{j}.w1/w3/w2`, `block_sparse_moe.gate`) and OLMoE (Qwen3-like names,
QK-norm over the whole projection). Per-expert tensors are read as written on disk.

The safetensors files are memory-mapped and parsed here (the format is an 8-byte header length,
a JSON header, raw little-endian bytes), so a tensor is read straight from the page cache into
its destination array: one host copy of the model at most, bf16 included, no torch needed.
Every expected tensor is checked against the headers before anything is loaded: a missing,
unexpected or wrongly shaped tensor gets an error naming it.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Iterable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from trace_jax import quant as tq
from trace_jax.models.config import ModelConfig, from_hf_config, to_hf_config

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_, "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


class CheckpointError(ValueError):
  """A checkpoint that does not match its config (or is malformed)."""


# --------------------------------------------------------------------------- safetensors I/O

class SafetensorsFile:
  """A memory-mapped safetensors file: `header[name] = (dtype, shape, (begin, end))`."""

  def __init__(self, path: str):
    self.path = path
    with open(path, "rb") as f:
      raw = f.read(8)
      if len(raw) != 8:
        raise CheckpointError(f"{path}: not a safetensors file (shorter than 8 bytes)")
      (n,) = struct.unpack("<Q", raw)
      try:
        header = json.loads(f.read(n))
      except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: corrupt safetensors header: {e}") from None
    self.data_start = 8 + n
    header.pop("__metadata__", None)
    self.header = {}
    for name, info in header.items():
      if info["dtype"] not in _DTYPES:
        raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
      self.header[name] = (info["dtype"], tuple(info["shape"]), tuple(info["data_offsets"]))
    self._mm = None

  def get(self, name: str) -> np.ndarray:
    """A read-only view into the mapped file (no copy until the caller converts it)."""
    if self._mm is None:
      self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
    dtype, shape, (b, e) = self.header[name]
    buf = self._mm[self.data_start + b: self.data_start + e]
    return buf.view(_DTYPES[dtype]).reshape(shape)


def write_safetensors(path: str, tensors: dict[str, np.ndarray], metadata=None) -> None:
  header, offset = {}, 0
  for name, arr in tensors.items():
    dt = np.dtype(arr.dtype)
    if dt not in _NAMES:
      raise CheckpointError(f"cannot write tensor {name!r} of dtype {dt} to safetensors")
    header[name] = dict(dtype=_NAMES[dt], shape=list(arr.shape),
                        data_offsets=[offset, offset + arr.nbytes])
    offset += arr.nbytes
  if metadata:
    header["__metadata__"] = metadata
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * ((-len(blob)) % 8)  # align the data section to 8 bytes
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(blob)))
    f.write(blob)
    for arr in tensors.values():
      f.write(np.ascontiguousarray(arr).tobytes())


# --------------------------------------------------------------------------- name mapping

def _expert_names(cfg: ModelConfig, i: int, j: int) -> tuple[str, str, str]:
  """(gate, up, down) HF names of expert j in layer i."""
  if cfg.layout == "mixtral":
    p = f"model.layers.{i}.block_sparse_moe.experts.{j}"
    return f"{p}.w1.weight", f"{p}.w3.weight", f"{p}.w2.weight"
  p = f"model.layers.{i}.mlp.experts.{j}"
  return f"{p}.gate_proj.weight", f"{p}.up_proj.weight", f"{p}.down_proj.weight"


def _router_name(cfg: ModelConfig, i: int) -> str:
  mod = "block_sparse_moe" if cfg.layout == "mixtral" else "mlp"
  return f"model.layers.{i}.{mod}.gate.weight"


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
  """Every HF tensor name the config implies, with its on-disk shape ([out, in] for linears)."""
  d, hd, f = cfg.hidden_size, cfg.head_dim, cfg.moe_ffn_size
  t = {"model.embed_tokens.weight": (cfg.vocab_size, d), "model.norm.weight": (d,)}
  if not cfg.tie_embeddings:
    t["lm_head.weight"] = (cfg.vocab_size, d)
  for i in range(cfg.num_layers):
    p = f"model.layers.{i}"
    t[f"{p}.input_layernorm.weight"] = (d,)
    t[f"{p}.post_attention_layernorm.weight"] = (d,)
    for proj, out in (("q", cfg.num_heads * hd), ("k", cfg.num_kv_heads * hd),
                      ("v", cfg.num_kv_heads * hd)):
      t[f"{p}.self_attn.{proj}_proj.weight"] = (out, d)
      if cfg.attention_bias:
        t[f"{p}.self_attn.{proj}_proj.bias"] = (out,)
    t[f"{p}.self_attn.o_proj.weight"] = (d, cfg.num_heads * hd)
    if cfg.attention_bias:
      t[f"{p}.self_attn.o_proj.bias"] = (d,)
    if cfg.qk_norm == "head":
      t[f"{p}.self_attn.q_norm.weight"] = (hd,)
      t[f"{p}.self_attn.k_norm.weight"] = (hd,)
    elif cfg.qk_norm == "full":
      t[f"{p}.self_attn.q_norm.weight"] = (cfg.num_heads * hd,)
      t[f"{p}.self_attn.k_norm.weight"] = (cfg.num_kv_heads * hd,)
    if cfg.is_moe_layer(i):
      t[_router_name(cfg, i)] = (cfg.num_experts, d)
      for j in range(cfg.num_experts):
        g, u, dn = _expert_names(cfg, i, j)
        t[g], t[u], t[dn] = (f, d), (f, d), (d, f)
    else:
      ff = cfg.dense_ffn_size
      t[f"{p}.mlp.gate_proj.weight"] = (ff, d)
      t[f"{p}.mlp.up_proj.weight"] = (ff, d)
      t[f"{p}.mlp.down_proj.weight"] = (d, ff)
  return t


# --------------------------------------------------------------------------- load

def _open_checkpoint(path: str) -> dict[str, SafetensorsFile]:
  """name -> the file holding it, from the index file or by scanning `*.safetensors`."""
  index = os.path.join(path, "model.safetensors.index.json")
  files: dict[str, SafetensorsFile] = {}
  where: dict[str, SafetensorsFile] = {}
  if os.path.exists(index):
    with open(index) as f:
      weight_map = json.load(f)["weight_map"]
    for name, fname in weight_map.items():
      if fname not in files:
        fp = os.path.join(path, fname)
        if not os.path.exists(fp):
          raise CheckpointError(f"{index} names shard {fname!r} (for tensor {name!r}), which "
                                "does not exist")
        files[fname] = SafetensorsFile(fp)
      if name not in files[fname].header:
        raise CheckpointError(f"{index} places tensor {name!r} in {fname}, which lacks it")
      where[name] = files[fname]
    return where
  shards = sorted(fn for fn in os.listdir(path) if fn.endswith(".safetensors"))
  if not shards:
    raise CheckpointError(f"no *.safetensors files in {path}")
  for fn in shards:
    st = SafetensorsFile(os.path.join(path, fn))
    for name in st.header:
      if name in where:
        raise CheckpointError(f"tensor {name!r} appears in both {where[name].path} and {fn}")
      where[name] = st
  return where


def _validate(where: dict[str, SafetensorsFile], cfg: ModelConfig, path: str) -> None:
  want = expected_tensors(cfg)
  have = {n: st.header[n][1] for n, st in where.items()}
  missing = sorted(set(want) - set(have))
  extra = sorted(set(have) - set(want) - ({"lm_head.weight"} if cfg.tie_embeddings else set()))
  extra = [n for n in extra if not n.endswith("rotary_emb.inv_freq")]
  wrong = sorted(n for n in set(want) & set(have) if tuple(have[n]) != tuple(want[n]))
  problems = []
  if missing:
    problems.append(f"missing tensors: {_few(missing)}")
  if extra:
    problems.append(f"unexpected tensors: {_few(extra)}")
  if wrong:
    problems.append("wrong shapes: " + _few(f"{n} is {tuple(have[n])}, config implies "
                                             f"{tuple(want[n])}" for n in wrong))
  if problems:
    raise CheckpointError(f"checkpoint {path} does not match its config.json: "
                          + "; ".join(problems))


def _few(items: Iterable[str], k: int = 5) -> str:
  items = list(items)
  more = f" (and {len(items) - k} more)" if len(items) > k else ""
  return ", ".join(items[:k]) + more


def _finite(name: str, a: np.ndarray) -> np.ndarray:
  if a.dtype.kind == "f" or a.dtype == ml_dtypes.bfloat16:
    if not np.all(np.isfinite(a.astype(np.float32))):
      raise CheckpointError(f"tensor {name!r} holds NaN or Inf")
  return a


def load_hf_checkpoint(path: str, dtype=jnp.float32, check_finite: bool = True,
                       progress: bool = False, on_host: bool = False
                       ) -> tuple[ModelConfig, dict]:
  """Read an HF checkpoint directory into `(ModelConfig, params)`.

  dtype: the parameters' dtype (float32 master weights by default; bfloat16 halves memory).
  Tensors are copied one at a time from the memory-mapped files into their destination arrays
  (experts are stacked into `[E, D, 2F]` / `[E, F, D]` without an intermediate copy).
  on_host: numpy leaves in host memory (views of the mapped files where no conversion is
  needed), nothing on the device: `RolloutEngine.sync` makes FP4 rollout weights from them
  layer by layer, so a model whose master does not fit on the device beside them can serve.
  """
  path = os.path.abspath(os.path.expanduser(path))
  cfg_path = os.path.join(path, "config.json")
  if not os.path.exists(cfg_path):
    raise CheckpointError(f"{path} has no config.json")
  with open(cfg_path) as f:
    hf_cfg = json.load(f)
  cfg = from_hf_config(hf_cfg, dtype="bfloat16" if jnp.dtype(dtype) == jnp.bfloat16
                       else "float32")
  where = _open_checkpoint(path)
  _validate(where, cfg, path)
  np_dtype = np.dtype(jnp.dtype(dtype))

  def get(name):
    a = where[name].get(name)
    return _finite(name, a) if check_finite else a

  def put(a: np.ndarray) -> jax.Array | np.ndarray:
    a = a.astype(np_dtype, copy=False)
    return a if on_host else jnp.asarray(a)

  layers = range(cfg.num_layers)
  if progress:
    from tqdm import tqdm
    layers = tqdm(layers, desc="loading layers", unit="layer")
  params: dict = {"embed": {"embedding": put(get("model.embed_tokens.weight"))},
                  "final_norm": {"scale": put(get("model.norm.weight"))}}
  if not cfg.tie_embeddings:
    params["lm_head"] = {"kernel": put(get("lm_head.weight").T)}
  d, f = cfg.hidden_size, cfg.moe_ffn_size
  for i in layers:
    p = f"model.layers.{i}"
    attn = {}
    for proj in ("q", "k", "v", "o"):
      attn[f"{proj}_proj"] = {"kernel": put(get(f"{p}.self_attn.{proj}_proj.weight").T)}
      if cfg.attention_bias:
        attn[f"{proj}_proj"]["bias"] = put(get(f"{p}.self_attn.{proj}_proj.bias"))
    if cfg.qk_norm != "none":
      attn["q_norm"] = {"scale": put(get(f"{p}.self_attn.q_norm.weight"))}
      attn["k_norm"] = {"scale": put(get(f"{p}.self_attn.k_norm.weight"))}
    layer = {"input_norm": {"scale": put(get(f"{p}.input_layernorm.weight"))},
             "post_attn_norm": {"scale": put(get(f"{p}.post_attention_layernorm.weight"))},
             "attn": attn}
    if cfg.is_moe_layer(i):
      gate_up = np.empty((cfg.num_experts, d, 2 * f), np_dtype)
      down = np.empty((cfg.num_experts, f, d), np_dtype)
      for j in range(cfg.num_experts):
        g, u, dn = _expert_names(cfg, i, j)
        gate_up[j, :, :f] = get(g).T
        gate_up[j, :, f:] = get(u).T
        down[j] = get(dn).T
      layer["moe"] = {"router": {"kernel": put(get(_router_name(cfg, i)).T)},
                      "experts": {"gate_up_proj": put(gate_up), "down_proj": put(down)}}
      del gate_up, down
    else:
      layer["mlp"] = {n: {"kernel": put(get(f"{p}.mlp.{n}.weight").T)}
                      for n in ("gate_proj", "up_proj", "down_proj")}
    params[f"layers_{i}"] = layer
  return cfg, params


# --------------------------------------------------------------------------- save

def _to_numpy(a, np_dtype) -> np.ndarray:
  if isinstance(a, tq.QArray):
    a = tq.dequantize(a, jnp.float32)
  return np.asarray(jax.device_get(a)).astype(np_dtype)


def hf_tensors(params: dict, cfg: ModelConfig, dtype=np.float32):
  """Yield `(hf_name, array)` for every tensor of `params` in `cfg.layout` (QArrays are
  dequantized), one at a time."""
  dt = np.dtype(dtype)
  yield "model.embed_tokens.weight", _to_numpy(params["embed"]["embedding"], dt)
  yield "model.norm.weight", _to_numpy(params["final_norm"]["scale"], dt)
  if not cfg.tie_embeddings:
    yield "lm_head.weight", _to_numpy(params["lm_head"]["kernel"], dt).T
  f = cfg.moe_ffn_size
  for i in range(cfg.num_layers):
    p, lp = f"model.layers.{i}", params[f"layers_{i}"]
    yield f"{p}.input_layernorm.weight", _to_numpy(lp["input_norm"]["scale"], dt)
    yield f"{p}.post_attention_layernorm.weight", _to_numpy(lp["post_attn_norm"]["scale"], dt)
    for proj in ("q", "k", "v", "o"):
      yield f"{p}.self_attn.{proj}_proj.weight", _to_numpy(lp["attn"][f"{proj}_proj"]["kernel"], dt).T
      if cfg.attention_bias:
        yield f"{p}.self_attn.{proj}_proj.bias", _to_numpy(lp["attn"][f"{proj}_proj"]["bias"], dt)
    if cfg.qk_norm != "none":
      yield f"{p}.self_attn.q_norm.weight", _to_numpy(lp["attn"]["q_norm"]["scale"], dt)
      yield f"{p}.self_attn.k_norm.weight", _to_numpy(lp["attn"]["k_norm"]["scale"], dt)
    if cfg.is_moe_layer(i):
      yield _router_name(cfg, i), _to_numpy(lp["moe"]["router"]["kernel"], dt).T
      gu = _to_numpy(lp["moe"]["experts"]["gate_up_proj"], dt)
      dn = _to_numpy(lp["moe"]["experts"]["down_proj"], dt)
      for j in range(cfg.num_experts):
        g, u, d = _expert_names(cfg, i, j)
        yield g, np.ascontiguousarray(gu[j, :, :f].T)
        yield u, np.ascontiguousarray(gu[j, :, f:].T)
        yield d, np.ascontiguousarray(dn[j].T)
    else:
      for n in ("gate_proj", "up_proj", "down_proj"):
        yield f"{p}.mlp.{n}.weight", _to_numpy(lp["mlp"][n]["kernel"], dt).T


def save_hf_checkpoint(path: str, params: dict, cfg: ModelConfig, dtype="float32",
                       max_shard_bytes: int = 4 << 30) -> None:
  """Write `config.json`, `model-XXXXX-of-YYYYY.safetensors` shards and the index file so the
  directory loads in `transformers` (`AutoModelForCausalLM.from_pretrained`)."""
  np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(to_hf_config(cfg, torch_dtype=str(dtype)), f, indent=2)
  # Shards are written as they fill (one shard in memory at a time) under temporary names,
  # then renamed once their count is known.
  written: list[tuple[str, list[str]]] = []
  shard: dict[str, np.ndarray] = {}
  size = total = 0

  def flush():
    tmp = os.path.join(path, f".shard-{len(written):05d}.tmp")
    write_safetensors(tmp, shard, metadata={"format": "pt"})
    written.append((tmp, list(shard)))

  for name, arr in hf_tensors(params, cfg, np_dtype):
    if shard and size + arr.nbytes > max_shard_bytes:
      flush()
      shard, size = {}, 0
    shard[name] = np.ascontiguousarray(arr)
    size += arr.nbytes
    total += arr.nbytes
  flush()
  n = len(written)
  weight_map = {}
  for k, (tmp, names) in enumerate(written):
    fname = "model.safetensors" if n == 1 else f"model-{k + 1:05d}-of-{n:05d}.safetensors"
    os.replace(tmp, os.path.join(path, fname))
    weight_map.update({name: fname for name in names})
  if n > 1:
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
      json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
