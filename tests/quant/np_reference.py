"""Slow, independent numpy references for the formats (written from NUMERICS.md, not from the
library): brute-force nearest-grid search, loop-searched exponents, enumerated E4M3 values."""

import numpy as np

GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def e2m1_code(v: float) -> int:
  """Nearest E2M1 code by brute force, ties to the even code (= even mantissa), saturating."""
  a = min(abs(float(v)), 6.0)
  dists = [abs(a - g) for g in GRID]
  best = min(dists)
  cands = [i for i, d in enumerate(dists) if d == best]
  idx = cands[0] if len(cands) == 1 else [i for i in cands if i % 2 == 0][0]
  neg = np.signbit(np.float32(v))
  return idx | (8 if neg else 0)


def e2m1_value(code: int) -> float:
  return (-1.0 if code & 8 else 1.0) * GRID[code & 7]


def _e4m3_positive_values():
  vals = []
  for e in range(16):
    for m in range(8):
      if e == 15 and m == 7:
        continue  # NaN
      vals.append((m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0**(e - 7))
  return np.array(vals)  # index = code (bits e,m); sorted ascending


E4M3_POS = _e4m3_positive_values()


def e4m3_round(v: float) -> float:
  """Round a value in [0, 448] to E4M3, nearest with ties to even mantissa (even code)."""
  d = np.abs(E4M3_POS - v)
  best = d.min()
  idx = np.nonzero(d == best)[0]
  if len(idx) > 1:
    idx = [i for i in idx if i % 2 == 0]
  return float(E4M3_POS[idx[0]])


def e8m0_exp(amax: float, elem_max: float, rule: str) -> int:
  if amax == 0:
    return -127
  if rule == "ceil":
    e = -140
    while not amax <= elem_max * 2.0**e:
      e += 1
    return int(np.clip(e, -127, 127))
  emax_elem = int(np.floor(np.log2(elem_max)))
  return int(np.clip(int(np.floor(np.log2(amax))) - emax_elem, -127, 127))


def quantize_mx_rows(x: np.ndarray, block: int, rule: str, elem: str = "e2m1"):
  """x: (rows, K), K a multiple of block. Returns (codes or values, exps) per element/block."""
  rows, k = x.shape
  elem_max = 6.0 if elem == "e2m1" else 448.0
  out = np.zeros_like(x, dtype=np.float64)
  codes = np.zeros(x.shape, dtype=np.int64)
  exps = np.zeros((rows, k // block), dtype=np.int64)
  for r in range(rows):
    for b in range(k // block):
      blk = x[r, b * block:(b + 1) * block].astype(np.float64)
      e = e8m0_exp(float(np.max(np.abs(blk))), elem_max, rule)
      exps[r, b] = e
      for j, v in enumerate(blk):
        z = v / 2.0**e
        if elem == "e2m1":
          c = e2m1_code(z)
          codes[r, b * block + j] = c
          out[r, b * block + j] = e2m1_value(c) * 2.0**e
        else:
          zc = float(np.clip(z, -448, 448))
          out[r, b * block + j] = np.sign(zc) * e4m3_round(abs(zc)) * 2.0**e
  return codes, exps, out


def quantize_nvfp4_rows(x: np.ndarray, g_scope: str = "tensor", four_over_six: bool = False):
  """NVFP4 on (rows, K) in float32; every division a / b as a * (1 / b) (see formats.py)."""
  f32 = np.float32
  rows, k = x.shape
  x = x.astype(f32)
  gden = f32(256.0 if four_over_six else 448.0)
  if g_scope == "tensor":
    amax_g = np.full((rows,), np.max(np.abs(x)), dtype=f32)
  else:
    amax_g = np.max(np.abs(x), axis=1).astype(f32)
  codes = np.zeros(x.shape, dtype=np.int64)
  out = np.zeros(x.shape, dtype=f32)
  scales = np.zeros((rows, k // 16), dtype=f32)
  gs = np.zeros((rows,), dtype=f32)
  for r in range(rows):
    g = f32(1.0) if amax_g[r] == 0 else f32(amax_g[r] * (f32(1.0) / (f32(6.0) * gden)))
    gs[r] = g
    for b in range(k // 16):
      blk = x[r, b * 16:(b + 1) * 16]
      amax_b = f32(np.max(np.abs(blk)))
      best = None
      for target in ([6.0, 4.0] if four_over_six else [6.0]):
        ratio = f32(amax_b * (f32(1.0) / f32(f32(target) * g)))
        s = f32(e4m3_round(float(np.clip(ratio, 2.0**-9, 448.0))))
        sg = f32(s * g)
        rcp = f32(f32(1.0) / sg)
        cs = [e2m1_code(float(np.clip(f32(v * rcp), -6, 6))) for v in blk]
        vals = np.array([f32(f32(e2m1_value(c)) * sg) for c in cs], dtype=f32)
        err = np.sum(np.square(vals - blk, dtype=f32), dtype=f32)
        if best is None or err < best[0]:
          best = (err, s, cs, vals)
      _, s, cs, vals = best
      scales[r, b] = s
      codes[r, b * 16:(b + 1) * 16] = cs
      out[r, b * 16:(b + 1) * 16] = vals
  return codes, scales, gs, out
