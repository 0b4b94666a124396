"""How fast device arrays reach host memory, and what the host thread does meanwhile: the
chunked rollout engine moves its TRACE guidance to host memory window by window (at the
8k-capacity shape, 48 layers: 5.6 GB of prompt records, then 2.8 GB a window, in ~1,000 arrays
each), and session 35 saw `copy_to_host_async` block its caller for about as long as a copy
took; on the H200 every way ran at 1.0-1.6 GB/s (session 36). Rows (each on fresh arrays,
values checked on arrival):

- `host_touch`: no device: one thread filling new host memory (its pages committed as it
  goes), the rate a copy into fresh host memory cannot beat;
- `asarray`, `asarray_again`: `np.asarray` of each array in turn (again: after the first
  round's host arrays are freed); `one_array`: the same bytes as one array;
- `async_then_asarray`: `copy_to_host_async` on every array (start_s: how long those calls
  took), then `np.asarray` of each (wait_s);
- `pending_async`: the same on arrays a still-running program is producing (`busy_s` of device
  work launched just before): start_s near busy_s means the start waits for the producer;
- `pinned_host`, `pinned_host_again`: `jax.device_put` to the device's pinned host memory
  (where it has one), then `np.asarray` of each, then a copy into host memory committed
  beforehand (`place_s`); `pinned_pending`: the put on arrays a running program is producing;
- `thread_gil`: `async_then_asarray` on another thread while this one counts loop iterations:
  `main_rate` is their rate against the rate alone (1: the copies hold no GIL).

  python benchmarks/bench_host_copy.py --total_gb 5.6 --arrays 1000 --out host_copy.json
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

import bench_util


def _arrays(n: int, per: int, salt: int) -> list:
  """n device arrays of `per` uint8 each, element i of array a = (a + i + salt) % 251."""
  @jax.jit
  def make(a):
    return ((a + salt + jnp.arange(per, dtype=jnp.int32)) % 251).astype(jnp.uint8)
  out = [make(jnp.int32(a)) for a in range(n)]
  jax.block_until_ready(out)
  return out


def _check(host: list, per: int, salt: int) -> bool:
  idx = np.array([0, per // 2, per - 1])
  return all(np.array_equal(np.asarray(h)[idx], (a + salt + idx) % 251)
             for a, h in enumerate(host))


def _busy(seconds: float):
  """A device program that runs for about `seconds` (a calibrated loop of small products)."""
  x = jnp.ones((512, 512), jnp.float32) * 1e-3

  @jax.jit
  def spin(x, n):
    return jax.lax.fori_loop(0, n, lambda i, y: jnp.tanh(y @ y), x)
  jax.block_until_ready(spin(x, 1))  # (compiled before the calibration)
  t = time.perf_counter()
  jax.block_until_ready(spin(x, 20))
  per_iter = max((time.perf_counter() - t) / 20, 1e-6)
  return lambda: spin(x, max(1, int(seconds / per_iter)))


def _main_rate(busy_fn, window: float = 0.3) -> float:
  """Loop iterations a second of this thread while `busy_fn` runs on another (with None: while
  another thread sleeps `window` seconds; the same loop either way)."""
  done = threading.Event()
  work = busy_fn if busy_fn is not None else (lambda: time.sleep(window))
  th = threading.Thread(target=lambda: (work(), done.set()))
  t, n = time.perf_counter(), 0
  th.start()
  while not done.is_set():
    n += 1
  rate = n / (time.perf_counter() - t)
  th.join()
  return rate


def run(total_gb: float, arrays: int, busy_s: float) -> list:
  per = max(1, int(total_gb * 1e9 / arrays))
  gb = per * arrays / 1e9
  rows = []

  def row(name, seconds, ok, **extra):
    r = dict(name=name, gb=gb, arrays=arrays, seconds=seconds, gbps=gb / seconds, values_ok=ok,
             **extra)
    rows.append(r)
    print(f"{name:20s} {gb:6.2f} GB in {seconds:7.3f} s = {gb / seconds:6.2f} GB/s "
          f"{json.dumps(extra)} values {'ok' if ok else 'WRONG'}", flush=True)

  t = time.perf_counter()
  touched = np.empty(per * arrays, np.uint8)
  touched.fill(1)  # one thread committing fresh pages: what a copy into new host memory pays
  row("host_touch", time.perf_counter() - t, bool(touched[-1] == 1))
  del touched

  for name, salt in (("asarray", 1), ("asarray_again", 11)):  # (again: freed memory reused?)
    xs = _arrays(arrays, per, salt)
    t = time.perf_counter()
    host = [np.asarray(x) for x in xs]
    row(name, time.perf_counter() - t, _check(host, per, salt))
    del xs, host

  one = jnp.concatenate(_arrays(arrays, per, 12))  # (made in pieces: int32 element indices)
  jax.block_until_ready(one)
  t = time.perf_counter()
  host = np.asarray(one)
  row("one_array", time.perf_counter() - t, _check(host.reshape(arrays, per), per, 12))
  del one, host

  def async_then_asarray(xs):
    t = time.perf_counter()
    for x in xs:
      x.copy_to_host_async()
    start = time.perf_counter() - t
    host = [np.asarray(x) for x in xs]
    return start, time.perf_counter() - t - start, host

  xs = _arrays(arrays, per, 2)
  start, wait, host = async_then_asarray(xs)
  row("async_then_asarray", start + wait, _check(host, per, 2), start_s=start, wait_s=wait)
  del xs, host

  spin = _busy(busy_s)
  make = jax.jit(lambda y, a: (((jnp.sum(y) * 0).astype(jnp.int32) + a + 3
                                + jnp.arange(per, dtype=jnp.int32)) % 251).astype(jnp.uint8))
  jax.block_until_ready(make(spin(), jnp.int32(0)))  # (compiled before the timing)
  t0 = time.perf_counter()
  y = spin()
  xs = [make(y, jnp.int32(a)) for a in range(arrays)]
  launched = time.perf_counter() - t0
  start, wait, host = async_then_asarray(xs)
  row("pending_async", launched + start + wait, _check(host, per, 3), busy_s=busy_s,
      launch_s=launched, start_s=start, wait_s=wait)
  del xs, host

  dev = jax.devices()[0]
  kinds = {m.kind for m in dev.addressable_memories()}
  if "pinned_host" in kinds:
    sharding = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    # (again: does the second round reuse the first's pinned memory?) then into host memory
    # committed beforehand, as the engine's final arrays are
    final = np.empty(per * arrays, np.uint8)
    final.fill(0)
    for name, salt in (("pinned_host", 4), ("pinned_host_again", 14)):
      xs = _arrays(arrays, per, salt)
      t = time.perf_counter()
      pinned = jax.block_until_ready(jax.device_put(xs, sharding))
      put = time.perf_counter() - t
      host = [np.asarray(x) for x in pinned]
      view = time.perf_counter() - t - put
      for a, h in enumerate(host):
        final[a * per:(a + 1) * per] = h
      row(name, time.perf_counter() - t, _check(host, per, salt), device_put_s=put,
          asarray_s=view, place_s=time.perf_counter() - t - put - view)
      del xs, pinned, host
    y = spin()
    t0 = time.perf_counter()
    xs = [make(y, jnp.int32(a)) for a in range(arrays)]
    pinned = jax.device_put(xs, sharding)
    launched = time.perf_counter() - t0  # near busy_s: the put waits for the producer
    jax.block_until_ready(pinned)
    row("pinned_pending", time.perf_counter() - t0,
        _check([np.asarray(x) for x in pinned], per, 3), busy_s=busy_s, launch_s=launched)
    del xs, pinned, y, final
  else:
    print(f"pinned_host: not a memory of {dev} ({sorted(kinds)})", flush=True)

  alone = _main_rate(None)
  xs = _arrays(arrays, per, 5)
  got = {}
  t = time.perf_counter()
  with_copies = _main_rate(lambda: got.update(zip(("start", "wait", "host"),
                                                  async_then_asarray(xs))))
  row("thread_gil", time.perf_counter() - t, _check(got["host"], per, 5),
      start_s=got["start"], wait_s=got["wait"], main_rate=with_copies / alone)
  return rows


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--total_gb", type=float, default=5.6)
  ap.add_argument("--arrays", type=int, default=1000)
  ap.add_argument("--busy_s", type=float, default=1.0,
                  help="device work launched before pending_async's copies")
  ap.add_argument("--out", default="bench_host_copy.json")
  a = ap.parse_args(argv)
  rows = run(a.total_gb, a.arrays, a.busy_s)
  return bench_util.write_result(a.out, "bench_host_copy", **vars(a), rows=rows)


if __name__ == "__main__":
  main()
