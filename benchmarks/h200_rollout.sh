#!/usr/bin/env bash
# The H200 rollout session in one device call (see launch/bench_rollout.py and
# benchmarks/gpu_engine_smoke.py). Carried wheels in .whl/: tokamax 0.0.17 and what it imports,
# ml_collections, tensorboardX (the GPU image lacks them). Made here (cp312 wheels, --no-deps):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     tokamax==0.0.17 einshape pydantic pydantic-core annotated-types typing-inspection \
#     "typing_extensions>=4.16" qwix immutabledict tensorboardx xprof fire termcolor \
#     ml_collections==1.1.0
# (.whl/ is listed in .git/info/exclude; about 37 MB.)
#   bash benchmarks/h200_rollout.sh STAGE   (STAGE: smoke | 4l | 12l | 12l_fp4 | 12l_b64 | chunk | profile | kernels | final | attn | check | ab | fused_sites | numerics | excess | glue_probe | probe | p2048 | serve | x2 | 48l_fp4 | 48l_bf16 | cap8k | compile_diag | hf_load | routing | small_batch | 48l | bf16_grouped | live | cap_kernels | s13_final | cap_profile | step_ab | s15 | s15b | s15c | s16a | s16b | s16c | s16d | s17a | s17b | s17c | s17d | s17e | s17f | s18a | s18b | s18c | s18d | s18e | s19a | s19d | s20a | s20b | s20c | s21a | s21b | s21c | s22a | s22b | s22c | s22d | s22e | s23a | s23b | s23c | s23d | s24a | s24b | s24c | s25a | s25b | s25d | s26a | s26b | s26c | s27a | s27b | s28a | s28c | s28d | s28e | s28f | s29a | s29b | s30a | s30b | s30c | s31a | s31b | s31c | s31d | s31e | s32a | s32b | s32c | s32d | s32e | s32f | s32g | s33a | s33b | s33c | s33d | s34a | s34b | s34c | s34d | s34e | s34f | s35a | s35b | s35c | s35d | s35e | s36a | s36b | s36c | s36d | s36e | s36f | s36g | s37a | s37b | s37c | s37d | s37e | s37f | s37g | s37h | s37i | s38a | s38b | s38c | s38d | s39a | s39b | s39c | s40a | s40b | s40c | s40d | s40e | s41a | s41b | s42a | s42b | s42c | s42d | s43a | s44a | s44b | s44c | s44d | s45a | s45b | s45c | s45d | s46a | s46b | s46c | s47a | s48a | s49a | s49b | s49c | s49d | s50a | s50b | s50c | s50d | s50e | s51a | s51b | s51c | s51d | s51e | s52a | s53a | s53b | s54a | s54b | s55a | s55b | s56a | s56b | s57a | s58a), results under $OUT
# Rows run one at a time, each in its own process (--isolate: its own peak memory, errors stay
# rows). Compiling the 48-layer generate program (B=64, prompt 256) took 42 s in BF16 and 108 s
# in FP4 on the H200 once every layer's kernel calls were jitted (session 10; before, the BF16
# program's compile grew 3.3 s a layer and did not finish in ~370 s at 48 layers).
set -uo pipefail
stage=${1:-12l}
if [ "${stage%_inner}" != "$stage" ]; then stage=${stage%_inner}; inner=1; else inner=0; fi
[ $inner = 1 ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl >/dev/null 2>&1 || echo "wheel install failed"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.94
# SHARED_CACHE=1: every process of the call uses one compilation cache (/tmp/xla_cache_shared;
# a stage's own TRACE_JAX_COMPILATION_CACHE wins), and with it XLA's per-fusion autotuning
# results, so that the sides of an A/B run the same XLA kernels where their fusions agree
# (session 49: freshly compiling processes differ in logprobs, likely by autotuned picks, and
# session 46 saw the o projection's pick move a 4-layer step by ~15 us). Scripts that read it:
# profile_decode.py, rollout_repeats.py, launch/bench_rollout.py. Prepared in session 49, not run
shared_cache() {
  export TRACE_JAX_COMPILATION_CACHE=${TRACE_JAX_COMPILATION_CACHE:-/tmp/xla_cache_shared}
}
[ -z "${SHARED_CACHE:-}" ] || shared_cache
# nvidia-smi samples every 250 ms into $OUT/smi_NAME.csv while a command runs, then their
# summary (benchmarks/gpu_clocks.py: SM clock, power, temperature and clock event reasons over
# the busy samples; JSON smi_NAME.json): NAME COMMAND...
with_clocks() {
  local name=$1 field=clocks_event_reasons.active pid rc; shift
  nvidia-smi --query-gpu=$field --format=csv,noheader >/dev/null 2>&1 \
    || field=clocks_throttle_reasons.active  # the name before driver 535
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu,$field \
    --format=csv,noheader,nounits -lms 250 > $OUT/smi_$name.csv 2>/dev/null &
  pid=$!
  "$@"; rc=$?
  kill $pid 2>/dev/null; wait $pid 2>/dev/null
  python3 benchmarks/gpu_clocks.py $OUT/smi_$name.csv --json $OUT/smi_$name.json \
    | sed "s/^/[clocks $name] /"
  return $rc
}
# the 8k-capacity rollout (stage cap8k), 2,048 tokens a sequence, 20 GiB of host memory
# reserved, the GPU's clocks sampled (`with_clocks`, name cap8k_CLOCKS, default 48l):
# DEFAULT_TIMEOUT (seconds for the rows; CAP_TIMEOUT overrides it) [CLOCKS]
cap8k_2048() {
  local limit=${CAP_TIMEOUT:-$1}
  HOST_RESERVE=20 ROWS_TIMEOUT=$limit ROW_TIMEOUT=$(( limit - 10 )) GEN=2048 \
    with_clocks cap8k_${2:-48l} bash $0 cap8k_inner | tail -5
}
# the 48-layer 8k-capacity rollout's JSON read out (total, the window share over windows 1-6 as
# bench_rollout reports it, window paces, the one-token calls) and kept under a side's name: SIDE
rollout_side() {
  python3 -c "import json, sys
for r in json.load(open(sys.argv[1]))['results']:
  share = r.get('floor_over_window_steps_after_first')
  print('total s', r.get('total_s'), 'share windows 1-6', share and round(share, 4),
        'step ms', r.get('window_step_ms'), 'one', r.get('prefill_plus_first_step_each_ms'))" \
    $OUT/bench_rollout_cap8k_48l.json | sed "s/^/[$1] /"
  mv $OUT/bench_rollout_cap8k_48l.json $OUT/bench_rollout_cap8k_48l_$1.json
}
# the 48-layer 8k-capacity rollout with SETTINGS (space-separated NAME=VALUE) exported (SIDE =
# SETTINGS_SIDE) or not (the defaults; SIDE unset or DEFAULTS_SIDE), its JSON kept under the
# side's name (`rollout_side`). One side a call: since session 40's kernels the first call
# (compile included) takes 179-187 s and a side ~320 s, two did not fit 600 s (session 41);
# calls while the machine is warm stay on one host: SETTINGS_SIDE SETTINGS [DEFAULTS_SIDE]
cap8k_settings_side() {
  local side=${SIDE:-${3:-defaults}}
  if [ "$side" = "$1" ]; then export $2; fi
  cap8k_2048 ${SIDE_TIMEOUT:-385} $side | tail -2 | sed "s/^/[$side] /"
  rollout_side $side
}
# the FP4 decode step at the 8k-capacity shape (prompt 512, cache for 7,680 new tokens, 256
# generated in windows of 128): LAYERS BATCH POLICY TIMEOUT [more profile_decode.py flags]
cap_shape_profile() {
  local layers=$1 batch=$2 policy=$3 limit=$4; shift 4
  timeout -k 5 $limit python3 benchmarks/profile_decode.py --layers $layers --policy $policy \
    --path kernels --batch $batch --prompt_len 512 --new_tokens 256 --cache_new_tokens 7680 \
    --decode_chunk 128 --repeats 1 "$@" 2>&1 | grep -v "^I1\|^W1"
}
# cap_shape_profile's 4-layer step at B STEP_BATCH (256), command buffers off (the
# environment's settings are the caller's), JSON profile_cap_4l_bSTEP_BATCH_nocb_NAME.json: its
# totals and the lines matching PATTERN, cut to WIDTH columns, tagged "[TAG] ":
# NAME PATTERN [TAG] [WIDTH]
step_4l() {
  local tag=${3:+[$3] } b=${STEP_BATCH:-256}
  with_clocks step_$1 cap_shape_profile 4 $b paper ${PROF_TIMEOUT:-170} --no_command_buffers \
    --out $OUT/profile_cap_4l_b${b}_nocb_$1.json \
    | grep "guidance_on\|decode loop\|$2\|Error\|^\[clocks" | cut -c1-${4:-160} | sed "s/^/$tag/"
}
# cap_shape_profile's 4-layer step at B 256, command buffers on as in the rollout, one engine
# recording guidance and one not in one process (JSON profile_cap_4l_b256_NAME.json), then the
# sides' figures: NAME TIMEOUT [more profile_decode.py flags]
guidance_ab() {
  local json=$OUT/profile_cap_4l_b256_$1.json limit=$2; shift 2
  cap_shape_profile 4 256 paper $limit --guidance_cost --out $json "$@" \
    | grep "^guidance\|decode loop\|Error" | cut -c1-200
  python3 -c "import json; d = json.load(open('$json')); by = d.get('guidance_cost_step_from');
print('guidance cost, share of the decode step:', d.get('guidance_cost_frac_of_step'), 'by', by,
      by and d['guidance_on'][by], by and d.get('guidance_off', {}).get(by))"
}
# bench_guidance.py with ARGS, no plot, its JSON $OUT/NAME.json and whole output $OUT/NAME.log
# (a run stopped by its limit still returns what it printed), the last TAIL lines shown:
# NAME TIMEOUT TAIL ARGS...
bench_guidance_run() {
  local name=$1 limit=$2 tail=$3; shift 3
  timeout -k 5 $limit python3 benchmarks/bench_guidance.py "$@" --no_plot \
    --out $OUT/$name.json 2>&1 | tee $OUT/$name.log | grep -v "^I1\|^W1" | cut -c1-330 \
    | tail -$tail
}
# the 4-layer 30B-A3B train step at the grouped-tile defaults, one chain, 3 steps timed (JSON
# train_determinism_a3b_l4_defaults.json)
a3b_l4_step() {
  timeout -k 5 ${A3B_TIMEOUT:-150} python3 benchmarks/train_determinism.py --preset a3b_l4 \
    --prompts 4 --variants off --chain 1 --repeats 1 --reps 3 \
    --out $OUT/train_determinism_a3b_l4_defaults.json 2>&1 | grep "^off {\|rror" | cut -c1-400
}
# the decode attention with V's words and scales loaded with K's (TRACE_JAX_ATTN_PREFETCH_V)
# each way in the order given, each side its own process: decode rows at B 16 / 64 x 8k / 32k
# and two rollout-shaped live rows (JSON bench_attention_prefetch_v_SIDE.json): SIDE...
prefetch_v_ab() {
  local side
  for side in "$@"; do
    TRACE_JAX_ATTN_PREFETCH_V=$side timeout -k 5 ${BA_TIMEOUT:-140} python3 \
      benchmarks/bench_attention.py --what decode --formats nvfp4_mosaic_kvwords \
      --batches 16,64 --contexts 8192,32768 --live 256x8192x1600,64x8192x1536 \
      --live_kernels stream --budget_s $(( ${BA_TIMEOUT:-140} - 30 )) \
      --out $OUT/bench_attention_prefetch_v_$side.json 2>&1 | grep -v "^I1\|^W1" | tail -8 \
      | cut -c1-120 | sed "s/^/[v $side] /"
  done
}
# Nsight Compute on one `ncu_kernels.py` case (the second launch of a kernel whose name matches
# REGEX; no preallocation: ncu backs up the device memory in use before its replays), its pages
# exported as CSV and `ncu_summary.py`'s reading; fails where no report was written (NCU: the
# ncu binary): CASE REGEX TIMEOUT
ncu_case() {
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 $3 $NCU \
    --clock-control none --kernel-name regex:"$2" --launch-skip 1 --launch-count 1 \
    --set full --import-source no -f -o $OUT/ncu_$1 \
    python3 benchmarks/ncu_kernels.py $1 > $OUT/ncu_$1.log 2>&1
  echo "$1 ncu rc=$?"
  grep -v "^I1\|^W1" $OUT/ncu_$1.log | grep "relerr\|==ERR\|==WARN\|rror" | head -4
  [ -f $OUT/ncu_$1.ncu-rep ] || return 1
  for page in details raw; do
    $NCU -i $OUT/ncu_$1.ncu-rep --page $page --csv > $OUT/ncu_${1}_$page.csv 2>&1
  done
  $NCU -i $OUT/ncu_$1.ncu-rep --page source --csv --print-source sass \
    > $OUT/ncu_${1}_sass.csv 2>&1
  python3 benchmarks/ncu_summary.py $OUT/ncu_${1}_raw.csv $OUT/ncu_${1}_sass.csv \
    --json $OUT/ncu_${1}_summary.json 2>&1 | head -40
}
# benchmarks/train_determinism.py with [its flags], once for each value in VALUES of the setting
# VARIABLE, each its own process, JSON train_determinism_NAME_<value>.json:
# VARIABLE "VALUES" NAME TIMEOUT [flags]
setting_sides() {
  local var=$1 values=$2 name=$3 limit=$4 value
  shift 4
  for value in $values; do
    env $var=$value timeout -k 5 $limit python3 benchmarks/train_determinism.py \
      "$@" --out $OUT/train_determinism_${name}_$value.json 2>&1 | grep -v "^I1\|^W1" \
      | grep "^[a-z_/]* {\|rror" | cut -c1-400 | sed "s/^/[$var=$value] /"
  done
}
# setting_sides for TRACE_JAX_TAKE_ROWS, values GATHERS (default "repeatable plain": the
# fixed-order gathers and the plain one): NAME TIMEOUT [flags]
take_rows_sides() {
  setting_sides TRACE_JAX_TAKE_ROWS "${GATHERS:-repeatable plain}" "$@"
}
# GPU tests of one file matching -k (log under $OUT), those marked TEST_MARK (default gpu; "":
# all of them, CPU tests run on the GPU): FILE KEYWORD NAME TIMEOUT
gpu_tests() {
  JAX_PLATFORMS=cuda timeout -k 5 $4 python3 -m pytest -q -rP -m "${TEST_MARK-gpu}" -p no:xdist \
    -o addopts="" $1 -k "$2" > $OUT/test_$3.txt 2>&1
  echo "$3 gpu tests rc=$?"
  grep -v "^I1\|^W1" $OUT/test_$3.txt | grep -E "Error|assert|passed|failed| off: |relative error" \
    | tail -12
}
# the routing-tables kernel (`kernels/routing.py`): its GPU tests (log test_routing.txt), then
# bench_routing against the XLA path (JSON bench_routing.json): [more bench_routing flags]
routing_tests_bench() {
  gpu_tests tests/kernels/test_routing.py "gpu" routing ${RTEST_TIMEOUT:-90}
  timeout -k 5 ${BR_TIMEOUT:-120} python3 benchmarks/bench_routing.py "$@" \
    --out $OUT/bench_routing.json 2>&1 | grep -v "^I1\|^W1" | grep "rows\|Error\|wrote"
}
# the decode step kernel by kernel as s32d with TRACE_JAX_ROUTING=kernel: its routing and MoE
# rows (JSON profile_cap_4l_b256_nocb_routing.json)
routing_profile() {
  TRACE_JAX_ROUTING=kernel cap_shape_profile 4 256 paper ${PROF_TIMEOUT:-200} \
    --no_command_buffers --out $OUT/profile_cap_4l_b256_nocb_routing.json \
    | grep "guidance_on\|decode loop:\|routing\|moe/"
}
# bench_kernels rows of the old tree (ab_old) and this one (new), each side in its own
# process: ROWS EXTRA (rows for the new side only, with a leading comma) TIMEOUT; JSONs
# bench_kernels_old.json / bench_kernels_new.json
kernel_rows_ab() {
  local side root extra
  for side in old new; do
    root=$PWD; extra=""
    [ $side = old ] && root=$PWD/ab_old
    [ $side = new ] && extra=$2
    mkdir -p $OUT/$side
    PYTHONPATH=/tmp/site:$root timeout -k 5 $3 python3 benchmarks/bench_kernels.py \
      --iters 20 --only $1$extra --out $OUT/$side 2>&1 | grep -v "^I1\|^W1\|Autotuning" \
      | grep "us_call" | sed "s/^/[$side] /" | cut -c1-150
    mv $OUT/$side/bench_kernels.json $OUT/bench_kernels_$side.json 2>/dev/null
  done
}
# grouped FP4 rows of both 30B-A3B expert shapes, variants side by side in one bench_kernels
# run, tokamax's rows beside: ROW_COUNTS VARIANTS TOKAMAX (comma list of row-name substrings)
# TIMEOUT TABLE_LINES; JSON bench_kernels.json
expert_rows() {
  local rows='' shape m v
  for shape in moe_gateup_E128_K2048_N1536 moe_down_E128_K768_N2048; do
    for m in $1; do
      for v in $2; do rows+=",${shape}_M${m}_nvfp4_$v\$"; done
    done
  done
  timeout -k 5 $4 python3 benchmarks/bench_kernels.py --iters 20 --grouped_rows 128 \
    --only ${rows#,},$3 --out $OUT 2>&1 | grep -v "^I1\|^W1\|Autotuning" \
    | grep -A$5 "us_call" | cut -c1-150
}
# decode-attention rows (B 16/64 x S 8k/32k) of one side of an A/B: SIDE (old: the tree
# carried as ab_old; exact_max: this tree with the exact running max; new: this tree) FORMATS
# TIMEOUT BUDGET (seconds after which no row starts); JSON bench_attention_SIDE.json
attention_side_rows() {
  local root=$PWD envs=""
  [ $1 = old ] && root=$PWD/ab_old
  # (session 35) the tree with V's decoded registers fed to the PV wgmma as its A operand, no
  # V through SMEM (wrong results; a timing probe made by stage s36b in /tmp/attn_probe)
  [ $1 = v_registers_probe ] && root=/tmp/attn_probe
  [ $1 = exact_max ] && envs=TRACE_JAX_ATTN_LAZY_MAX=off
  [ $1 = xla_merge ] && envs=TRACE_JAX_ATTN_MERGE=xla
  [ $1 = stages2 ] && envs=TRACE_JAX_ATTN_STAGES=2
  [ $1 = stream ] && envs=TRACE_JAX_ATTN_SCHEDULE=stream
  [ $1 = splits ] && envs=TRACE_JAX_ATTN_SCHEDULE=splits
  # (session 22) Mosaic's automatic warpgroup barriers around SMEM stores back on; 3 stages;
  # odd warpgroups started 600 / 1200 ns late (with 3 stages: the slack a lag needs); early
  # release (the slot's codes and scales released once in registers). The stagger and early
  # release settings were removed after s22b / s22c (no faster): those sides need a028067 /
  # d5e988d; deferred PV products (defer, splits_defer) were removed after s23a (slower): a40d25d
  # (session 34) decoded V through SMEM one head_dim half at a time: 32 KB less, a 4th stage
  [ $1 = v_halves3 ] && envs="TRACE_JAX_ATTN_V_SMEM=halves TRACE_JAX_ATTN_STAGES=3"
  # (session 34) the code words in swizzled SMEM tiles: no staggered loads; 3-6% slower and
  # removed in session 35: this side needs bf68a96 (or code_smem_swizzled.patch)
  [ $1 = code_swizzled ] && envs=TRACE_JAX_ATTN_CODE_SMEM=swizzled
  [ $1 = v_halves4 ] && envs="TRACE_JAX_ATTN_V_SMEM=halves TRACE_JAX_ATTN_STAGES=4"
  [ $1 = auto_barriers ] && envs=TRACE_JAX_ATTN_AUTO_BARRIERS=on
  [ $1 = stages3 ] && envs=TRACE_JAX_ATTN_STAGES=3
  [ $1 = late_release ] && envs=TRACE_JAX_ATTN_EARLY_RELEASE=off
  [ $1 = stagger600_er ] && envs=TRACE_JAX_ATTN_STAGGER=600
  [ $1 = splits_defer ] && envs="TRACE_JAX_ATTN_SCHEDULE=splits TRACE_JAX_ATTN_DEFER_PV=on"
  [ $1 = defer ] && envs=TRACE_JAX_ATTN_DEFER_PV=on
  [ $1 = stagger600 ] && envs="TRACE_JAX_ATTN_STAGES=3 TRACE_JAX_ATTN_STAGGER=600"
  [ $1 = stagger1200 ] && envs="TRACE_JAX_ATTN_STAGES=3 TRACE_JAX_ATTN_STAGGER=1200"
  env $envs PYTHONPATH=/tmp/site:$root timeout -k 5 $3 python3 benchmarks/bench_attention.py \
    --what decode --formats $2 --batches 16,64 --contexts 8192,32768 --budget_s $4 \
    --out $OUT/bench_attention_$1.json ${LIVE:+--live $LIVE} \
    ${LIVE_KERNELS:+--live_kernels $LIVE_KERNELS} 2>&1 | grep -v "^I1\|^W1" \
    | grep -v "splits64\|splits4 " | tail -${ROWS_SHOWN:-8} | sed "s/^/[$1] /"
}
# attention_side_rows for each of SIDES (quoted list) over the full rows and the rollout-shaped
# live rows (LIVE), ROWS lines shown each, TIMEOUT seconds each (no row starts in the last 35)
attention_ab() {
  for side in $1; do
    LIVE=${LIVE:-276x8192x1536,64x8192x1536,16x8192x2048} ROWS_SHOWN=$2 \
      attention_side_rows $side nvfp4_mosaic $3 $(( $3 - 35 ))
  done
}
# the 12-layer decode step at HF's B 1 load (prompt 64, 128 new) profiled kernel by kernel
# without command buffers (with them the profiler sees graphs): POLICY NAME TIMEOUT LINES
b1_profile() {
  timeout -k 5 $3 python3 benchmarks/profile_decode.py --layers 12 --policy $1 --path kernels \
    --batch 1 --prompt_len 64 --new_tokens 128 --no_command_buffers --repeats 2 \
    --out $OUT/profile_decode_b1_$2.json 2>&1 \
    | grep -v "^I1\|^W1" | grep "guidance_on\|decode loop\|device kernel\|^ " | head -$4
}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
[ "$stage" = smoke ] && python3 - <<'PY' 2>&1 | tail -4
import jax, jax.numpy as jnp, numpy as np
from trace_jax import kernels
from trace_jax.kernels import dispatch
print("jax", jax.__version__, jax.devices()[0], "grouped backend:", kernels.grouped_backend())
e, k, n = 128, 2048, 1536
gs = jnp.asarray(np.random.default_rng(0).multinomial(256, np.ones(e) / e), jnp.int32)
x = jax.random.normal(jax.random.key(0), (256, k), jnp.bfloat16)
w = (jax.random.normal(jax.random.key(1), (e, k, n), jnp.float32) * 0.02).astype(jnp.bfloat16)
y = jax.jit(lambda x, w, g: dispatch._ragged_bf16(x, w, g))(x, w, gs)
r = jax.lax.ragged_dot(x.astype(jnp.float32), w.astype(jnp.float32), gs,
                       precision=jax.lax.Precision.HIGHEST)
print("grouped bf16 vs f32 ragged_dot rel err",
      float(jnp.linalg.norm(y - r) / jnp.linalg.norm(r)))
PY
if [ "$stage" = smoke ]; then
  timeout 170 python3 benchmarks/gpu_engine_smoke.py --layers 2 --out $OUT/gpu_engine_smoke.json \
    2>&1 | grep -v "^I1\|^W1" | tail -6
elif [ "$stage" = 4l ]; then
  # 4 layers of the 30B-A3B shape: the FP4 rows did not finish within a call at 12 layers
  timeout 420 python3 launch/bench_rollout.py --preset=qwen3_30b_a3b --num_layers=4 \
    --batches=64,1 --policies=bf16,paper --isolate --row_timeout=150 --prompt_len=256 \
    --new_tokens=256 --repeats=2 --hf_peer=false --out=$OUT/bench_rollout_4l.json \
    2>&1 | grep -v "^I1\|^W1"
elif [ "$stage" = 12l_fp4 ]; then
  # the FP4 rows alone (the bf16 B=64 row of this shape is in bench_rollout_h200_2026-11-30)
  timeout 575 python3 launch/bench_rollout.py --preset=qwen3_30b_a3b_12l --batches=64 \
    --policies=paper --paths=kernels,xla --isolate --row_timeout=280 --prompt_len=256 \
    --new_tokens=512 --repeats=2 --hf_peer=false --out=$OUT/bench_rollout_12l_fp4.json \
    2>&1 | grep -v "^I1\|^W1"
elif [ "$stage" = 12l_b64 ]; then
  # BF16 and FP4 (kernels) at B=64 only: the two rows issue 8's whole-rollout ratio needs
  timeout 575 python3 launch/bench_rollout.py --preset=qwen3_30b_a3b_12l --batches=64 \
    --policies=bf16,paper --paths=kernels --isolate --row_timeout=280 --prompt_len=256 \
    --new_tokens=512 --repeats=2 --hf_peer=false --out=$OUT/bench_rollout_12l_b64.json \
    2>&1 | grep -v "^I1\|^W1"
elif [ "$stage" = chunk ]; then
  # the cost of decode windows that move guidance to host memory (issue 8's capacity figure
  # relies on them): FP4 kernels, B=64, 128-step windows; compare with 12l_b64's FP4 row
  timeout 330 python3 launch/bench_rollout.py --preset=qwen3_30b_a3b_12l --batches=64 \
    --policies=paper --paths=kernels --isolate --row_timeout=300 --prompt_len=256 \
    --new_tokens=512 --repeats=2 --hf_peer=false --decode_chunk=128 \
    --out=$OUT/bench_rollout_12l_chunk128.json 2>&1 | grep -v "^I1\|^W1"
elif [ "$stage" = serve ]; then
  # issue 10 on the GPU: the slot scheduler's TTFT/latency, then the paired BF16-vs-FP4 A/B
  # report (30B-A3B layer shapes, configs/serve_compare.py:gpu)
  timeout 200 python3 benchmarks/bench_serving_ttft.py --variant gpu --arm candidate \
    --schedulers slots --requests 96 --concurrency 32 --out $OUT/serving_ttft_gpu.json \
    2>&1 | grep -v "^I1\|^W1\|Autotuning cache miss" | tail -8
  timeout 360 python3 launch/compare.py --config=configs/serve_compare.py:gpu \
    --workdir $OUT/serve_compare_gpu 2>&1 | grep -v "^I1\|^W1\|Autotuning cache miss" | tail -12
elif [ "$stage" = profile ]; then
  # where the decode step goes (4 layers of the 30B-A3B shape, prompt 256): FP4 kernels with
  # the guidance cost, then the BF16 engine; each writes the decode loop's kernel listing
  timeout 250 python3 benchmarks/profile_decode.py --layers 4 --policy paper --path kernels \
    --guidance_cost --hlo_out $OUT/decode_loop_kernels_paper.txt \
    --out $OUT/profile_decode_paper_kernels.json 2>&1 | grep -v "^I1\|^W1" | tail -40
  timeout 150 python3 benchmarks/profile_decode.py --layers 4 --policy bf16 --path xla \
    --hlo_out $OUT/decode_loop_kernels_bf16.txt --out $OUT/profile_decode_bf16.json 2>&1 \
    | grep -v "^I1\|^W1" | grep "guidance_on\|decode loop"
elif [ "$stage" = kernels ]; then
  # grouped FP4 kernel: n_inner column tiles per CTA vs one, tokamax bf16 in the same run; the
  # kernels' GPU tests (grouped + decode attention); then a decode-step profile with the
  # attention kernel and n_inner=all (settings: TRACE_JAX_GROUPED_N_INNER, ..._DECODE_ATTENTION)
  timeout 250 python3 benchmarks/bench_kernels.py --only ${KERNEL_ROWS:-moe_} --iters 20 \
    --out $OUT 2>&1 | grep -v "^I1\|^W1\|Autotuning cache miss" | tail -40
  JAX_PLATFORMS=cuda timeout 150 python3 -m pytest -q -m gpu -p no:xdist -o addopts="" \
    tests/kernels/test_kernels_gpu.py -k grouped tests/kernels/test_attention_gpu.py 2>&1 \
    | grep -v "^I1\|^W1" | tail -25
  TRACE_JAX_GROUPED_N_INNER=${PROFILE_N_INNER:-all} TRACE_JAX_DECODE_ATTENTION=kernel \
    timeout 150 python3 benchmarks/profile_decode.py --layers 4 --policy paper --path kernels \
    --out $OUT/profile_decode_paper_inner_attn.json 2>&1 | grep -v "^I1\|^W1" | head -40
elif [ "$stage" = final ]; then
  # the GPU tests of the default kernels (grouped FP4 with chained tiles, decode attention),
  # then BF16 vs FP4 at B=64 on the 12-layer shape with those defaults (as 12l_b64)
  JAX_PLATFORMS=cuda timeout 100 python3 -m pytest -q -m gpu -p no:xdist -o addopts="" \
    tests/kernels/test_kernels_gpu.py -k grouped 2>&1 | grep -v "^I1\|^W1" | tail -6
  JAX_PLATFORMS=cuda timeout 200 python3 -m pytest -q -m gpu -p no:xdist -o addopts="" \
    tests/kernels/test_attention_gpu.py 2>&1 | grep -v "^I1\|^W1" | tail -12
  timeout ${ROWS_TIMEOUT:-380} python3 launch/bench_rollout.py --preset=qwen3_30b_a3b_12l \
    --batches=64 --policies=bf16,paper --paths=kernels --isolate --row_timeout=240 \
    --prompt_len=256 --new_tokens=512 --repeats=2 --hf_peer=false \
    --out=$OUT/bench_rollout_12l_b64.json 2>&1 | grep -v "^I1\|^W1\|Autotuning cache miss"
elif [ "$stage" = attn ]; then
  # attention kernels: GPU tests (Mosaic NVFP4 decode first: a hang there must not eat the call,
  # then Pallas decode and flash prefill), then decode rows B 16/64 x S 8k/32k: bf16, the
  # Pallas kernel on NVFP4 and the Mosaic kernel (BENCH_ARGS="--quick --sweep" for the launch
  # sweep instead); full test logs under $OUT
  JAX_PLATFORMS=cuda timeout -k 5 ${MOSAIC_TIMEOUT:-100} python3 -m pytest -q -x -m gpu \
    -p no:xdist -o addopts="" -k mosaic tests/kernels/test_attention_gpu.py \
    > $OUT/test_attn_mosaic.txt 2>&1; echo "mosaic tests rc=$?"
  grep -v "^I1\|^W1" $OUT/test_attn_mosaic.txt | tail -25
  JAX_PLATFORMS=cuda timeout -k 5 ${PALLAS_TIMEOUT:-170} python3 -m pytest -q -m gpu \
    -p no:xdist -o addopts="" -k "not mosaic" --durations=5 tests/kernels/test_attention_gpu.py \
    > $OUT/test_attn_pallas.txt 2>&1; echo "pallas tests rc=$?"
  grep -v "^I1\|^W1" $OUT/test_attn_pallas.txt | tail -25
  timeout -k 5 ${BENCH_TIMEOUT:-280} python3 benchmarks/bench_attention.py ${BENCH_ARGS:-\
    --formats bf16,nvfp4,nvfp4_mosaic --batches 16,64 --contexts 8192,32768} \
    --budget_s $(( ${BENCH_TIMEOUT:-280} - 30 )) \
    --out $OUT/bench_attention.json 2>&1 | grep -v "^I1\|^W1" | tail -70
elif [ "$stage" = check ]; then
  # after a kernel change: the FP4 matmul kernels' GPU tests (dense + grouped, the row-major
  # output epilogue) and the Mosaic decode-attention tests, then the grouped rows of
  # bench_kernels (tokamax bf16 vs FP4 n_inner 2/4/all) and the decode attention rows
  JAX_PLATFORMS=cuda timeout -k 5 ${KTEST_TIMEOUT:-240} python3 -m pytest -q -x -m gpu \
    -p no:xdist -o addopts="" tests/kernels/test_kernels_gpu.py > $OUT/test_kernels_gpu.txt 2>&1
  echo "kernel tests rc=$?"; grep -v "^I1\|^W1" $OUT/test_kernels_gpu.txt | tail -4
  JAX_PLATFORMS=cuda timeout -k 5 ${MOSAIC_TIMEOUT:-120} python3 -m pytest -q -x -m gpu \
    -p no:xdist -o addopts="" -k mosaic tests/kernels/test_attention_gpu.py \
    > $OUT/test_attn_mosaic.txt 2>&1; echo "mosaic tests rc=$?"
  grep -v "^I1\|^W1" $OUT/test_attn_mosaic.txt | tail -4
  timeout -k 5 ${BK_TIMEOUT:-180} python3 benchmarks/bench_kernels.py --iters 20 \
    --only ${KERNEL_ROWS:-M256_tokamax,M512_tokamax,M256_nvfp4_in,M512_nvfp4_in} --out $OUT \
    2>&1 | grep -v "^I1\|^W1\|Autotuning cache miss" | tail -16
  timeout -k 5 ${BENCH_TIMEOUT:-120} python3 benchmarks/bench_attention.py --what decode \
    ${BENCH_ARGS:---formats bf16,nvfp4_mosaic --batches 16,64 --contexts 8192,32768} \
    --budget_s $(( ${BENCH_TIMEOUT:-120} - 30 )) --out $OUT/bench_attention.json 2>&1 \
    | grep -v "^I1\|^W1" | tail -16
elif [ "$stage" = ab ]; then
  # A/B of the decode step, alternating, AB_ROUNDS rounds of profile_decode (4 layers of the
  # 30B-A3B shape, FP4 kernels): side "old" runs ab_old/trace_jax when that exists (a git
  # archive of the base commit, carried as an ignored path; AB_OLD_DIR names another or none),
  # else this tree; AB_ENV_OLD /
  # AB_ENV_NEW: environment settings of each side (e.g. XLA_FLAGS=...). The first run of the
  # new side also writes the decode loop's kernel listing
  for r in $(seq 1 ${AB_ROUNDS:-2}); do
    for side in old new; do
      root=$PWD; [ $side = old ] && [ -d ${AB_OLD_DIR:-ab_old} ] && root=$PWD/${AB_OLD_DIR:-ab_old}
      envs=${AB_ENV_OLD:-}; [ $side = new ] && envs=${AB_ENV_NEW:-}
      extra=""; [ $r = 1 ] && [ $side = new ] && extra="--hlo_out $OUT/decode_loop_kernels_paper.txt"
      env $envs PYTHONPATH=/tmp/site:$root timeout 170 python3 benchmarks/profile_decode.py \
        --layers 4 --policy paper --path kernels --repeats 3 $extra \
        --out $OUT/ab_${side}_$r.json 2>&1 | grep "guidance_on\|decode loop" \
        | sed "s/^/[$side $r] /" | cut -c1-200
    done
  done
elif [ "$stage" = routing ]; then
  # the routing-tables kernel (kernels/routing.py, opt-in since session 10): its GPU test against
  # the XLA tables, then the decode-step A/B with it off (old) and on (new); it replaces about
  # seven small XLA kernels per MoE layer (session 11: 187 us a call, step 1.23 -> 1.94 ms)
  JAX_PLATFORMS=cuda timeout -k 5 120 python3 -m pytest -q -m gpu -p no:xdist -o addopts="" \
    tests/kernels/test_routing.py 2>&1 | grep -v "^I1\|^W1" \
    | grep -E "Error|assert|Mismatch|passed|failed" | cut -c1-300 | tail -12
  AB_OLD_DIR=none AB_ENV_NEW="TRACE_JAX_ROUTING=kernel" bash $0 ab
elif [ "$stage" = fused_sites ]; then
  # the two opt-in Pallas kernels of session 7 (kernels/kv_append.py: the decode step's K/V
  # cache write; kernels/row_quant.py: the rollout's activation-site quantization): their GPU
  # tests against the XLA paths, then the decode-step A/B with both off (old) and on (new)
  JAX_PLATFORMS=cuda timeout -k 5 150 python3 -m pytest -q -m gpu -p no:xdist -o addopts="" \
    tests/kernels/test_kv_append.py tests/kernels/test_row_quant.py 2>&1 \
    | grep -v "^I1\|^W1" | grep -E "Error|assert|Mismatch|differ|passed|failed" | cut -c1-300 | tail -24
  AB_ENV_NEW="TRACE_JAX_KV_APPEND=kernel TRACE_JAX_ROW_QUANT=kernel" bash $0 ab
elif [ "$stage" = numerics ]; then
  # session 8: the quantization rules compiled by XLA:GPU against numpy (integer reciprocal and
  # E4M3 decode) and the glue kernels against them; then two decode-step A/Bs: the fix's cost on
  # the XLA path (ab_old: the tree before it, glue kernels off in both), and the glue kernels
  # (this tree, off vs on)
  JAX_PLATFORMS=cuda timeout -k 5 200 python3 -m pytest -q -m gpu -p no:xdist -o addopts="" \
    tests/quant/test_gpu_numerics.py tests/kernels/test_kv_append.py \
    tests/kernels/test_row_quant.py 2>&1 | grep -v "^I1\|^W1" \
    | grep -E "Error|assert|Mismatch|differ|passed|failed" | cut -c1-300 | tail -24
  glue_off="TRACE_JAX_KV_APPEND=xla TRACE_JAX_ROW_QUANT=xla"
  echo "-- A/B 1: old = the tree before the fix, new = this tree, glue kernels off"
  AB_ROUNDS=1 AB_ENV_OLD="$glue_off" AB_ENV_NEW="$glue_off" bash $0 ab
  mkdir -p $OUT/fix && mv $OUT/ab_*.json $OUT/decode_loop_kernels_paper.txt $OUT/fix/ 2>/dev/null
  echo "-- A/B 2: this tree, old = glue kernels off, new = on (the default)"
  AB_ROUNDS=1 AB_OLD_DIR=none AB_ENV_OLD="$glue_off" AB_ENV_NEW="" bash $0 ab
elif [ "$stage" = excess ]; then
  # XLA:GPU's excess precision (on by default) beyond the quantization rules, which are immune to
  # it since session 8: may XLA keep f32 where the model rounds to bf16, differently in the
  # rollout's and the trainer's programs? TRACE alignment on the GPU (the CPU tests, their printed
  # k3 / code agreement) with the default and with it off; then the decode-step cost of off
  for flags in "" "--xla_allow_excess_precision=false"; do
    echo "-- XLA_FLAGS=$flags"
    XLA_FLAGS="$flags" JAX_PLATFORMS=cuda timeout -k 5 ${EXCESS_TIMEOUT:-150} python3 -m pytest -q -s -p no:xdist \
      -o addopts="" tests/rl/test_train_step.py tests/rollout/test_engine.py \
      -k "trace_aligns or routing_replay or fp4_kv_decode" 2>&1 \
      | grep -E "k3:|code agreement|passed|failed|Error|assert" | cut -c1-300 | tail -10
  done
  [ "${EXCESS_AB:-1}" = 1 ] && AB_ROUNDS=1 AB_OLD_DIR=none \
    AB_ENV_NEW="XLA_FLAGS=--xla_allow_excess_precision=false" bash $0 ab
elif [ "$stage" = glue_probe ]; then
  # where the compiled glue kernels part from XLA: fields, primitives, the compiler's division
  JAX_PLATFORMS=cuda timeout -k 5 170 python3 benchmarks/probe_glue.py --out $OUT/probe_glue.npz \
    2>&1 | grep -v "^I1\|^W1\|Deprecation" | cut -c1-400 | tail -60
elif [ "$stage" = probe ]; then
  # the Mosaic decode-attention kernel piece by piece against its jnp model (decoder alone, then
  # running max / sum / output per warpgroup for inputs that isolate the K and V steps): the
  # first thing to run when its GPU tests fail (it found the shared-reduction-scratch race)
  timeout -k 5 150 python3 benchmarks/probe_attention_mgpu.py --out $OUT/probe.npz 2>&1 \
    | grep -v "^I1\|^W1\|Deprecation\|plgpu.load" | cut -c1-600 | tail -12
elif [ "$stage" = p2048 ]; then
  # the prompt-2048 rollout rows with the GPU defaults: flash prefill kernel, Mosaic NVFP4 decode
  # attention for the FP4 row (session 3's rows in bench_rollout_h200_2026-11-30 ran without
  # them; session 5's in session5_h200_2026-11-30 with them); DECODE_ATTENTION=kernel keeps
  # the Pallas decode kernel
  TRACE_JAX_DECODE_ATTENTION=${DECODE_ATTENTION:-mosaic} \
    timeout ${ROWS_TIMEOUT:-560} python3 launch/bench_rollout.py \
    --preset=qwen3_30b_a3b_12l --batches=64 --policies=paper,bf16 --paths=kernels --isolate \
    --row_timeout=200 --prompt_len=2048 --new_tokens=256 --repeats=1 --hf_peer=false \
    --out=$OUT/bench_rollout_12l_b64_p2048.json 2>&1 | grep -v "^I1\|^W1\|Autotuning cache miss"
elif [ "$stage" = x2 ]; then
  # nvidia-h200-x2: expert parallel over 2 GPUs vs 1 (issue 9), the ragged all-to-all check
  # (tests/conftest.py defaults JAX_PLATFORMS to cpu: the GPU tests need it set)
  JAX_PLATFORMS=cuda timeout 60 python3 -m pytest -q -x -m gpu -p no:xdist -o addopts="" \
    tests/parallel/test_expert.py 2>&1 | tail -4
  timeout ${X2_TIMEOUT:-400} python3 benchmarks/bench_parallel.py --out $OUT/bench_parallel.json \
    ${X2_ARGS:-} \
    2>&1 | grep -v "^I1\|^W1\|Autotuning cache miss"
elif [ "$stage" = 48l_fp4 ]; then
  # the whole 48-layer 30B-A3B shape, FP4 kernels only, B=64 (session 8: 427 s, of it 152 s to
  # compile the generate program; 280 s was too short; the BF16 row is 48l_bf16)
  timeout ${ROWS_TIMEOUT:-585} python3 launch/bench_rollout.py --preset=qwen3_30b_a3b \
    --batches=64 --policies=paper --paths=kernels --isolate --row_timeout=${ROW_TIMEOUT:-575} \
    --prompt_len=256 --new_tokens=256 --repeats=1 --hf_peer=false \
    --out=$OUT/bench_rollout_48l_fp4.json 2>&1 | grep -v "^I1\|^W1\|Autotuning cache miss"
elif [ "$stage" = 48l_bf16 ]; then
  # the 48-layer BF16 row to set beside 48l_fp4's (session 8: FP4 needed 427 s with a 152 s
  # compile; BF16 weights are 60 GB), same shape and tokens; no re-sync (session 9: the re-sync
  # ran out of memory beside the 61 GB master and the 61 GB rollout copy it donates)
  timeout ${ROWS_TIMEOUT:-585} python3 launch/bench_rollout.py --preset=qwen3_30b_a3b \
    --batches=64 --policies=bf16 --paths=kernels --isolate --row_timeout=${ROW_TIMEOUT:-575} \
    --prompt_len=256 --new_tokens=256 --repeats=1 --hf_peer=false --noresync \
    --out=$OUT/bench_rollout_48l_bf16.json 2>&1 | grep -v "^I1\|^W1\|Autotuning cache miss"
elif [ "$stage" = cap8k ]; then
  # issue 8's capacity bar, filled: each policy at the planner's batch for 8k tokens (prompt 512,
  # decode windows of 256, guidance to host memory) through the whole rollout; LAYERS (48),
  # POLICIES (paper), NEW (7680 new tokens), GEN (tokens the timed rollout generates, 0: NEW;
  # the engine, cache and host arrays stay sized for NEW). Session 9 planned FP4 329 sequences vs
  # BF16 80 at 48 layers. Session 10's call (297 planned: less host memory free) spent 571 s
  # before its timed rollout, which the warm-up's rollout, still held, then refused (fixed).
  # CAP_ARGS: more bench_rollout flags (e.g. --nocommand_buffers)
  timeout ${ROWS_TIMEOUT:-585} python3 launch/bench_rollout.py --preset=qwen3_30b_a3b \
    --num_layers=${LAYERS:-48} --batches=capacity --policies=${POLICIES:-paper} --paths=kernels \
    --isolate --row_timeout=${ROW_TIMEOUT:-575} --prompt_len=512 --new_tokens=${NEW:-7680} \
    --decode_chunk=256 --repeats=1 --hf_peer=false --noresync --generate_tokens=${GEN:-0} \
    --host_reserve_gib=${HOST_RESERVE:-20} ${CAP_ARGS:-} \
    --out=$OUT/bench_rollout_cap8k_${LAYERS:-48}l.json 2>&1 | grep -v "^I1\|^W1\|Autotuning cache miss"
elif [ "$stage" = hf_load ]; then
  # issue 8's HF bar at HF's own load (BENCHMARKS.md: 12 layers, 64-token prompt, 128 new
  # tokens, B=1 and 32; HF static cache 267 / 1282 tok/s, eager 17.8 / 453): the engine's rows,
  # and with HF_PEER=true HF's own in the same run (the device image's python has torch)
  timeout ${ROWS_TIMEOUT:-560} python3 launch/bench_rollout.py --preset=qwen3_30b_a3b_12l \
    --batches=${BATCHES:-32,1} --policies=${POLICIES:-bf16,paper} --paths=kernels --isolate \
    --row_timeout=${ROW_TIMEOUT:-150} --prompt_len=64 --new_tokens=128 --repeats=3 \
    --hf_peer=${HF_PEER:-false} --out=$OUT/bench_rollout_12l_hf_load${HF_TAG:-}.json \
    ${HF_ARGS:-} 2>&1 \
    | grep -v "^I1\|^W1\|Autotuning cache miss"
elif [ "$stage" = small_batch ]; then
  # batch-1 decode (session 11: FP4 1.07 ms vs BF16 0.70 ms a step at 4 layers, 0.58 / 0.55 after
  # the fixes; the grouped FP4 kernel ran 8 CTAs, XLA made each one-row attention projection a
  # multiply + reduce; 150 s / 200 s were too short for the tests / kernel rows): the
  # GPU tests of the grouped K split and the one-row product, the kernel rows at 8 and 64 rows,
  # then the batch-1 decode step of both engines (SB_PROFILE=0 skips it)
  JAX_PLATFORMS=cuda timeout -k 5 ${KTEST_TIMEOUT:-240} python3 -m pytest -q -m gpu -p no:xdist \
    -o addopts="" tests/kernels/test_kernels_gpu.py -k "single_row or grouped" \
    > $OUT/test_kernels_gpu.txt 2>&1; echo "kernel tests rc=$?"
  grep -v "^I1\|^W1" $OUT/test_kernels_gpu.txt | grep -E "Error|assert|passed|failed" | tail -8
  timeout -k 5 ${BK_TIMEOUT:-260} python3 benchmarks/bench_kernels.py --iters 20 \
    --only ${KERNEL_ROWS:-M8_,M64_,attn_q_2048x4096_B1_xla,attn_o_4096x2048_B1_xla} --out $OUT \
    2>&1 | grep -v "^I1\|^W1\|Autotuning cache miss" | tail -34
  if [ "${SB_PROFILE:-1}" = 1 ]; then
    for pol in bf16:xla paper:kernels; do
      timeout 120 python3 benchmarks/profile_decode.py --layers 4 --policy ${pol%%:*} \
        --path ${pol##*:} --batch 1 --prompt_len 64 --new_tokens 128 --repeats 3 \
        --out $OUT/profile_decode_${pol%%:*}_b1.json 2>&1 | grep "guidance_on\|decode loop" \
        | cut -c1-240
    done
  fi
elif [ "$stage" = bf16_grouped ]; then
  # the opt-in bf16 grouped kernel (kernels/bf16_mgpu.py, session 12; lowered and compiled for
  # an H200 on CPU, never run): its GPU tests, its kernel rows beside tokamax's at 8 / 64 / 256 /
  # 512 rows, then the 12-layer BF16 engine at HF's load (B 1 and 32) with it, against the
  # default (tokamax: 758.5 tok/s at B=1 in session 12, HF static 279.9 in the same run)
  gpu_tests tests/kernels/test_kernels_gpu.py bf16_grouped bf16_grouped_gpu ${KTEST_TIMEOUT:-200}
  timeout -k 5 ${BK_TIMEOUT:-200} python3 benchmarks/bench_kernels.py --iters 20 \
    --only ${KERNEL_ROWS:-tokamax_bf16,bf16_mgpu} --out $OUT \
    2>&1 | grep -v "^I1\|^W1\|Autotuning cache miss" | tail -20
  TRACE_JAX_BF16_GROUPED=kernel timeout ${ROWS_TIMEOUT:-150} python3 launch/bench_rollout.py \
    --preset=qwen3_30b_a3b_12l --batches=1,32 --policies=bf16 --paths=kernels --isolate \
    --row_timeout=70 --prompt_len=64 --new_tokens=128 --repeats=3 --hf_peer=false \
    --out=$OUT/bench_rollout_12l_hf_load_bf16_kernel.json 2>&1 | grep -v "^I1\|^W1" | tail -5
elif [ "$stage" = live ]; then
  # rollout-shaped decode (session 13): the cache sized for 8k, a short context live, as in the
  # 8k-capacity rollout (FP4 at 276 sequences ran at 0.17 of its floor). The Mosaic attention
  # tests (splits past the live tiles now exit at once), the kernel's split counts at such shapes
  # beside the bf16 kernel (LIVE rows BxSxL), then the decode step at the capacity shape on 4
  # layers (B 276, prompt 512, cache for 7,680 new, 256 generated in windows of 128)
  JAX_PLATFORMS=cuda timeout -k 5 ${MOSAIC_TIMEOUT:-100} python3 -m pytest -q -x -m gpu \
    -p no:xdist -o addopts="" -k mosaic tests/kernels/test_attention_gpu.py \
    > $OUT/test_attn_mosaic.txt 2>&1; echo "mosaic tests rc=$?"
  grep -v "^I1\|^W1" $OUT/test_attn_mosaic.txt | tail -6
  timeout -k 5 ${BENCH_TIMEOUT:-200} python3 benchmarks/bench_attention.py --what decode \
    --formats nvfp4_mosaic --batches 16 --contexts 8192 \
    --live ${LIVE:-276x8192x1536,64x8192x1536,16x8192x2048,64x1024x768} \
    --budget_s $(( ${BENCH_TIMEOUT:-200} - 30 )) --out $OUT/bench_attention_live.json 2>&1 \
    | grep -v "^I1\|^W1" | tail -30
  cap_shape_profile 4 ${PROFILE_BATCH:-276} ${PROFILE_POLICY:-paper} ${PROFILE_TIMEOUT:-240} \
    --hlo_out $OUT/decode_loop_kernels_live.txt --out $OUT/profile_decode_live.json | tail -60
elif [ "$stage" = cap_kernels ]; then
  # (session 13) the grouped FP4 kernel at the capacity rollout's 2,208 rows (168 us a call in
  # its profile: 2.5x the 512-row call) with its rows-per-chunk choices, the capacity-shaped
  # decode step again with the new attention splits, then the opt-in bf16 grouped kernel's GPU
  # tests and its decode-size rows beside tokamax's
  timeout -k 5 ${BK_TIMEOUT:-130} python3 benchmarks/bench_kernels.py --iters 20 \
    --only ${KERNEL_ROWS:-M2208_tokamax,M2208_nvfp4,M2208_mxfp4} --out $OUT 2>&1 \
    | grep -v "^I1\|^W1\|Autotuning cache miss" | tail -14
  mv $OUT/bench_kernels.json $OUT/bench_kernels_m2208.json 2>/dev/null
  cap_shape_profile 4 276 paper ${PROFILE_TIMEOUT:-190} --out $OUT/profile_decode_live.json \
    | grep -v "^  loop" | tail -22
  gpu_tests tests/kernels/test_kernels_gpu.py bf16_grouped bf16_grouped_gpu ${KTEST_TIMEOUT:-110}
  timeout -k 5 ${BF_TIMEOUT:-130} python3 benchmarks/bench_kernels.py --iters 20 \
    --only M8_tokamax,M8_bf16_mgpu,M64_tokamax,M64_bf16_mgpu,M256_tokamax,M256_bf16_mgpu \
    --out $OUT 2>&1 | grep -v "^I1\|^W1\|Autotuning cache miss" | tail -14
elif [ "$stage" = cap_profile ]; then
  # (for session 14) where the 8k-capacity FP4 step goes at full depth: session 13's 48-layer
  # row took 40.0 ms a step where the 4-layer profile at its batch predicts ~34. LAYERS (48),
  # BATCH (272); the decode-window program's kernels are named by source (its optimized HLO)
  cap_shape_profile ${LAYERS:-48} ${BATCH:-272} paper ${PROFILE_TIMEOUT:-560} \
    --hlo_out $OUT/decode_loop_kernels_cap.txt --out $OUT/profile_decode_cap_${LAYERS:-48}l.json \
    | tail -70
elif [ "$stage" = step_ab ]; then
  # the capacity-shaped FP4 decode step (LAYERS, default 12; B 276) under each setting of
  # STEP_AB (';'-separated shell assignments). Session 15 (defaults since): XLA command buffers
  # over while loops and custom calls 7.20 -> 5.06 ms, splits of <= 16 tiles 7.20 -> 6.19 ms.
  # Default (for session 16): as is; cuBLAS for XLA's dots (the fused q/k/v projection ran as a
  # Triton gemm fusion of 23 us a layer at B 264, ~8 us of bytes and FLOPs); splits of <= 32
  # tiles (4 splits of the 8k cache)
  IFS=';' read -ra settings <<< "${STEP_AB:-AB=baseline;XLA_FLAGS=--xla_gpu_enable_triton_gemm=false;TRACE_JAX_ATTN_MAX_SPLIT_TILES=32}"
  for setting in "${settings[@]}"; do
    tag=$(echo "$setting" | md5sum | cut -c1-6)
    echo "== $setting [$tag]"
    ( eval "export $setting"
      cap_shape_profile ${LAYERS:-12} 276 paper ${PROFILE_TIMEOUT:-200} \
        --out $OUT/profile_decode_ab_$tag.json | grep "guidance_on\|decode loop\|device kernel" )
  done
elif [ "$stage" = s19a ]; then
  # (session 19) the Mosaic FP4-KV decode attention with fewer instructions a tile (830 -> 575 in
  # the SASS of its loop: a 4-op nibble decode with sign-replicating prmt, exp2 in one
  # ex2.approx, the PV product accumulating in place, N = 8 for 8 query heads a KV head with
  # P^T in SMEM): its GPU tests, then decode rows of the tree before (ab_old, a git archive of
  # the base commit carried as an ignored path) and of this one (SIDES: which), and
  # rollout-shaped live rows (LIVE)
  gpu_tests tests/kernels/test_attention_gpu.py mosaic attn_mosaic ${MOSAIC_TIMEOUT:-150}
  for side in ${SIDES:-old new}; do
    fmts=nvfp4_mosaic; [ $side = new ] && fmts=bf16,nvfp4_mosaic
    attention_side_rows $side $fmts ${BENCH_TIMEOUT:-130} $(( ${BENCH_TIMEOUT:-130} - 30 ))
  done
  timeout -k 5 ${LIVE_TIMEOUT:-170} python3 benchmarks/bench_attention.py --what decode \
    --formats nvfp4_mosaic --batches 16 --contexts 8192 \
    --live ${LIVE:-276x8192x1536,64x8192x1536,16x8192x2048} \
    --budget_s $(( ${LIVE_TIMEOUT:-170} - 30 )) --out $OUT/bench_attention_live.json 2>&1 \
    | grep -v "^I1\|^W1" | grep live | tail -24
elif [ "$stage" = s30a ]; then
  # (session 30) the grouped kernel's stream-K schedule (every SM the same run of (chunk, tile,
  # K step) units; the default at decode sizes): GPU tests (stream-K over few CTAs and at the
  # expert shapes, the capacity batch, the chunk schedule at the expert shapes), then kernel
  # rows at 64-2,208 rows of both expert shapes, stream-K (auto) against the chunk schedule
  # (auto_nosk), tokamax's bf16 beside
  gpu_tests tests/kernels/test_kernels_gpu.py \
    "stream_k_ragged or stream_k_expert or capacity or grouped_expert" gsk ${KTEST_TIMEOUT:-230}
  tok=''
  for m in 64 128 256 512; do tok+=",moe_gateup_E128_K2048_N1536_M${m}_tokamax"; done
  expert_rows "64 128 256 512 2208" "auto auto_nosk" \
    ${tok#,},moe_down_E128_K768_N2048_M256_tokamax ${BK_TIMEOUT:-330} 40
elif [ "$stage" = s36d ]; then
  # (session 36) guidance to host memory through pinned host memory: bench_host_copy's rows
  # (fresh host memory again, one array, pinned twice, pinned on pending arrays), then the
  # 48-layer 8k-capacity rollout (default: async copies) followed in the same process by a
  # one-token and a whole rollout copied pinned, then async again (`--guidance_copies`), each
  # with the times its records and end flags reached host memory (`marks`)
  # (s36e: the rollout only. s36d's first run: its extra rollouts were refused for host memory,
  # the runtime keeping the pinned memory: the planner now counts it)
  [ "${SKIP_HC:-0}" = 1 ] || timeout -k 5 ${HC_TIMEOUT:-150} python3 benchmarks/bench_host_copy.py \
    --total_gb 5.6 --arrays 1000 --busy_s 2 --out $OUT/bench_host_copy.json 2>&1 \
    | grep -v "^I1\|^W1" | tail -12
  CAP_ARGS="--guidance_copies=pinned,async" cap8k_2048 ${CAP_TIMEOUT:-420}
  python3 -c "import json, sys
for r in json.load(open(sys.argv[1]))['results']:
  print('total s', r.get('total_s'), 'one', r.get('prefill_plus_first_step_each_ms'))
  for k, ts in (r.get('chunk_timelines') or {}).items():
    for t in ts: print(k, json.dumps(t['marks']))
  for c in r.get('guidance_copy_rollouts') or []:
    print(c['copy'], 'one', round(c['one_token_s'], 3), 'whole', round(c['whole_s'], 3))
    for w in ('one_token', 'whole'):
      print(' ', w, json.dumps(c[w + '_timeline']))" $OUT/bench_rollout_cap8k_48l.json
elif [ "$stage" = s36g ]; then
  # (session 36) s36f at the 8k-capacity batch and cache with 12 layers: B 255, the cache for
  # 7,680 new tokens, 64 generated in one window (is the 48-layer prefill launch's 0.46 s the
  # batch's and cache's, or the layers'?)
  timeout -k 5 ${PD_TIMEOUT:-160} python3 benchmarks/probe_dispatch.py --layers 12 --batch 255 \
    --prompt_len 512 --new_tokens 7680 --generate_tokens 64 --decode_chunk 256 --repeats 2 \
    --out $OUT/probe_dispatch_12l_cap8k.json 2>&1 | grep -v "^I1\|^W1" | tail -8
elif [ "$stage" = s37c ]; then
  # (session 37) the expert down input as one kernel (SwiGLU of the gate/up kernel's chunk rows,
  # the site's row quantization and the down kernel's operand: `kernels/swiglu_quant.py`): its
  # GPU tests (against its reference and XLA's own SwiGLU, bit for bit), then the 4-layer decode
  # step at the 8k-capacity shape (B 256, windows of 128) kernel by kernel, without it and with
  # it, each side in its own process
  gpu_tests tests/kernels/test_swiglu_quant.py "gpu" swiglu ${STEST_TIMEOUT:-100}
  for side in xla kernel; do
    TRACE_JAX_SWIGLU_QUANT=$side step_4l swiglu_$side "moe/" $side
  done
elif [ "$stage" = s37d ]; then
  # (session 37) the expert down input's kernel with vector loads (plain ranges in its gathers'
  # block and element axes): its GPU tests, then bench_swiglu_quant (tile x warps against the
  # XLA ops it replaces, every bit checked) at the B 256 and B 64 decode shapes
  gpu_tests tests/kernels/test_swiglu_quant.py "gpu" swiglu ${STEST_TIMEOUT:-100}
  timeout -k 5 ${BS_TIMEOUT:-200} python3 benchmarks/bench_swiglu_quant.py --iters 20 \
    --out $OUT/bench_swiglu_quant.json 2>&1 | grep -v "^I1\|^W1" | tail -30
elif [ "$stage" = s37e ]; then
  # (session 37) both expert-input kernels: the expert input's quantization writing the gate/up
  # kernel's operand (`row_quant.quantize_rows_to_operand`) and the down input's SwiGLU kernel
  # (now with rcp.rn): their GPU tests, bench_swiglu_quant, then the 4-layer decode step at the
  # 8k-capacity shape kernel by kernel without both (xla) and with both (kernel)
  gpu_tests "tests/kernels/test_swiglu_quant.py tests/kernels/test_row_quant.py" "gpu" \
    expert_inputs ${STEST_TIMEOUT:-120}
  timeout -k 5 ${BS_TIMEOUT:-120} python3 benchmarks/bench_swiglu_quant.py --iters 20 \
    --tiles 1024,2048,4096 --warps 4,8 --out $OUT/bench_swiglu_quant.json 2>&1 \
    | grep -v "^I1\|^W1" | grep "us " | tail -16
  for side in xla kernel; do
    TRACE_JAX_SWIGLU_QUANT=$side TRACE_JAX_ROW_QUANT_OPERAND=$side \
      step_4l inputs_$side "moe/" $side
  done
elif [ "$stage" = s37f ]; then
  # (session 37) the expert input kernels inside the model on the GPU (a one-layer model, bit
  # for bit against the XLA ops they replace) and the operand kernel's small case, then s37b:
  # the 48-layer 8k-capacity rollout with both kernels on (the default)
  gpu_tests "tests/kernels/test_glue_in_model.py tests/kernels/test_row_quant.py" \
    "expert_input or three_tokens" in_model ${MTEST_TIMEOUT:-100}
  bash $0 s37b_inner
elif [ "$stage" = s37g ]; then
  # (session 37) Nsight Compute on the two expert input kernels (Triton) at B 256: what bounds
  # them (9.0 and 5.0 us a layer in the decode step, ~3 us of bytes each); s23b's exports and
  # ncu_summary reading
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  for case in ${NCU_CASES:-swiglu2048 rowop256}; do
    ncu_case $case "swiglu|row_quant" ${NCU_TIMEOUT:-100} || continue
    grep -i "Duration\|Memory Throughput\|Compute (SM) Throughput\|Registers Per\|Achieved Occ\|Executed Ipc A" \
      $OUT/ncu_${case}_details.csv | cut -c1-200 | head -12
    rm -f $OUT/ncu_$case.ncu-rep
  done
elif [ "$stage" = s37h ]; then
  # (session 37) the operand kernel with its destinations loaded first and 8 warps (s37g: 7.1
  # us, latency-bound, 11% occupancy): its GPU tests, then ncu at 8 warps (the new default) and
  # at 4 (TRACE_JAX_OPERAND_WARPS), each report's files renamed by its warps (as run in session
  # 37 the rename matched the first side's renamed files again: its files read rowop256_w4_w8)
  gpu_tests tests/kernels/test_row_quant.py "operand" operand ${OTEST_TIMEOUT:-80}
  for w in 8 4; do
    TRACE_JAX_OPERAND_WARPS=$w NCU_CASES=rowop256 bash $0 s37g_inner 2>&1 \
      | grep -v "^\"" | sed "s/^/[w$w] /"
    for f in $OUT/ncu_rowop256.* $OUT/ncu_rowop256_{details,raw,sass,summary}*; do
      [ -f $f ] && mv $f ${f/rowop256/rowop256_w$w}
    done
  done
elif [ "$stage" = s37i ]; then
  # (session 37) the 48-layer 8k-capacity rollout without the expert input kernels (xla) and
  # with them (kernel), each side in its own process on one machine (two runs with them on two
  # machines read window shares 0.467 and 0.457): totals, window shares and paces. As run in
  # session 37 (call 8) both sides were cut at 215 s: a side needs >= 260 s
  for side in xla kernel; do
    TRACE_JAX_SWIGLU_QUANT=$side TRACE_JAX_ROW_QUANT_OPERAND=$side \
      cap8k_2048 ${SIDE_TIMEOUT:-270} | tail -2 | sed "s/^/[$side] /"
    python3 -c "import json, sys
for r in json.load(open(sys.argv[1]))['results']:
  print('total s', r.get('total_s'), 'windows share', r.get('floor_over_window_steps'),
        'step ms', r.get('window_step_ms'))" $OUT/bench_rollout_cap8k_48l.json \
      | sed "s/^/[$side] /"
    mv $OUT/bench_rollout_cap8k_48l.json $OUT/bench_rollout_cap8k_48l_$side.json
  done
elif [ "$stage" = s38a ]; then
  # (prepared in session 37, not run) the SwiGLU kernel's rows split into tiles with no idle
  # blocks (TRACE_JAX_SWIGLU_SPLIT=on: F 768 as three tiles of 16, where one tile of 64 leaves
  # a quarter of the lanes idle in a kernel bound by instructions): its GPU tests (and the
  # refactored row-quantizing kernels', not re-run on the GPU since session 37's calls),
  # bench_swiglu_quant split off / on, then the 4-layer decode step with it off and on
  gpu_tests "tests/kernels/test_swiglu_quant.py tests/kernels/test_row_quant.py tests/kernels/test_glue_in_model.py" \
    "gpu or expert_input" swiglu_split ${STEST_TIMEOUT:-150}
  timeout -k 5 ${BS_TIMEOUT:-120} python3 benchmarks/bench_swiglu_quant.py --iters 20 \
    --tiles 2048,4096 --warps 4,8 --out $OUT/bench_swiglu_quant.json 2>&1 \
    | grep -v "^I1\|^W1" | grep "us " | tail -20
  for side in off on; do
    TRACE_JAX_SWIGLU_SPLIT=$side step_4l split_$side swiglu $side
  done
elif [ "$stage" = s38b ]; then
  # (prepared in session 37, not run) the router's gates in one kernel (softmax, top-k,
  # renormalized weights: `router_topk.py`, opt-in TRACE_JAX_ROUTER_TOPK=kernel; deviceless
  # census at B 256: one kernel fewer a layer, XLA then reduces the router product's split-K
  # parts in a kernel of its own): its GPU test, then the 4-layer decode step without it, with
  # it, and with it and the routing tables' kernels (TRACE_JAX_ROUTING=kernel, which in session
  # 34 lost what they saved when XLA split the top-k in two)
  gpu_tests tests/kernels/test_router_topk.py "gpu" router_topk ${RTEST_TIMEOUT:-80}
  for side in "xla xla" "kernel xla" "kernel kernel"; do
    set -- $side
    TRACE_JAX_ROUTER_TOPK=$1 TRACE_JAX_ROUTING=$2 step_4l topk_$1_routing_$2 \
      "moe/\|router\|routing" "topk $1, routing $2"
  done
elif [ "$stage" = s39a ]; then
  # (prepared in session 38) the routing tables' two kernels (TRACE_JAX_ROUTING=kernel) now
  # that the router's top-k is a kernel of its own (session 34: the tables' kernels saved ~3
  # us a layer but XLA then split its top-k in two; deviceless census at 2 layers, B 256: 84 ->
  # 79 kernels a step with them): their GPU tests, then the 4-layer decode step without and
  # with them, each side its own process
  gpu_tests tests/kernels/test_routing.py "gpu" routing ${RTEST_TIMEOUT:-90}
  for side in xla kernel; do
    TRACE_JAX_ROUTING=$side step_4l routing_$side "moe/\|routing" "routing $side"
  done
elif [ "$stage" = s39b ]; then
  # (prepared in session 38) the router's product of bf16 operands as one bf16 product with
  # float32 accumulation (TRACE_JAX_ROUTER_DOT=bf16; its float32 dot of converted operands was
  # ~9.6 us a layer, split-K and its reduction, in session 38's 4-layer step) and the gates
  # kernel's tokens a program (16 by default: 16 programs at B 256), and the router's product
  # inside that kernel (TRACE_JAX_ROUTER_TOPK=fused, `router_gates`): their GPU tests,
  # bench_small_dots' router and routing-tail rows at 256 and 2,048 rows, then the 4-layer
  # decode step with the bf16 product (the float32 side: s39a's xla side or s38d's kernel side)
  gpu_tests "tests/kernels/test_kernels_gpu.py tests/kernels/test_router_topk.py" \
    "router_product or gpu_against" router_dot ${RTEST_TIMEOUT:-100}
  timeout -k 5 ${SD_TIMEOUT:-150} python3 benchmarks/bench_small_dots.py --rows 256,2048 \
    --products router,route_tail --out $OUT/bench_small_dots_router.json 2>&1 \
    | grep -v "^I1\|^W1" | grep " us \|rror"
  TRACE_JAX_ROUTER_DOT=bf16 step_4l router_dot_bf16 "moe/\|router" "router dot bf16"
  # (its last row, the product inside the gates kernel, TRACE_JAX_ROUTER_TOPK=fused, went with
  # that kernel in session 45: s45a)
elif [ "$stage" = s40a ]; then
  # (prepared in session 39) the decode step's q/k norms, rope, q's permutation to the Mosaic
  # attention's order and the K/V append in one kernel (`qkv_append.py`, opt-in
  # TRACE_JAX_DECODE_QKV=kernel; deviceless census at 2 layers, B 256: 84 -> 74 kernels a step,
  # ~17 us a layer of XLA glue in session 38's profile), and the residual add with the MoE's
  # input norm in one kernel (`add_norm.py`, opt-in TRACE_JAX_ADD_NORM=kernel; the deviceless
  # compile's o_proj is a split-K dot whose reduction then needs a kernel of its own, the
  # H200's was a cuBLAS GEMM, so only the GPU can say): their GPU tests (against the XLA
  # ops; in the model with the Mosaic attention), then the 4-layer decode step without them,
  # with the q/k/v kernel at 4 and 8 warps, and with both, each side its own process
  gpu_tests "tests/kernels/test_qkv_append.py tests/kernels/test_add_norm.py" "gpu" \
    qkv_add_norm ${QTEST_TIMEOUT:-150}
  for side in "xla 4 xla" "kernel 4 xla" "kernel 8 xla" "kernel 4 kernel"; do
    set -- $side
    TRACE_JAX_DECODE_QKV=$1 TRACE_JAX_QKV_WARPS=$2 TRACE_JAX_ADD_NORM=$3 \
      step_4l qkv_$1_w$2_addnorm_$3 "attn/\|qkv_append\|kv_append\|add_rms_norm\|norm/" \
      "qkv $1, $2 warps, add+norm $3"
  done
elif [ "$stage" = s40c ]; then
  # (prepared in session 40) the decode step's MoE output, residual add and next norm in one
  # kernel (`moe_combine.py`, opt-in TRACE_JAX_MOE_COMBINE=kernel: the gates' weighted sum read
  # from the down kernel's chunk rows; deviceless census at 2 layers, B 256: 84 -> 82 kernels
  # a step, with the other opt-ins 65 -> 62), and the add + norm kernel now also at each layer's
  # boundary: the GPU tests of the three norm kernels (the norm's roundings are now explicit,
  # `transformer.round_to`), then the 4-layer decode step with neither, each, and both, each
  # side its own process
  gpu_tests "tests/kernels/test_moe_combine.py tests/kernels/test_add_norm.py
    tests/kernels/test_qkv_append.py" "gpu" norm_kernels ${QTEST_TIMEOUT:-200}
  for side in "xla xla" "kernel xla" "xla kernel" "kernel kernel"; do
    set -- $side
    TRACE_JAX_ADD_NORM=$1 TRACE_JAX_MOE_COMBINE=$2 \
      step_4l addnorm_$1_combine_$2 "add_rms_norm\|moe_combine\|norm/\|moe/convert\|moe/and\|/add" \
      "add+norm $1, combine $2"
  done
elif [ "$stage" = s40d ]; then
  # (prepared in session 40) s40a and s40c in one call: the GPU tests of the three norm kernels
  # (q/k/v, add + norm, MoE combine), then the 4-layer decode step with none, each, and all
  # three, each side its own process (~8 min)
  gpu_tests "tests/kernels/test_qkv_append.py tests/kernels/test_add_norm.py
    tests/kernels/test_moe_combine.py" "gpu" norm_kernels ${QTEST_TIMEOUT:-240}
  for side in "xla xla xla" "kernel xla xla" "xla kernel xla" "xla kernel kernel" \
      "kernel kernel kernel"; do
    set -- $side
    TRACE_JAX_DECODE_QKV=$1 TRACE_JAX_ADD_NORM=$2 TRACE_JAX_MOE_COMBINE=$3 \
      step_4l qkv_$1_addnorm_$2_combine_$3 \
      "attn/\|qkv_append\|kv_append\|add_rms_norm\|moe_combine\|norm/\|moe/convert\|moe/and\|/add" \
      "qkv $1, add+norm $2, combine $3"
  done
elif [ "$stage" = s40e ]; then
  # (session 40, after s40d: the combine kernel 7.9 us a call in the step, its GPU test's sum
  # 29% of elements off XLA's) the kernel alone against XLA's ops and a numpy computation of
  # the model's rule, at 4 / 8 / 16 warps, B 256 and 64; then its GPU tests
  timeout -k 5 ${BENCH_TIMEOUT:-200} python3 benchmarks/bench_moe_combine.py \
    --out $OUT/bench_moe_combine.json 2>&1 | grep -v "^I1\|^W1" | tail -12
  gpu_tests tests/kernels/test_moe_combine.py "gpu" moe_combine ${QTEST_TIMEOUT:-150}
elif [ "$stage" = s41a ]; then
  # (prepared in session 40) the three decode-step kernels made defaults in session 40 on the
  # 4-layer step (1.630 -> 1.573 ms of kernels) at 48 layers: the 8k-capacity rollout with them
  # off (SIDE=xla3: TRACE_JAX_DECODE_QKV / ADD_NORM / MOE_COMBINE=xla) or with the defaults
  cap8k_settings_side xla3 "TRACE_JAX_DECODE_QKV=xla TRACE_JAX_ADD_NORM=xla TRACE_JAX_MOE_COMBINE=xla"
elif [ "$stage" = s41b ]; then
  # (session 41) the router's product as one bf16 product with float32 accumulation
  # (TRACE_JAX_ROUTER_DOT=bf16; its GPU tests passed in session 40, s39b's step did not run):
  # the 4-layer decode step with the float32 product and with it, each side its own process;
  # then the engine's GPU tests under session 40's defaults (cut at 230 s in session 40)
  for side in float32 bf16; do
    TRACE_JAX_ROUTER_DOT=$side step_4l router_dot_$side "moe/dot\|router" "router dot $side"
  done
  gpu_tests tests/rollout/test_engine_gpu.py "" engine ${ETEST_TIMEOUT:-300}
elif [ "$stage" = s44a ]; then
  # (session 44) two SMEM load orders, same products (deviceless SASS: same instruction
  # counts, no spills), each side its own process: TRACE_JAX_PREFETCH_CODES=on (the FP4
  # matmul kernels load tile j + 1's code words before decoding tile j) on the GEMV and the
  # expert rows at 2,208 rows (the capacity batch's), off / on twice; TRACE_JAX_ATTN_PREFETCH_V=on (the
  # decode attention loads V's words and scales with K's, before the S product) on the decode
  # rows and the rollout-shaped live rows, off / on. JSONs bench_kernels_SIDE_REP.json,
  # bench_attention_prefetch_v_SIDE.json (CODE_REPS="": no matmul rows; V_SIDES: the order).
  # Ran in session 44: the codes' order no faster (GEMV 37.0 / 36.9 and 37.0 / 37.2 us kernel;
  # gate+up 2,208 rows 73.2 / 72.8, 73.0 / 74.9; down 42.1 / 44.5, 42.2 / 43.0), removed (its
  # patch: results/session44_h200_2026-12-05/prefetch_codes.patch; CODE_REPS now runs two
  # equal sides); V's order kept as an opt-in
  rows='ffn_8192x28672_B1_nvfp4$,moe_gateup_E128_K2048_N1536_M2208_nvfp4_auto$'
  rows+=',moe_down_E128_K768_N2048_M2208_nvfp4_auto$'
  for rep in ${CODE_REPS-}; do
    for side in off on; do
      mkdir -p $OUT/k_$side
      TRACE_JAX_PREFETCH_CODES=$side timeout -k 5 ${BK_TIMEOUT:-100} python3 \
        benchmarks/bench_kernels.py --iters 20 --only "$rows" --out $OUT/k_$side 2>&1 \
        | grep -v "^I1\|^W1\|Autotuning" | grep -A6 "us_call" | cut -c1-120 \
        | sed "s/^/[codes $side $rep] /"
      mv $OUT/k_$side/bench_kernels.json $OUT/bench_kernels_${side}_$rep.json 2>/dev/null
    done
  done
  prefetch_v_ab ${V_SIDES:-off on}
  rm -f $OUT/*.png
elif [ "$stage" = s46a ]; then
  # (prepared in session 45, not run) two opt-ins that take XLA kernels out of the decode step
  # at the rollout's B 255, bit for bit on CPU: the attention's output projection left in
  # float32 and rounded by the add + norm kernel after it (TRACE_JAX_O_PROJ_OUT=float32: XLA's
  # convert after cuBLAS's GEMM, 2.6 us a layer on an H100, should go; the deviceless census
  # cannot show it, its compile splits the product without autotuning), and the input norm
  # written padded to 256 rows for the bf16 q/k/v kernel (TRACE_JAX_NORM_ROWS=padded: XLA's pad,
  # 1.5 us a layer, goes; deviceless census at 2 layers 64 -> 63 kernels, layer 0's stays).
  # Their GPU tests, then the 4-layer decode step at B 255 with neither, each and both, each
  # side its own process. Ran in session 46 on an H100: XLA's o projection took other kernels
  # on each side; the float32 projection no faster, removed (o_proj_out.patch)
  gpu_tests "tests/kernels/test_add_norm.py tests/kernels/test_moe_combine.py" "gpu" \
    oproj_norm_rows ${TEST_TIMEOUT:-120}
  # (sides as OUT:ROWS words, which an S46_SIDES override can give too)
  for side in ${S46_SIDES:-bf16:exact float32:exact bf16:padded float32:padded}; do
    set -- ${side/:/ }
    TRACE_JAX_O_PROJ_OUT=$1 TRACE_JAX_NORM_ROWS=$2 STEP_BATCH=255 step_4l o_proj_$1_rows_$2 \
      "o_proj\|attn/pad\|input_norm" "o_proj $1, rows $2"
  done
elif [ "$stage" = s51d ]; then
  # (session 51; ran in session 52 on an H100: tests passed, tiles 11-36x faster than
  # ragged_dot with 16 a step, results/session52_h100_2026-12-06) the trainer's float32 grouped
  # matmul by row tiles
  # (`kernels.tiled_grouped`) against XLA's ragged_dot, which XLA:GPU expands E-fold: the tests
  # on the GPU, the products side by side (bench_tiled_grouped.py: forward + dx + dw, tiles of
  # 128 / 256 / 512 rows), then the mid train step with each (TRACE_JAX_GROUPED_REF), each its
  # own process, and the 4-layer 30B-A3B step with tiles (ragged_dot did not fit an H100)
  TEST_MARK= gpu_tests tests/kernels/test_tiled_grouped.py "" tiled_grouped ${TEST_TIMEOUT:-90}
  timeout -k 5 ${BENCH_TIMEOUT:-400} python3 benchmarks/bench_tiled_grouped.py \
    --out $OUT/bench_tiled_grouped.json 2>&1 | grep -v "^I1\|^W1" | grep "^\[\|/ ragged\|rror"
elif [ "$stage" = s56a ]; then
  # (session 56, ran on an H100: 2.31% against 10.71% whole) the last window in pieces
  # (`GUIDANCE_TAIL`, halves down to 32 steps: 128 + 64 + 32 + 32) against it whole (tail0;
  # session 55: 8.72% inline / 7.24% thread at 256 tokens, ~0.4 s of the last window's copy and
  # placing), s54b's 48-layer shape, 3 rounds (~310 s: 74 s to draw and sync, ~80 s to compile
  # each engine)
  bench_guidance_run bench_guidance_48l_tail ${BG_TIMEOUT:-560} 12 --layers 48 --batch 128 \
    --prompt_len 512 --new_tokens 256 --cache_new_tokens 7680 --decode_chunk 256 --rounds 3 \
    --sides "chunked on async inline tail0,chunked on async inline"
elif [ "$stage" = s58a ]; then
  # (session 58, prepared) session 57's weight-sync fix on the GPU first (device sync bit for bit
  # the host sync's, the old weights donated, re-sync peaks flat; ~75 s), then s57a's bars
  timeout -k 5 ${TEST_TIMEOUT:-150} env JAX_PLATFORMS=cuda python3 -m pytest -q -s -m gpu \
    -p no:xdist -o addopts="" tests/rollout/test_engine_gpu.py -k "host_master or resync_peak" \
    2>&1 | grep -v "^I1\|^W1" | tee $OUT/sync_tests.log | tail -8
  bash "$0" s57a_inner
elif [ "$stage" = s57a ]; then
  # (session 57) issues 7 and 8's kernel bars, each figure beside its peer in one run, at
  # today's defaults: the FP4 GEMV and the 30B-A3B attention shapes against XLA's bf16 dot; the
  # grouped FP4 expert products at decode sizes (8-512 rows) and prefill size (32,768) against
  # tokamax's bf16 ragged_dot and XLA's; then the FP4-KV decode attention against bf16 KV at
  # 8k-32k (the last full runs: sessions 32 and 34)
  rows=ffn_8192x28672_B1_xla_bf16$,ffn_8192x28672_B1_nvfp4$,ffn_8192x28672_B16_xla_bf16$
  rows=$rows,ffn_8192x28672_B16_nvfp4$,ffn_8192x28672_B64_xla_bf16$,ffn_8192x28672_B64_nvfp4$
  for s in attn_q_2048x4096 attn_o_4096x2048; do
    for b in 1 16 64; do rows=$rows,${s}_B${b}_xla_bf16$,${s}_B${b}_nvfp4$; done
  done
  for m in 8 64 256 512; do
    for s in moe_gateup_E128_K2048_N1536 moe_down_E128_K768_N2048; do
      rows=$rows,${s}_M${m}_xla_bf16$,${s}_M${m}_tokamax_bf16$,${s}_M${m}_nvfp4_auto$
    done
  done
  s=moe_gateup_E128_K2048_N1536_M32768
  rows=$rows,${s}_xla_bf16$,${s}_tokamax_bf16$,${s}_nvfp4_auto$
  timeout -k 5 ${BK_TIMEOUT:-260} python3 benchmarks/bench_kernels.py --iters 20 --only "$rows" \
    --out $OUT 2>&1 | grep -v "^I1\|^W1\|Autotuning cache miss" | tee $OUT/bench_kernels.log \
    | tail -45
  timeout -k 5 ${BA_TIMEOUT:-170} python3 benchmarks/bench_attention.py --what decode \
    --batches 16,64 --contexts 8192,32768 --formats bf16,nvfp4_mosaic_kvwords \
    --budget_s $(( ${BA_TIMEOUT:-170} - 40 )) --out $OUT/bench_attention.json 2>&1 \
    | grep -v "^I1\|^W1" | tee $OUT/bench_attention.log | tail -14
  python3 benchmarks/kernel_bars.py --kernels $OUT/bench_kernels.json \
    --attention $OUT/bench_attention.json --out $OUT/kernel_bars.json > $OUT/kernel_bars.md \
    2>&1; tail -1 $OUT/kernel_bars.md
elif [ "$stage" = s56b ]; then
  # (session 56, prepared) as s56a at 1,024 new tokens (the last of 4 windows in pieces), 2 rounds
  bench_guidance_run bench_guidance_48l_tail_1024 ${BG_TIMEOUT:-560} 12 --layers 48 \
    --batch 128 --prompt_len 512 --new_tokens 1024 --cache_new_tokens 7680 --decode_chunk 256 \
    --rounds 2 --sides "chunked on async inline tail0,chunked on async inline"
elif [ "$stage" = s55b ]; then
  # (session 55, prepared; not run, s56a measured the pieces directly) whether the last
  # window's landing is what costs a short rollout:
  # s54b's 48-layer shape (an H100 fits it: the host-master sync), 256 new tokens in windows of
  # 128 (session 55 in windows of 256: 8.72% inline / 7.24% thread, ~0.4 s that does not
  # shrink with length: the first window's records 0.25 s late, the last window's placing
  # 0.17 s inline), 3 rounds
  bench_guidance_run bench_guidance_48l_w128 ${BG_TIMEOUT:-560} 12 --layers 48 --batch 128 \
    --prompt_len 512 --new_tokens 256 --cache_new_tokens 7680 --decode_chunk 128 --rounds 3 \
    --sides "chunked on async inline,chunked on async thread"
elif [ "$stage" = s55a ]; then
  # (session 55) the rollout weights from a host master, part by part (`RolloutEngine.sync` of
  # numpy leaves): bit for bit the device master's on the GPU, and the sync's device peak
  timeout -k 5 ${TEST_TIMEOUT:-300} env JAX_PLATFORMS=cuda python3 -m pytest -q -s -m gpu \
    -p no:xdist -o addopts="" tests/rollout/test_engine_gpu.py -k host_master 2>&1 \
    | grep -v "^I1\|^W1" | tee $OUT/host_sync_test.log | tail -8
elif [ "$stage" = s54b ]; then
  # (session 54, prepared; ran in session 55 on an H100) the guidance share at 48 layers (an
  # H200, or since session 55's host master an H100: the planner fits 176 x 8k there), the
  # chunked engine's default way and the landing thread (at 4 layers on the H100, s54a: 2.77% /
  # 2.44% of a 1,024-token rollout; pinned copies 5.2-7.9%, left out; the one-program engine's
  # guidance, ~45 GB here, too), 1,024 new tokens in windows of 256, one timed round after the
  # first calls
  bench_guidance_run bench_guidance_48l ${BG_TIMEOUT:-560} 12 --layers 48 --batch 128 \
    --prompt_len 512 --new_tokens 1024 --cache_new_tokens 7680 --decode_chunk 256 --rounds 1 \
    --sides "chunked on async inline,chunked on async thread"
elif [ "$stage" = s54a ]; then
  # (session 54) issue 8's guidance bar by whole rollouts (s53a/b timed one call a side and
  # read 10-11% at 256 new tokens, all of it before the windows): bench_guidance's seven sides
  # (one-program and chunked engines, guidance on and off; the chunked guided one under each
  # copy x landing way), 3 rounds in rotated order, 256 and 1,024 new tokens, B 256, 4 layers
  bench_guidance_run bench_guidance ${BG_TIMEOUT:-380} 24 --layers 4 --batch 256 \
    --prompt_len 512 --new_tokens 256,1024 --decode_chunk 128 --rounds 3
elif [ "$stage" = s53b ]; then
  # (session 53) s53a's guidance A/B in the other order (off first: in s53a, on H100, guidance
  # off ran second and 36% slower a step, 1.742 against 1.278 ms, though the decode loops'
  # kernels differ by 2 of 93 in the deviceless census), then the mid train step at tiles of
  # 256 (s53a's side of 256 and the 30B-A3B step printed nothing within their limits)
  guidance_ab guidance_cost_off_first ${PROF_TIMEOUT:-200} --guidance_first off
  setting_sides TRACE_JAX_GROUPED_TILE "256" mid_tile ${TD_TIMEOUT:-190} --variants off \
    --chain 2 --repeats 2 --reps 5
elif [ "$stage" = s53a ]; then
  # (session 53, prepared) issue 8's guidance bar (capture <= 5% of the rollout's time), last
  # measured in session 3 (1.6-3.3% of a decode step, before every kernel since): the 4-layer
  # FP4 decode step at the 8k-capacity shape, B 256, command buffers on as in the rollout,
  # guidance recording on and off (two engines, one process); then s52a's short form on any
  # sm_90: the mid train step at tiles of 128 / 256 rows (32 a step, the default), and the
  # 4-layer 30B-A3B step at the defaults (~7 min in all). First: the device reads as Hopper
  # (`kernels_on`, new in session 53: the kernels only on compute capability 9.0)
  gpu_tests tests/kernels/test_dispatch.py "" dispatch ${DTEST_TIMEOUT:-60}
  guidance_ab guidance_cost ${PROF_TIMEOUT:-240}
  setting_sides TRACE_JAX_GROUPED_TILE "128 256" mid_tile ${TD_TIMEOUT:-110} --variants off \
    --chain 2 --repeats 2 --reps 5
  a3b_l4_step
elif [ "$stage" = s52a ]; then
  # (session 52, prepared, not run) the grouped products' new defaults in the train step: the
  # mid step with tiles of up to 128 / 256 rows (TRACE_JAX_GROUPED_TILE) at 32 tiles a loop
  # step, then 16 / 32 / 64 a step at the default tile, each its own process; the 4-layer
  # 30B-A3B step with the defaults. Session 52 measured the products (11-36x ragged_dot) and
  # the mid step only at tiles of 128, 1 and 16 a step (0.241 / 0.090 s)
  setting_sides TRACE_JAX_GROUPED_TILE "128 256" mid_tile ${TD_TIMEOUT:-110} --variants off \
    --chain 2 --repeats 2 --reps 5
  setting_sides TRACE_JAX_GROUPED_TILES_PER_STEP "16 32 64" mid_per_step ${TD_TIMEOUT:-110} \
    --variants off --chain 2 --repeats 2 --reps 5
  a3b_l4_step
elif [ "$stage" = s51e ]; then
  # (session 52) s51d's train steps (split from it: one call each). Ran in session 52 by hand
  # on an H100 with a third side, 16 tiles a step: mid 0.729 / 0.241 / 0.090 s
  setting_sides TRACE_JAX_GROUPED_REF "ragged_dot tiles" mid ${TD_TIMEOUT:-120} --variants off \
    --chain 2 --repeats 2 --reps 5
  TRACE_JAX_GROUPED_REF=tiles timeout -k 5 ${A3B_TIMEOUT:-200} python3 \
    benchmarks/train_determinism.py --preset a3b_l4 --prompts 4 --variants off --chain 1 \
    --repeats 1 --reps 3 --out $OUT/train_determinism_a3b_l4_tiles.json 2>&1 \
    | grep "^off {\|rror" | cut -c1-400
elif [ "$stage" = s51c ]; then
  # (session 51) the three gathers' gradients in one process at the Qwen3-30B-A3B shape with 4
  # layers (train_determinism.py --gathers: the same batch, each gather's step compiled in
  # turn; chains of 2 steps hashed twice, then single steps timed). Ran in session 51 on an
  # H100 (with --gathers then giving each gather the first one's trace, fixed since): out of
  # memory (the float32 ragged_dot products: 36-96 GiB asked for in autotuning; at --prompts 4,
  # 84.64 GiB for the program), so not measured
  timeout -k 5 ${TD_TIMEOUT:-420} python3 benchmarks/train_determinism.py --preset a3b_l4 \
    --variants off --gathers ${GATHERS:-repeatable,sorted,plain} --chain 2 --repeats 2 \
    --reps 3 --out $OUT/train_determinism_a3b_l4.json 2>&1 | grep -v "^I1\|^W1" \
    | grep "^[a-z_]*/[a-z]* {\|rror" | cut -c1-500
elif [ "$stage" = s51b ]; then
  # (session 51) the resume in a new process, not checked on a GPU before: loop_repeats.py
  # --processes new, each uninterrupted run, the killed run (after 3 steps) and its resumption a
  # process of its own, sharing one compilation cache that stores every program (as a GPU
  # launch's WORKDIR/xla_cache); every rollout's and train step's results hashed by step. Ran in
  # session 51 on an H100: 0 of 19 events differ (run1, and the killed and resumed run); with
  # TRACE_JAX_COMPILATION_CACHE= (none) 12 of 19 differ from the first train step
  timeout -k 5 ${LOOP_TIMEOUT:-480} python3 benchmarks/loop_repeats.py --processes new \
    --runs ${LOOP_RUNS:-2} --steps ${LOOP_STEPS:-8} --kill_after 3 --child_timeout 200 \
    --out $OUT/loop_repeats_new_processes.json 2>&1 | grep -v "^I1\|^W1" \
    | grep "vs run0\|rror\|failed" | cut -c1-600
elif [ "$stage" = s51a ]; then
  # (session 51) the MoE dispatch's gradient sums each token's k copies in slot order
  # (`kernels.take_copies`: a gather of the cotangents by the routing's inverse, no sort; session
  # 50's `take_rows` sorted them): the gather tests on the GPU (not gpu-marked: CPU tests run
  # here), the three backwards side by side at 30B-A3B training shapes (bench_take_rows.py:
  # plain scatter-add, sorted sum, slot-order sum; bit-for-bit repeats, float64 sample check,
  # CUPTI time), then the mid train step with a chain of 3 before each hash, each gather its
  # own process (repeatable = take_copies in the dispatch, sorted = session 50's, plain). Ran
  # in session 51 on an H100: 30B-A3B layer backward 0.40 ms copies, 2.88 sorted, 4.90 plain;
  # the chains repeated with copies and sorted, plain gave 3 hashes in 3; steps within 0.15%
  TEST_MARK= gpu_tests tests/kernels/test_repeatable_gather.py "" repeatable_gather \
    ${TEST_TIMEOUT:-90}
  timeout -k 5 ${BENCH_TIMEOUT:-150} python3 benchmarks/bench_take_rows.py \
    --out $OUT/bench_take_rows.json 2>&1 | grep -v "^I1\|^W1" | grep "^\[\|/ plain\|rror"
  GATHERS="repeatable sorted plain" take_rows_sides chain ${TD_TIMEOUT:-120} --variants off \
    --chain 3 --reps 5
elif [ "$stage" = s50e ]; then
  # (session 50, prepared, not run) what s50b-d left: train_determinism.py with its repeat check
  # made sensitive (3 steps in a row before each hash; calls 6-7 hashed one step from a fresh
  # Adam state, whose update is nearly the gradient's sign) with take_rows and with the plain
  # gather, each its own process (plain should differ between repeats, take_rows not), then
  # the cost of XLA's deterministic ops at the 4-layer 30B-A3B shape (s50b cut it)
  take_rows_sides chain ${TD_TIMEOUT:-150} --variants off --chain 3
  timeout -k 5 ${BENCH_TIMEOUT:-420} python3 benchmarks/bench_parallel.py --presets a3b_l4 \
    --settings 1dev --policies paper --train_determinism both \
    --out $OUT/bench_parallel_a3b_l4.json 2>&1 | grep -v "^I1\|^W1" | grep "^a3b\|rror" \
    | grep -o '^[a-z0-9_]* [a-z0-9_]* [a-z0-9_]*\|"train_[a-z_]*": [0-9.e-]*\|rror.*' \
    | paste -sd " "
elif [ "$stage" = s50d ]; then
  # (session 50) after s50c (the cost of XLA's deterministic ops was its scatter expander, 1.41x
  # at the mid shape): the two gathers whose gradients add repeated rows (the token embedding,
  # the MoE dispatch) now add them in a fixed order (`kernels.take_rows`), the rest of the train
  # step's scatters write each place once. Without deterministic ops: s50a's loop runs (off side,
  # 3 runs and the killed and resumed one), then the mid train step timed with take_rows and with
  # the plain gather (TRACE_JAX_TAKE_ROWS=plain), each its own process. Ran in session 50 on an
  # H100: every run repeated every event; the step 0.742 s with take_rows, 0.734 s plain
  LOOP_SIDES=off LOOP_RUNS=${LOOP_RUNS:-3} bash $0 s50a
  take_rows_sides take_rows ${BENCH_TIMEOUT:-150} --variants off
elif [ "$stage" = s50c ]; then
  # (session 50) s50b measured the deterministic train step 1.46x as long as the plain one at the
  # mid shape (H100): which XLA option repeats the step, at what cost (train_determinism.py:
  # each variant's step run 3 times from one state and hashed, then timed). Ran in session 50 on
  # an H100: off 0.740 s, the scatter expander alone 1.045 s (1.41x), deterministic ops 1.038 s
  # (1.40x); xla_gpu_deterministic_reductions is no option of this XLA. All hashes equal, also
  # off's: one step from a fresh optimizer state hides last-bit differences (now --chain)
  timeout -k 5 ${BENCH_TIMEOUT:-480} python3 benchmarks/train_determinism.py \
    ${TD_ARGS:-} --out $OUT/train_determinism.json 2>&1 | grep -v "^I1\|^W1" \
    | grep "^[a-z_]* {\|rror" | cut -c1-400
elif [ "$stage" = s50b ]; then
  # (session 50) after s50a: the trainer's programs compiled with deterministic ops
  # (rl.deterministic, a compile option: the rollout keeps XLA's autotuner; then the default).
  # s50a's on side with 3 runs, s49d's tests (the train step twice; the loop killed and
  # resumed), then the cost: bench_parallel's train step at the mid and 4-layer 30B-A3B shapes,
  # with deterministic ops and without, from the same state in one process. Ran in session 50 on
  # an H100: every run repeated, the tests passed, the mid step 2.13 s against 1.46 s (1.46x);
  # the 30B-A3B shape cut by the timeout
  LOOP_SIDES=on LOOP_RUNS=${LOOP_RUNS:-3} bash $0 s50a
  TEST_TIMEOUT=${TEST_TIMEOUT:-150} bash $0 s49d
  timeout -k 5 ${BENCH_TIMEOUT:-240} python3 benchmarks/bench_parallel.py --presets mid,a3b_l4 \
    --settings 1dev --policies paper --train_determinism both --out $OUT/bench_parallel.json \
    2>&1 | grep -v "^I1\|^W1" | grep "^mid\|^a3b\|rror" | grep -o \
    '^[a-z0-9_]* [a-z0-9_]* [a-z0-9_]*\|"train_[a-z_]*": [0-9.e-]*\|rror.*' | paste -sd " "
elif [ "$stage" = s50a ]; then
  # (session 50) s49d's failed resume test located: on the H100 the killed and resumed loop's
  # metrics equalled the uninterrupted one's through step 4 and differed at step 5, in one
  # process (the same compiled programs), so something computes with timing-dependent sums.
  # benchmarks/loop_repeats.py, each side its own process: LOOP_RUNS uninterrupted runs and one
  # killed after 3 steps and resumed, each rollout's and train step's results hashed by step
  # (the first differing one says where). Sides (LOOP_SIDES): off (rl.deterministic=False, the
  # default), on (the train step compiled with XLA's deterministic ops), xla_flag (off, but
  # --xla_gpu_deterministic_ops for every program). Ran in session 50 on an H100 before
  # `kernels.take_rows`: off parted at the second train step's parameters (run 1 and the resumed
  # run), xla_flag repeated every event; after it (s50d) off repeated every event
  for side in ${LOOP_SIDES:-off on xla_flag}; do
    flags=${XLA_FLAGS:-}; det=on
    [ $side = off ] && det=off
    [ $side = xla_flag ] && det=off && flags="${XLA_FLAGS:-} --xla_gpu_deterministic_ops=true"
    XLA_FLAGS=$flags timeout -k 5 ${LOOP_TIMEOUT:-240} python3 benchmarks/loop_repeats.py \
      --runs ${LOOP_RUNS:-2} --train_determinism $det --out $OUT/loop_repeats_$side.json 2>&1 \
      | grep -v "^I1\|^W1" | grep "vs run0\|^  {\|rror" | cut -c1-900 | sed "s/^/[$side] /"
  done
elif [ "$stage" = s49d ]; then
  # (session 49, prepared, not run) the trainer's repeatability on the GPU: two CPU tests run
  # as they are on the GPU, in one process each (XLA may add a gradient's scatter with atomics:
  # then the train step would not repeat itself, and no compilation cache could make a resumed
  # run repeat the killed one): the train step twice bit for bit, and the RL loop stopped after
  # 3 steps and resumed against an uninterrupted run (every metric equal)
  JAX_PLATFORMS=cuda timeout -k 5 ${TEST_TIMEOUT:-300} python3 -m pytest -q -rP -p no:xdist \
    -o addopts="" tests/rl/test_train_step.py tests/rl/test_loop_resume.py \
    -k "deterministic or resumes" > $OUT/test_trainer_repeats.txt 2>&1
  echo "trainer repeat tests rc=$?"
  grep -v "^I1\|^W1" $OUT/test_trainer_repeats.txt | grep -E "Error|assert|passed|failed" | tail -12
elif [ "$stage" = s49c ]; then
  # (session 49, prepared, not run) the bf16 o projection with K in 4 parts
  # (`bf16_mgpu.ksplit_launch`, TRACE_JAX_BF16_DENSE_KSPLIT=on: 128 CTAs where the default
  # launch and XLA's cuBLAS GEMM run 32; the parts added by the add + norm kernel, no convert
  # kernel): the dense kernel's and the add + norm kernel's GPU tests (the 4-part cases
  # included), bench_small_dots' o and q/k/v rows at 256 rows (XLA, 2 and 4 parts), then the
  # 4-layer step at B 255 with command buffers on, off / on twice (KSPLIT_SIDES), each its own
  # process, all with one compilation cache (SHARED_CACHE: XLA's autotuned picks shared), timed
  # by window paces over 512 tokens
  gpu_tests "tests/kernels/test_kernels_gpu.py tests/kernels/test_add_norm.py" \
    "bf16_dense_rows or agrees_with_model_ops" dense ${TEST_TIMEOUT:-120}
  timeout -k 5 ${BENCH_TIMEOUT:-200} python3 benchmarks/bench_small_dots.py --rows 256 \
    --products qkv,o --only "^xla$|^mgpu_bm128_wg2_kb2_s1$|^mgpu_bm128_wg2_kb1_s2$|_s4$" \
    --out $OUT/bench_small_dots.json 2>&1 | grep -v "^I1\|^W1" | grep "_r256\|rror" | cut -c1-110
  shared_cache
  n=0
  for side in ${KSPLIT_SIDES:-off on off on}; do
    n=$((n + 1))
    TRACE_JAX_BF16_DENSE_KSPLIT=$side cap_shape_profile 4 255 paper ${PROF_TIMEOUT:-150} \
      --repeats 3 --new_tokens 512 --out $OUT/profile_cap_4l_b255_ksplit_${side}_$n.json \
      | grep "guidance_on\|sha256\|Error" | cut -c1-320 | sed "s/^/[$n: ksplit $side] /"
  done
elif [ "$stage" = s49b ]; then
  # (session 49) s49a's question within a process: the 4-layer rollout at B 255 (prompt 512,
  # 256 new tokens in windows of 128), one seed, REPEAT_CALLS calls a process
  # (benchmarks/rollout_repeats.py: each call's hashes, tokens that differ from the process's
  # first call, logprobs off it where tokens agree). Sides (REPEAT_SIDES) as s49a's: cache (the
  # first stores the programs, the later load them) or plain, each its own process. Ran in
  # session 49 (H100): every process repeated itself bit for bit, the loading process the
  # storing one's numbers, the plain process other logprobs (same tokens)
  n=0; cc=/tmp/xla_cache_s49b; rm -rf $cc
  for side in ${REPEAT_SIDES:-cache cache plain}; do
    n=$((n + 1)); dir=""; [ $side = cache ] && dir=$cc
    echo "== one seed, ${REPEAT_CALLS:-3} calls: $side"
    TRACE_JAX_COMPILATION_CACHE=$dir timeout -k 5 ${PROF_TIMEOUT:-150} python3 \
      benchmarks/rollout_repeats.py --calls ${REPEAT_CALLS:-3} \
      --out $OUT/rollout_repeats_${side}_$n.json 2>&1 | grep "^call\|Error" | sed "s/^/[$n: $side] /"
  done
elif [ "$stage" = s49a ]; then
  # (session 49) the rollout's logprobs across processes: session 48's two PDL-off sides of the
  # 4-layer step drew the same tokens but differed in logprobs. Sides (DET_SIDES): plain (each
  # process compiles and autotunes its own programs) or cache (TRACE_JAX_COMPILATION_CACHE at
  # one directory: the first such side stores its programs, the later ones load them, as a
  # resumed run would), each its own process, command buffers on, one timed rollout a side; the
  # traced call's tokens and logprobs hashed. Ran in session 49 (H100, cache cache): equal
  n=0; cc=/tmp/xla_cache_s49a; rm -rf $cc
  for side in ${DET_SIDES:-cache cache plain}; do
    n=$((n + 1)); dir=""; [ $side = cache ] && dir=$cc
    echo "== logprobs across processes: $side"
    TRACE_JAX_COMPILATION_CACHE=$dir cap_shape_profile 4 255 paper ${PROF_TIMEOUT:-180} \
      --out $OUT/profile_cap_4l_b255_det_${side}_$n.json \
      | grep "guidance_on\|sha256\|Error" | cut -c1-200 | sed "s/^/[$n: $side] /"
  done
elif [ "$stage" = s48a ]; then
  # (session 48) our Mosaic kernels launched with programmatic dependent launch
  # (`TRACE_JAX_PDL`: wait = `griddepcontrol.wait` first in every CTA, which makes Mosaic launch
  # the kernel with programmatic stream serialization; early = `launch_dependents` first too).
  # s47a turned XLA's own PDL off and on to no effect; the Mosaic kernels carried no wait then.
  # First the Mosaic kernels' GPU tests with PDL early (a kernel that read before its inputs
  # were written would fail them), then the 4-layer step at B 255 per side (PDL_SIDES:
  # PDL:CB ...), each its own process, 3 timed rollouts a side (PDL_REPEATS) of PDL_NEW_TOKENS
  # (256; the window paces of each, `window_step_ms`, time the step), its traced call's
  # tokens and logprobs hashed (PDL must change no number; across processes the logprobs may
  # still differ: session 48's two PDL-off sides did). Ran in session 48 on an H100 with the
  # tests cut at 90 s and one rollout a side, cut by the call's limit after 3 sides: 5 test
  # cases passed, none failed; early:on gave off:off's tokens and logprobs bit for bit; the
  # one-repeat wall figures were too noisy to time anything (one-token calls 0.55-0.70 s).
  # Ran in session 49 (H100) with PDL_NEW_TOKENS=512, sides off:on early:on off:on early:on:
  # window paces 2-3 off 1.748 / 1.840 ms, early 1.758 / 1.842, no gain; 35 GPU test cases
  # passed under early (pytest run directly, 190 s limit)
  if [ -z "${SKIP_PDL_TESTS:-}" ]; then
    TRACE_JAX_PDL=early gpu_tests "tests/kernels/test_kernels_gpu.py tests/kernels/test_attention_gpu.py" \
      "${PDL_TESTS:-dense_stream_k_gemv or grouped_stream_k_expert or bf16_dense_rows or mosaic_stream_schedule or model_decode}" \
      pdl ${TEST_TIMEOUT:-180}
  fi
  n=0
  for side in ${PDL_SIDES:-off:on early:on wait:on off:on early:on}; do
    set -- ${side/:/ }; n=$((n + 1))
    cb=""; [ $2 = off ] && cb=--no_command_buffers
    echo "== mosaic pdl $1, command buffers $2"
    TRACE_JAX_PDL=$1 cap_shape_profile 4 255 paper ${PROF_TIMEOUT:-180} $cb \
      --repeats ${PDL_REPEATS:-3} --new_tokens ${PDL_NEW_TOKENS:-256} \
      --out $OUT/profile_cap_4l_b255_mpdl_$1_cb_$2_$n.json \
      | grep "guidance_on\|decode loop\|sha256\|Error" | cut -c1-320 | sed "s/^/[$n: pdl $1 cb $2] /"
  done
elif [ "$stage" = s47a ]; then
  # (session 47) XLA's programmatic dependent launch (PDL: `griddepcontrol.wait` at the start
  # of XLA's own kernels, launched to overlap the previous kernel's tail). jax 0.11.2 has it on
  # by default (`--xla_gpu_enable_pdl`, `--xla_gpu_enable_pdl_launch`: the dumped debug options
  # name them only when set false); Mosaic, Pallas and cuBLAS kernels carry no wait. The 48-layer
  # step spends ~0.9 ms between kernels under command buffers (session 44): what PDL gives
  # there, 4-layer step at B 255, PDL on / off, command buffers on (the rollout's way; wall
  # step) and off (kernels seen), each side its own process (PDL_SIDES: PDL:CB ...). Ran in
  # session 47 (H100, "true:on false:on" twice): 1.525 / 1.544 ms against 1.523 / 1.534, no
  # difference
  n=0
  for side in ${PDL_SIDES:-true:on false:on true:off false:off true:on false:on}; do
    set -- ${side/:/ }; n=$((n + 1))
    cb=""; [ $2 = off ] && cb=--no_command_buffers
    echo "== pdl $1, command buffers $2"
    XLA_FLAGS="--xla_gpu_enable_pdl=$1 --xla_gpu_enable_pdl_launch=$1" cap_shape_profile 4 255 \
      paper ${PROF_TIMEOUT:-150} $cb --out $OUT/profile_cap_4l_b255_pdl_$1_cb_$2_$n.json \
      | grep "guidance_on\|decode loop\|Error" | cut -c1-200 | sed "s/^/[$n: pdl $1 cb $2] /"
  done
elif [ "$stage" = s46c ]; then
  # (session 46) the bf16 product with K split in a thread block cluster, its parts added
  # through distributed shared memory (`bf16_mgpu.cluster_matmul`; deviceless SASS: 168
  # registers, 51 instructions a 64-wide K step at 8 x 2 warpgroups): its GPU tests, then the
  # q/k/v and o products at 256 rows against XLA's and the engine's launch
  # (bench_small_dots.json), then the decode step each way. Ran in session 46 (H100) with one
  # 256-row chunk and every CTA sending to the same peer at once: tests passed, every launch
  # slower (o: clusters of 8 35.0 us, of 4 21.9, XLA 18.9; the step 1.754 -> 1.827 ms). Then
  # built: 128-row chunks, the sends' rotated order and the partials in the pipeline's SMEM
  # (4 stages; the defaults; "_fixed" rows: the first order, "_first": the first run's
  # kernel). Ran in session 47 (H100) with DOTS_PRODUCTS=o
  # CLUSTER_SIDES="": 15 of 15 tests passed; o 18.4 us at 128-row chunks in clusters of 2 (the
  # launch now), XLA's 18.9, chunked 17.5; the step (by hand) no shorter: stays opt-in
  gpu_tests tests/kernels/test_kernels_gpu.py "cluster" cluster ${TEST_TIMEOUT:-120}
  # (a kernel whose cluster exchange hangs or fails spends no more device time)
  if ! grep -q " passed" $OUT/test_cluster.txt || grep -q "failed\|rror" $OUT/test_cluster.txt
  then
    tail -c 3000 $OUT/test_cluster.txt; exit 0
  fi
  timeout -k 5 ${BENCH_TIMEOUT:-300} python3 benchmarks/bench_small_dots.py --rows 256 \
    --products ${DOTS_PRODUCTS:-qkv,o} --only "${DOTS_ONLY:-^xla$|^mgpu_bm128_wg2_kb2_s1$|^mgpu_bm128_wg2_kb1_s2$|cluster}" \
    --out $OUT/bench_small_dots.json 2>&1 | grep -v "^I1\|^W1" | grep "_r256\|rror" | cut -c1-110
  # then the 4-layer decode step at B 255 with the o projection through it
  # (TRACE_JAX_BF16_CLUSTER=on) and through XLA's dot, each side its own process
  for side in ${CLUSTER_SIDES-off on}; do
    TRACE_JAX_BF16_CLUSTER=$side STEP_BATCH=255 step_4l cluster_$side \
      "o_proj\|cluster" "o_proj cluster $side"
  done
  rm -f $OUT/smi_step_*.csv
elif [ "$stage" = s46b ]; then
  # (session 46, after s46a: the padded norm's GPU test passed; the model test's kernel wrapper
  # did not pass on pad_rows, fixed; the o projection's GEMM took other kernels on every side,
  # 43.8-68.9 us a step of 4 layers, so the totals, 1.731-1.746 ms, did not decide; the float32
  # projection was removed) the combine kernel's GPU tests again, then the 4-layer step at B 255
  # with the norm's rows exact and padded, twice (S46B_SIDES), then s45d's engine smoke (SMOKE=0:
  # none)
  gpu_tests tests/kernels/test_moe_combine.py "gpu" moe_combine_rows ${TEST_TIMEOUT:-90}
  for rep in 1 2; do
    for side in ${S46B_SIDES:-exact padded}; do
      TRACE_JAX_NORM_ROWS=$side STEP_BATCH=255 step_4l rows_${side}_$rep \
        "o_proj\|attn/pad\|input_norm" "rows $side, run $rep"
    done
  done
  rm -f $OUT/smi_step_*.csv  # (the JSONs sum them up; fewer files come back whole)
  [ "${SMOKE:-1}" = 0 ] || bash $0 s45d
elif [ "$stage" = s45d ]; then
  # (prepared in session 45, not run) the rollout engine on the kernels against its jnp path
  # end to end (`gpu_engine_smoke.py`, 2 layers of the 30B-A3B shape, greedy) with session 45's
  # defaults: at B 255 (the bf16 q/k/v kernel's exact rows, the routing tables' kernels) and at
  # B 1 (one token's rows as row chunks, no routing kernel), JSONs gpu_engine_smoke_bB.json
  for b in 255 1; do
    timeout -k 5 ${SMOKE_TIMEOUT:-170} python3 benchmarks/gpu_engine_smoke.py --layers 2 \
      --batch $b --out $OUT/gpu_engine_smoke_b$b.json 2>&1 | grep -v "^I1\|^W1" \
      | grep "same_tokens_frac\|diverging_rows\|before_divergence\|rror" | sed "s/^/[B $b] /"
  done
elif [ "$stage" = s45c ]; then
  # (session 45) the rollout router's split-K parts summed in the gates kernel
  # (TRACE_JAX_ROUTER_SUM=kernel, `router_topk.topk_gates_of_parts`: XLA's batched product of 16
  # parts, no reduction kernel; deviceless census at 2 layers, B 255: see session 45's README):
  # its GPU tests, then the 4-layer decode step at B 255 each way, each side its own process.
  # Ran in session 45 on an H100: tests passed; 103 -> 99 kernels, 1.734 -> 1.732 ms; prefill
  # 177.9 -> 181.0 ms (so decode batches only now); stays opt-in
  gpu_tests tests/kernels/test_router_topk.py "gpu" router_parts ${RTEST_TIMEOUT:-90}
  for side in ${SUM_SIDES:-xla kernel}; do
    TRACE_JAX_ROUTER_SUM=$side STEP_BATCH=255 step_4l router_sum_$side "moe/\|router" \
      "router sum $side"
  done
elif [ "$stage" = s45b ]; then
  # (session 45) the 48-layer 8k-capacity rollout with session 45's defaults (the q/k/v
  # kernel's exact rows, the routing tables' kernels; side "defaults") or without them
  # (SIDE=s44: TRACE_JAX_ROUTING=xla TRACE_JAX_BF16_DENSE_ROWS=chunks), one side a call, clocks
  # sampled
  cap8k_settings_side s44 "TRACE_JAX_ROUTING=xla TRACE_JAX_BF16_DENSE_ROWS=chunks"
elif [ "$stage" = s45a ]; then
  # (session 45) the router and routing opt-ins at the rollout's batch (B 255) with the bf16
  # q/k/v kernel's exact rows (default since s44d): the router's product inside the gates
  # kernel (TRACE_JAX_ROUTER_TOPK=fused; its GPU test judged against float64 gates) and the
  # routing tables' kernels (TRACE_JAX_ROUTING=kernel), their GPU tests, then the 4-layer
  # decode step with neither, each and both, each side its own process; then a second run of
  # s44a's V-prefetch A/B (the other order). Ran in session 45 on an H100: the fused router
  # 37 us a layer against 9.6 for the product and the gates kernel, its weights 6.4e-5 from
  # float64 against XLA's 5.1e-6 (its GPU test failed; removed, router_gates.patch); the
  # routing kernels 116 -> 103 kernels, 1.774 -> 1.765 ms (now the default); V prefetch no
  # faster on the H100 (stays opt-in). Now: the routing sides only
  gpu_tests "tests/kernels/test_router_topk.py tests/kernels/test_routing.py" "gpu" \
    router_routing ${RTEST_TIMEOUT:-120}
  # (sides as TOPK:ROUTING words, which a ROUTER_SIDES override can give too)
  for side in ${ROUTER_SIDES:-kernel:xla kernel:kernel}; do
    set -- ${side/:/ }
    TRACE_JAX_ROUTER_TOPK=$1 TRACE_JAX_ROUTING=$2 STEP_BATCH=255 step_4l topk_$1_routing_$2 \
      "moe/\|router\|routing" "topk $1, routing $2"
  done
  prefetch_v_ab ${V_SIDES-on off}
elif [ "$stage" = s44d ]; then
  # (session 44, ran in session 45 on an H100: tests passed; 120 -> 116 kernels, 1.763 -> 1.750
  # ms of kernels a step, now the default) the bf16 q/k/v kernel taking the rollout's 255 rows
  # without a pad to 256 and a slice back (TRACE_JAX_BF16_DENSE_ROWS=exact: 48-layer profile,
  # s44b: 96 XLA kernels a step, ~0.19 ms of kernels plus their gaps): its GPU tests (200 and
  # 255 rows, both modes), then the 4-layer decode step at the 8k-capacity shape at B 255 each
  # way, each side its own process; then, if both passed, SIDE=exact s41a-style 48-layer
  # rollouts are the next step (cap8k_settings_side)
  gpu_tests tests/kernels/test_kernels_gpu.py "bf16_dense_rows_chunks" dense_rows \
    ${TEST_TIMEOUT:-120}
  # and the attention's V-prefetch order (opt-in since session 44) against the default order
  gpu_tests tests/kernels/test_attention_gpu.py "prefetch_v" prefetch_v ${TEST_TIMEOUT:-120}
  for side in chunks exact; do
    TRACE_JAX_BF16_DENSE_ROWS=$side STEP_BATCH=255 step_4l dense_rows_$side "attn/" "rows $side"
  done
elif [ "$stage" = s44c ]; then
  # (session 44) the o projection's dot writing bf16 itself (TRACE_JAX_XLA_DOT_OUT=bf16; s44b's
  # 48-layer profile: 48 float32 -> bf16 converts of 2.4 us a step after XLA's dot): its GPU
  # test, then the 4-layer decode step at the 8k-capacity shape each way, each side its own
  # process. Ran on an H100 in session 44: with bf16 out XLA split the product in two kernels
  # (a float32 partial product and a reduction: 17.0 us a layer against 11.2 + 2.6 for the
  # dot and the convert); removed (results/session44_h200_2026-12-05/xla_dot_out.patch)
  gpu_tests tests/kernels/test_kernels_gpu.py "xla_bf16_product" xla_dot_out ${TEST_TIMEOUT:-90}
  for side in float32 bf16; do
    TRACE_JAX_XLA_DOT_OUT=$side step_4l xla_dot_$side "o_proj\|nvjet" "dot out $side"
  done
elif [ "$stage" = s44b ]; then
  # (session 44) s42a with command buffers off: with them on (s42a, session 44) the profiler
  # sees the decode windows' graphs, not their kernels (11 kernels a step); the 48-layer step
  # at the 8k-capacity shape kernel by kernel, clocks sampled beside it
  with_clocks profile_48l_nocb cap_shape_profile 48 ${BATCH:-255} paper ${PROFILE_TIMEOUT:-400} \
    --no_command_buffers --out $OUT/profile_cap_48l_b${BATCH:-255}_nocb.json \
    | grep "guidance_on\|decode loop\|Error\|^\[clocks\|^ " | head -40
elif [ "$stage" = s43a ]; then
  # (session 43) the bf16 attention projections at 256 rows with XLA's Triton GEMM fusions off
  # (`bench_small_dots` rows xla_cublas / xla_cublaslt beside xla and the Mosaic kernel: in the
  # 8k-capacity step XLA's o projection takes ~12 us a layer against 3.9 us of weight bytes),
  # then the GPU tests of s42c under session 43's defaults (the attention counters and the
  # guidance bits from the kernels): the q/k/v kernel's and the stream attention's. Ran on an
  # H100 in session 43: cuBLAS 8-31% slower than XLA's choice there; the stream attention's
  # tests cut at 150 s after 9 passed (s42c's settings are the defaults now)
  timeout -k 5 ${SD_TIMEOUT:-120} python3 benchmarks/bench_small_dots.py --rows 256 \
    --products qkv,o --out $OUT/bench_small_dots_proj.json 2>&1 \
    | grep -v "^I1\|^W1" | grep "_r256\|Error" | cut -c1-120
  bash $0 s42c_inner
elif [ "$stage" = s42b ]; then
  # (session 42) the GPU tests of session 42's opt-ins (any sm_90 card), then stage s42d at once
  # (a warm machine is kept 30 s). TRACE_JAX_ATTN_COUNTS=given: the stream attention's merge
  # counters zeroed by the q/k/v kernel instead of XLA's zero fill and its 47 copy kernels a
  # 48-layer step (the counters given against the kernel's own, bit for bit, three calls on the
  # same counters left zero; the one-layer model's decode with both kernels against XLA's path).
  # TRACE_JAX_GUIDANCE_BITS=kernel: the q/k/v and expert input kernels write the guidance bits
  # of what they quantize (the q/k/v kernel's bits of its own rows; the expert input kernels'
  # model against XLA's ops, records bit for bit). All passed in session 43; both are the GPU
  # defaults since, and the settings below keep the stage as it ran
  export TRACE_JAX_ATTN_COUNTS=given TRACE_JAX_GUIDANCE_BITS=kernel
  gpu_tests tests/kernels/test_attention_gpu.py "counters_given" counters ${TEST_TIMEOUT:-150}
  gpu_tests tests/kernels/test_qkv_append.py \
    "model_with_kernel_on_gpu or (agrees_with_xla_path and mosaic)" qkv_model ${TEST_TIMEOUT:-150}
  gpu_tests tests/kernels/test_glue_in_model.py "expert_input_kernels" expert_in \
    ${TEST_TIMEOUT:-120}
elif [ "$stage" = s42d ]; then
  # (session 42) the 48-layer 8k-capacity rollout with session 42's opt-ins (side "given": the
  # attention counters from the q/k/v kernel, the guidance bits from the quantizing kernels;
  # deviceless census 1,155 -> 1,107 kernels a step with the counters, 1,074 -> 1,011 with the
  # bits) or without them (SIDE=own), clocks sampled. After s42b's tests have passed
  export TRACE_JAX_ATTN_COUNTS=given TRACE_JAX_GUIDANCE_BITS=kernel
  cap8k_settings_side own "TRACE_JAX_ATTN_COUNTS=own TRACE_JAX_GUIDANCE_BITS=xla" given
elif [ "$stage" = s42c ]; then
  # (session 42) more GPU tests under session 42's opt-ins (any sm_90 card): all of the q/k/v
  # kernel's and the Mosaic attention's stream schedule and model decode ones
  export TRACE_JAX_ATTN_COUNTS=given TRACE_JAX_GUIDANCE_BITS=kernel
  gpu_tests tests/kernels/test_attention_gpu.py "counters_given" counters ${TEST_TIMEOUT:-150}
  gpu_tests tests/kernels/test_qkv_append.py "gpu" qkv ${TEST_TIMEOUT:-150}
  gpu_tests tests/kernels/test_attention_gpu.py "mosaic_stream or model_decode" attn_stream \
    ${TEST_TIMEOUT:-150}
elif [ "$stage" = s42a ]; then
  # (prepared in session 41) why the 48-layer rollout's steps are ~7% longer than the 4-layer
  # kernels predict (session 41: window 1 at 14.7 ms against ~13.7; session 40's 3.5% kernel
  # cut at 4 layers did not show at 48): the decode step at the 8k-capacity shape profiled at
  # 48 layers as the rollout runs it (command buffers on, B 255, 256 new tokens in windows of
  # 128), the GPU's clocks sampled beside it: the wall step against the kernels' sum gives the
  # time between kernels; the clocks say whether the SM clock drops under the long load. Ran in
  # session 44: with command buffers on the profiler sees the windows' graphs, not their
  # kernels (its wall step is the useful figure); s44b is the same step with them off
  with_clocks profile_48l cap_shape_profile 48 ${BATCH:-255} paper ${PROFILE_TIMEOUT:-540} \
    --out $OUT/profile_cap_48l_b${BATCH:-255}.json | grep "guidance_on\|decode loop\|Error\|^\[clocks\|^ " | head -40
elif [ "$stage" = s40b ]; then
  # (prepared in session 39) every opt-in glue kernel together at 48 layers, against the
  # defaults, one side a call (`cap8k_settings_side`, ~320 s a side): the q/k/v kernel, the
  # add + norm kernel, the router's product in its gates kernel, the routing tables' kernels
  # and the MoE combine kernel (deviceless census at 2 layers, B 256: 84 -> 62 kernels a step).
  # Run after s39a, s39b, s40a and s40c have shown each one correct on the GPU; OPTIN overrides
  # the list (space-separated NAME=VALUE settings)
  optin="TRACE_JAX_DECODE_QKV=kernel TRACE_JAX_ADD_NORM=kernel TRACE_JAX_MOE_COMBINE=kernel"
  optin=${OPTIN:-"$optin TRACE_JAX_ROUTING=kernel"}  # (ROUTER_TOPK=fused: gone, s45a)
  cap8k_settings_side optin "$optin"  # SIDE=optin, else the defaults (one side a call)
elif [ "$stage" = s39c ]; then
  # (prepared in session 38) session 38's three defaults at 48 layers on one host (its two
  # rollouts ran on hosts that copied guidance 7-9x slower than session 37's, so the 4-layer
  # gain, 1.634 -> 1.602 ms of kernels a step, did not show): the 8k-capacity rollout with
  # session 37's settings (the router's XLA ops, the SwiGLU row in one tile, the E2M1 index by
  # comparisons) (SIDE=s37) or with the defaults
  cap8k_settings_side s37 \
    "TRACE_JAX_ROUTER_TOPK=xla TRACE_JAX_SWIGLU_SPLIT=off TRACE_JAX_E2M1_INDEX=midpoints" s38
elif [ "$stage" = s38d ]; then
  # (session 38) the 48-layer rollout after s38c's defaults (call 4) took 36.4 s against 35.0,
  # its one-token calls 8.3 s against 6.3-6.7: the 4-layer prefill program's kernels with the
  # router gates kernel off and on, each side its own process (its totals and the sources that
  # changed), then its GPU test
  for side in xla kernel; do
    TRACE_JAX_ROUTER_TOPK=$side step_4l topk_$side "decode loop" $side 200
    python3 -c "import json, sys
p = json.load(open(sys.argv[1]))['profile']['prefill']
print('prefill kernel ms', round(p['kernel_ms'], 2), 'kernels', p['kernels'])
for s in p['sources'][:14]: print('  %8.3f ms x %3d  %s' % (s['ms'], s['calls'], s['source'][:90]))
for s in p['sources']:
  if any(t in s['source'] for t in ('router', 'top_k', 'softmax', 'moe/div', 'moe/convert')):
    print('  %8.3f ms x %3d  %s' % (s['ms'], s['calls'], s['source'][:90]))" \
      $OUT/profile_cap_4l_b256_nocb_topk_$side.json | sed "s/^/[$side] /"
  done
elif [ "$stage" = s38c ]; then
  # (session 38) the E2M1 index by float32 arithmetic (`e2m1.magnitude_index_rtne`: one
  # rounding addition and one integer rounding instead of 7 comparisons and adds; exhaustively
  # equal on CPU): the index over every non-negative float32 by XLA:GPU and in a Triton body, the
  # GPU numerics and quantizing kernels' tests; bench_row_quant and bench_swiglu_quant with the
  # comparisons (midpoints) and the bits, each side its own process; the 4-layer decode step
  # with the bits (s38a's "on" side, call 1, is the comparisons' side); then s38b's test and
  # the 4-layer step with the router gates kernel (the bits on)
  gpu_tests "tests/quant/test_e2m1.py tests/quant/test_gpu_numerics.py tests/kernels/test_row_quant.py tests/kernels/test_swiglu_quant.py tests/kernels/test_kv_append.py" \
    "gpu" e2m1_bits ${ETEST_TIMEOUT:-170}
  for side in midpoints bits; do
    TRACE_JAX_E2M1_INDEX=$side timeout -k 5 ${BQ_TIMEOUT:-90} python3 benchmarks/bench_row_quant.py \
      --tiles 2048 --warps 4 --iters 30 --out $OUT/bench_row_quant_$side.json 2>&1 \
      | grep -v "^I1\|^W1" | grep "us \|rror" | tail -8 | sed "s/^/[$side] /"
    TRACE_JAX_E2M1_INDEX=$side timeout -k 5 ${BS_TIMEOUT:-90} python3 \
      benchmarks/bench_swiglu_quant.py --tiles 2048 --warps 4 --splits on --iters 30 \
      --out $OUT/bench_swiglu_quant_$side.json 2>&1 | grep -v "^I1\|^W1" \
      | grep "us \|rror" | tail -6 | sed "s/^/[$side] /"
  done
  step_4l e2m1_bits "row_quant\|swiglu\|kv_append"
  gpu_tests tests/kernels/test_router_topk.py "gpu" router_topk ${RTEST_TIMEOUT:-80}
  TRACE_JAX_ROUTER_TOPK=kernel step_4l topk_kernel "moe/\|router" topk
elif [ "$stage" = s37b ]; then
  # (prepared in session 36, run in session 37 as calls 4 and 7) the 48-layer 8k-capacity
  # rollout after session 36's changes (no window launched past the rows' largest limit: the
  # 9th window of a 2,048-token call and the one-token calls' 2nd are gone), its window pace
  # (`window_step_ms`) and marks
  cap8k_2048 ${CAP_TIMEOUT:-400}
  python3 -c "import json, sys
for r in json.load(open(sys.argv[1]))['results']:
  print('total s', r.get('total_s'), 'one', r.get('prefill_plus_first_step_each_ms'),
        'windows share', r.get('floor_over_window_steps'), 'step ms', r.get('window_step_ms'))
  for k, ts in (r.get('chunk_timelines') or {}).items():
    for t in ts: print(k, t['launches'], json.dumps(t['seconds']), json.dumps(t['marks']))" \
    $OUT/bench_rollout_cap8k_48l.json
elif [ "$stage" = s37a ]; then
  # (prepared in session 36, not run in 36 or 37) s36f at the 8k-capacity shape: 48 layers,
  # B 255, the cache for 7,680 new tokens, 64 generated in one window; where the prefill
  # launch's 0.46 s goes (s36f at 12 layers, B 128: 0.01 s with or without command buffers)
  timeout -k 5 ${PD_TIMEOUT:-540} python3 benchmarks/probe_dispatch.py --layers 48 --batch 255 \
    --prompt_len 512 --new_tokens 7680 --generate_tokens 64 --decode_chunk 256 --repeats 2 \
    --out $OUT/probe_dispatch_cap8k.json 2>&1 | grep -v "^I1\|^W1" | tail -8
elif [ "$stage" = s36f ]; then
  # (session 36) the chunked engine's launches: the prefill program with command buffers on,
  # off, on again, then guidance copied pinned; every side's rollout against the first's bit
  # for bit (probe_dispatch.py: 12 layers, B 128, prompt 512, 256 tokens in windows of 64)
  timeout -k 5 ${PD_TIMEOUT:-280} python3 benchmarks/probe_dispatch.py --layers 12 --batch 128 \
    --prompt_len 512 --new_tokens 256 --decode_chunk 64 --repeats 3 \
    --out $OUT/probe_dispatch.json 2>&1 | grep -v "^I1\|^W1" | tail -8
elif [ "$stage" = s36e ]; then
  SKIP_HC=1 bash $0 s36d_inner
elif [ "$stage" = s36a ]; then
  # (prepared in session 35, run in session 36 as call 2) the chunked engine's landing
  # on a landing thread (TRACE_JAX_GUIDANCE_LANDING=thread) against the calling thread (the
  # default, s35c's rollout: 35.5 s): the 48-layer 8k-capacity rollout, each side in its own
  # process, their host seconds by part printed. The first side's programs go to a persistent
  # compilation cache for the second (a side took 250-330 s in session 35, ~150-210 s of it
  # the first call's compile)
  export TRACE_JAX_COMPILATION_CACHE=/tmp/jax_cache_s36a
  for side in thread inline; do
    limit=${SIDE_TIMEOUT:-330}; [ $side = inline ] && limit=${INLINE_TIMEOUT:-250}
    TRACE_JAX_GUIDANCE_LANDING=$side cap8k_2048 $limit | sed "s/^/[$side] /"
    python3 -c "import json, sys
for r in json.load(open(sys.argv[1]))['results']:
  print('first call s', r.get('first_call_s'), 'total s', r.get('total_s'))
  for k, ts in (r.get('chunk_timelines') or {}).items():
    for t in ts: print(k, json.dumps(t))" $OUT/bench_rollout_cap8k_48l.json | sed "s/^/[$side] /"
    mv $OUT/bench_rollout_cap8k_48l.json $OUT/bench_rollout_cap8k_48l_$side.json
  done
elif [ "$stage" = s36c ]; then
  # (prepared in session 35, run in session 36 as call 1) how the guidance's copies to host
  # memory go on the H200
  # (bench_host_copy: 5.6 GB in 1,000 arrays, the prompt's at the 8k-capacity shape): plain,
  # started async, on arrays still being made, via pinned host memory, and on another thread
  # (does this thread keep running?); then s36b
  timeout -k 5 ${HC_TIMEOUT:-150} python3 benchmarks/bench_host_copy.py --total_gb 5.6 \
    --arrays 1000 --busy_s 2 --out $OUT/bench_host_copy.json 2>&1 | grep -v "^I1\|^W1" | tail -8
  bash $0 s36b_inner
elif [ "$stage" = s36b ]; then
  # (prepared in session 35, run in session 36 within call 1) what V^T as registers would give
  # the decode attention:
  # a timing probe (session 35's attn_v_registers_probe.patch, applied to a copy of the tree in
  # /tmp/attn_probe) feeds V's decoded registers, as [64 tokens, 64 hd], straight to the PV
  # wgmma as [64 hd, 64 tokens]: its results are wrong, its instruction mix is that of a cache
  # whose V codes decode to V^T (no V SMEM stores, fences or wait between the halves; SASS:
  # 465 -> 455 instructions a tile, STSM 9 -> 1), less the per-token scales such a cache would
  # need. Against the default, the rollout-shaped live rows beside
  rm -rf /tmp/attn_probe && mkdir -p /tmp/attn_probe && cp -r trace_jax /tmp/attn_probe/ && \
    (cd /tmp/attn_probe && git apply $OLDPWD/benchmarks/results/session35_h200_2026-12-04/attn_v_registers_probe.patch \
      || patch -p1 < $OLDPWD/benchmarks/results/session35_h200_2026-12-04/attn_v_registers_probe.patch) \
    && grep -c "TIMING PROBE" /tmp/attn_probe/trace_jax/kernels/attention_mgpu.py
  LIVE_KERNELS=stream LIVE=256x8192x1600,64x8192x1536,16x8192x2048 \
    attention_ab "new v_registers_probe" 8 ${BENCH_TIMEOUT:-95}
elif [ "$stage" = s35e ]; then
  # (session 35) the chunked engine's host copies on a landing thread: the 4-layer decode at the
  # 8k-capacity shape (s35a's flags: B 256, windows of 128), its timing line only (the profile
  # after it is cut off by the timeout: the device time left was ~250 s)
  cap_shape_profile 4 256 paper ${PROF_TIMEOUT:-110} --no_command_buffers \
    --out $OUT/profile_cap_4l_b256_nocb.json | grep "guidance_on"
elif [ "$stage" = s35d ]; then
  # (session 35) the engine's GPU test of the chunked windows (command buffers on and off, and
  # the one-program engine: the same rollout bit for bit), then s35c's rollout with a window's
  # records copied to host memory only once it is known to run
  gpu_tests tests/rollout/test_engine_gpu.py "command_buffers" engine_windows ${ETEST_TIMEOUT:-150}
  bash $0 s35c_inner
elif [ "$stage" = s35b ] || [ "$stage" = s35c ]; then
  # (session 35) the 48-layer FP4 rollout at 8k capacity with the final host guidance arrays made
  # and their prompt pages committed by host threads while the device prefills; the host's
  # seconds by part of each timed call (`ChunkTimeline`) printed from the row's JSON. s35c: the
  # same with each decode window launched before the host reads whether the last one ended
  cap8k_2048 400
  python3 -c "import json, sys
for r in json.load(open(sys.argv[1]))['results']:
  for k, ts in (r.get('chunk_timelines') or {}).items():
    for t in ts: print(k, json.dumps(t))" $OUT/bench_rollout_cap8k_48l.json
elif [ "$stage" = s35a ]; then
  # (session 35; prepared in session 34) the attention's code words in
  # swizzled SMEM tiles (TRACE_JAX_ATTN_CODE_SMEM=swizzled: Mosaic's wgmma-layout loads need no
  # staggering, 465 -> 448 instructions a tile in the SASS): the Mosaic attention GPU tests (the
  # new one bit for bit against plain rows; the rest re-run with V in halves the default), then
  # bench_attention rows of plain and swizzled, the rollout-shaped live rows beside; then the
  # 4-layer decode step with its prefill program's kernels (profile_decode's new prefill rows).
  # Ran: the tests passed through the new one (the kv_words pair ran out of time); swizzled
  # 3-6% slower on every row, removed (results/session35_h200_2026-12-04/code_smem_swizzled.patch)
  gpu_tests tests/kernels/test_attention_gpu.py "mosaic or kv_words" attn_mosaic \
    ${MOSAIC_TIMEOUT:-200}
  LIVE_KERNELS=stream LIVE=256x8192x1600,64x8192x1536,16x8192x2048 \
    attention_ab "new code_swizzled" 8 ${BENCH_TIMEOUT:-95}
  cap_shape_profile 4 256 paper ${PROF_TIMEOUT:-200} --no_command_buffers \
    --out $OUT/profile_cap_4l_b256_nocb.json | grep "guidance_on\|decode loop:\|prefill"
elif [ "$stage" = s34f ]; then
  # (session 34) V's half 1 decoded while half 0's product runs (TRACE_JAX_ATTN_V1_DECODE=overlap)
  # against with half 0 (the default): B 64 x 32k and the rollout-shaped live rows, each side
  # in its own process (relerr against the reference printed per row). Overlap was 6-7%
  # slower and was removed (its code: results/session34_h200_2026-12-04/v1_decode_overlap.patch)
  for side in early overlap; do
    TRACE_JAX_ATTN_V1_DECODE=$side timeout -k 5 ${BENCH_TIMEOUT:-60} python3 \
      benchmarks/bench_attention.py --what decode --formats nvfp4_mosaic --batches 64 \
      --contexts 32768 --live 256x8192x1600,64x8192x1536 --live_kernels stream \
      --budget_s $(( ${BENCH_TIMEOUT:-60} - 15 )) --out $OUT/bench_attention_v1_$side.json \
      2>&1 | grep -v "^I1\|^W1" | grep "mosaic" | sed "s/^/[$side] /"
  done
elif [ "$stage" = s34e ]; then
  # (session 34) issue 8's attention bar with the new default (V through SMEM in halves, 4
  # stages): the NVFP4 Mosaic kernel against the bf16-KV kernel at B 16 / 64 x 8k / 32k
  timeout -k 5 ${BENCH_TIMEOUT:-140} python3 benchmarks/bench_attention.py --what decode \
    --formats bf16,nvfp4_mosaic --batches 16,64 --contexts 8192,32768 \
    --budget_s $(( ${BENCH_TIMEOUT:-140} - 20 )) --out $OUT/bench_attention_bf16_vs_fp4.json \
    2>&1 | grep -v "^I1\|^W1" | tail -12
elif [ "$stage" = s34d ]; then
  # (session 34) chained tiles' output stores waited before the staging tile's next write
  # (TRACE_JAX_EPILOGUE_WAIT=deferred) instead of right after the store's issue: GPU tests (bit
  # for bit the waited-at-once kernel), then the grouped rows at 512, 2,048 and 2,208 rows (8
  # chained tiles of 3 K steps for down, 6 of 8 for gate+up), each setting in its own
  # process, two rounds. No faster (within +-1.5 us); the setting was removed after the run
  # (its code: benchmarks/results/session34_h200_2026-12-04/deferred_store.patch, on 4acd458)
  gpu_tests tests/kernels/test_kernels_gpu.py "deferred_store" store ${KTEST_TIMEOUT:-150}
  rows=""
  for m in 512 2048 2208; do
    rows=$rows,moe_gateup_E128_K2048_N1536_M${m}_nvfp4_auto\$,moe_down_E128_K768_N2048_M${m}_nvfp4_auto\$
  done
  for round in 1 2; do
    for w in after deferred; do
      mkdir -p $OUT/$w$round
      TRACE_JAX_EPILOGUE_WAIT=$w timeout -k 5 ${BK_TIMEOUT:-100} python3 benchmarks/bench_kernels.py \
        --iters 20 --grouped_rows 2048 --only "${rows#,}" --out $OUT/$w$round 2>&1 \
        | grep "us_call" | sed "s/^/[$w$round] /" | cut -c1-150
      mv $OUT/$w$round/bench_kernels.json $OUT/bench_kernels_$w$round.json 2>/dev/null
    done
  done
elif [ "$stage" = s34c ]; then
  # (session 34) s33c's rollout with the attention's V through SMEM in halves and 4 stages
  # now the default: the 8k-capacity FP4 rollout, 48 layers, 2,048 tokens a sequence (the
  # first try was stopped when the machine was taken back; its profile is left out to fit)
  cap8k_2048 400
elif [ "$stage" = s34b ]; then
  # (session 34) the decode attention with V through SMEM in halves (TRACE_JAX_ATTN_V_SMEM=halves,
  # 32 KB less SMEM: a 4th pipeline stage fits; Nsight Compute on B 16 x 8k, session 24: the top
  # stall was the wait for a stage's TMA data): GPU tests (bit for bit the whole-V kernel), then
  # bench_attention rows of the default and of halves with 4 stages (SIDES), the live rows at
  # the rollout's shape (B 256, 8k cache, ~1,600 visible); then Nsight Compute on the default
  # kernel at that shape (`ncu_kernels.py attn_b256_ctx1600`: ncu itself crashed there in
  # session 34, a segmentation fault after connecting, before any report)
  gpu_tests tests/kernels/test_attention_gpu.py "v_halves" attn_halves ${MOSAIC_TIMEOUT:-120}
  LIVE_KERNELS=stream LIVE=256x8192x1600,64x8192x1536,16x8192x2048 \
    attention_ab "${SIDES:-new v_halves4}" 8 ${BENCH_TIMEOUT:-95}
  NCU_CASES=attn_b256_ctx1600 bash $0 s23b_inner
elif [ "$stage" = s34a ]; then
  # (session 33; prepared, not run: the device time was spent) the routing tables from two
  # kernels, each row's group counted once (rows: sorted positions, order, partial counts;
  # chunks: sizes, ends, chunk tables, slots; the one-kernel grid took 15.4 us at 2,048 rows
  # against XLA's 10.4, s33b): GPU tests, bench_routing, then the decode step kernel by kernel
  # with TRACE_JAX_ROUTING=kernel (the default side: this session's call 1)
  routing_tests_bench
  routing_profile
elif [ "$stage" = s33d ]; then
  # (session 33) the token draw as one Pallas kernel (`kernels.gumbel_argmax`: threefry bits,
  # Gumbel transform and argmax, jax.random.categorical's tokens bit for bit; XLA's fusion
  # took 257 us a step at B 256): its GPU tests, bench_sampler (kernel vs XLA's fusion, tokens
  # compared) at B 1 and 256, then the decode step kernel by kernel as s32d (session 32's call
  # 4 and this session's call 1 are the XLA side). Ran: tests passed, the bench's print failed,
  # the kernel took 250.3 us in the step and the logsumexp's max became a pass of its own:
  # removed; apply results/session33_h200_2026-12-04/gumbel_argmax_kernel.patch to rerun
  gpu_tests tests/kernels/test_gumbel_argmax.py "gpu" gumbel ${GTEST_TIMEOUT:-80}
  timeout -k 5 ${BS_TIMEOUT:-100} python3 benchmarks/bench_sampler.py --batches 1,256 \
    --out $OUT/bench_sampler.json 2>&1 | grep -v "^I1\|^W1" | grep "_b\|Error"
  cap_shape_profile 4 256 paper ${PROF_TIMEOUT:-150} --no_command_buffers \
    --out $OUT/profile_cap_4l_b256_nocb_gumbel.json \
    | grep "guidance_on\|decode loop:\|gumbel\|reduce\|nvjet"
elif [ "$stage" = s33c ]; then
  # (session 33) the 8k-capacity FP4 rollout, 48 layers, 2,048 tokens a sequence (as s32b),
  # with the bf16 q/k/v kernel now the default; then the decode step kernel by kernel at the
  # context the rollout averages (prompt 1,536 + 128 new: attention's share at ~1.6k tokens)
  cap8k_2048 360
  timeout -k 5 ${PROF_TIMEOUT:-170} python3 benchmarks/profile_decode.py --layers 4 \
    --policy paper --path kernels --batch 256 --prompt_len 1536 --new_tokens 128 \
    --cache_new_tokens 6656 --decode_chunk 128 --repeats 1 --no_command_buffers \
    --out $OUT/profile_cap_4l_b256_ctx1536_nocb.json 2>&1 | grep -v "^I1\|^W1" | tail -40
elif [ "$stage" = s33b ]; then
  # (session 33) the routing kernel's second version (tiles unrolled and summed elementwise, one
  # reduction at the end; s33a's first version took 44 us at 2,048 rows against XLA's 10.5):
  # its GPU tests and bench_routing at 4-16 warps; the router's float32 product written as
  # XLA's bf16 x6 / x3 dot algorithms and as one bf16 product with w's three bf16 parts
  # (bench_small_dots' router rows at 1 and 256 rows); the engine's GPU tests with the bf16
  # dense kernel now the default
  routing_tests_bench --warps 4,8,16
  timeout -k 5 ${SD_TIMEOUT:-120} python3 benchmarks/bench_small_dots.py --rows 1,256 \
    --products router --out $OUT/bench_small_dots_router.json 2>&1 | grep -v "^I1\|^W1" \
    | grep "router\|Error"
  gpu_tests tests/rollout/test_engine_gpu.py "" engine ${ETEST_TIMEOUT:-150}
elif [ "$stage" = s33a ]; then
  # (session 33) the routing tables' kernel as a grid of 32-row programs (one launch where XLA
  # ran three reductions over [2,176 x 2,048] terms and two small kernels, ~13 us a layer at
  # B 256): its GPU tests (tables bit for bit, up to 4,096 rows), bench_routing (kernel vs XLA
  # path, 256-4,096 rows); the decode step kernel by kernel as s32d with
  # TRACE_JAX_ROUTING=kernel, then with TRACE_JAX_BF16_DENSE=kernel too (the default side:
  # call 4 of session 32; bf16 dense alone: s32g); the engine smoke at 160 sequences with the
  # defaults (s32g's with the bf16 dense kernel had 12 of 160 rows diverge at near-ties: is
  # that the kernel's?) and with both settings
  routing_tests_bench
  routing_profile
  TRACE_JAX_ROUTING=kernel TRACE_JAX_BF16_DENSE=kernel cap_shape_profile 4 256 paper \
    ${PROF_TIMEOUT:-200} --no_command_buffers \
    --out $OUT/profile_cap_4l_b256_nocb_routing_dense.json | tail -45
  timeout -k 5 ${SMOKE_TIMEOUT:-120} python3 benchmarks/gpu_engine_smoke.py --layers 1 \
    --batch 160 --out $OUT/gpu_engine_smoke_default.json 2>&1 | grep -v "^I1\|^W1" | tail -3
  TRACE_JAX_ROUTING=kernel TRACE_JAX_BF16_DENSE=kernel timeout -k 5 ${SMOKE_TIMEOUT:-120} \
    python3 benchmarks/gpu_engine_smoke.py --layers 1 --batch 160 \
    --out $OUT/gpu_engine_smoke_routing_dense.json 2>&1 | grep -v "^I1\|^W1" | tail -3
elif [ "$stage" = s32g ]; then
  # (session 32; prepared, not run: the device time was spent) TRACE_JAX_BF16_DENSE=kernel, the
  # bf16 q, k and v fused at weight sync and run by the bf16 kernel with 128-row chunks at
  # 129-256 rows (q/k/v alone 14.9 against XLA's 19.7 us, s32f): the kernel's GPU tests, the
  # engine smoke at 160 sequences (kernel path vs jnp reference tokens), then the decode step
  # kernel by kernel as s32d (its default-side figures: call 4 of session 32)
  gpu_tests tests/kernels/test_kernels_gpu.py "bf16_dense_rows" dense_rows ${DTEST_TIMEOUT:-70}
  TRACE_JAX_BF16_DENSE=kernel timeout -k 5 ${SMOKE_TIMEOUT:-150} python3 \
    benchmarks/gpu_engine_smoke.py --layers 1 --batch 160 \
    --out $OUT/gpu_engine_smoke_bf16_dense.json 2>&1 | grep -v "^I1\|^W1" | tail -4
  TRACE_JAX_BF16_DENSE=kernel cap_shape_profile 4 256 paper ${PROF_TIMEOUT:-240} \
    --no_command_buffers --out $OUT/profile_cap_4l_b256_nocb_bf16_dense.json | tail -45
elif [ "$stage" = s32f ]; then
  # (session 32) the bf16 kernel with 128 / 256 rows a chunk (wgmma N 128 / 256, 1-2 compute
  # warpgroups; `bf16_mgpu.dense_matmul`) for the `paper` policy's bf16 q/k/v and o products
  # at 256 rows (XLA 21.6 / 12.1 us a layer in s32d's step, 4.9 / 3.9 us of weight bytes):
  # its GPU tests, then bench_small_dots' rows at 256 rows
  gpu_tests tests/kernels/test_kernels_gpu.py "bf16_dense_rows" dense_rows ${DTEST_TIMEOUT:-70}
  timeout -k 5 ${SD_TIMEOUT:-140} python3 benchmarks/bench_small_dots.py --rows 256 \
    --out $OUT/bench_small_dots.json 2>&1 | grep -v "^I1\|^W1" | grep "qkv\|o_\|Error"
elif [ "$stage" = s32e ]; then
  # (session 32) row_quant's GPU tests with 2,048 elements a program (the new default), then
  # issue 7's two bars on the line, each round its own process (5% run-to-run spread): grouped
  # gate+up at 256 rows against tokamax, the GEMV 8192 x 28672 at 1 row against XLA's bf16
  gpu_tests tests/kernels/test_row_quant.py "gpu" row_quant ${RTEST_TIMEOUT:-80}
  for round in 1 2; do
    mkdir -p $OUT/r$round
    timeout -k 5 ${BK_TIMEOUT:-110} python3 benchmarks/bench_kernels.py --iters 20 --only \
      'moe_gateup_E128_K2048_N1536_M256_nvfp4_auto$,moe_gateup_E128_K2048_N1536_M256_tokamax_bf16$,ffn_8192x28672_B1_nvfp4$,ffn_8192x28672_B1_xla_bf16$' \
      --out $OUT/r$round 2>&1 | grep "us_call" | sed "s/^/[r$round] /" | cut -c1-150
    mv $OUT/r$round/bench_kernels.json $OUT/bench_kernels_r$round.json 2>/dev/null
  done
elif [ "$stage" = s32d ]; then
  # (session 32) the decode step kernel by kernel as s28c (FP4 `paper`, 8k-capacity shape, 4
  # layers, B 256, command buffers off), with session 31's wgmma wait and row_quant's 2,048
  # elements a program; the decode program's HLO kept (the row_quant calls' shapes)
  cap_shape_profile 4 256 paper ${PROF_TIMEOUT:-240} --no_command_buffers \
    --out $OUT/profile_cap_4l_b256_nocb.json --hlo_out $OUT/decode_hlo.txt | tail -45
elif [ "$stage" = s32c ]; then
  # (session 32) the activation-site NVFP4 quantization kernel (row_quant, Triton) per launch
  # shape at the decode step's expert sites, B 256 and 32, bit for bit against the XLA path
  # (session 28's profile: 13.2 us a layer at the down input [2,048, 768], 5.4 at [256, 2048])
  timeout -k 5 ${RQ_TIMEOUT:-300} python3 benchmarks/bench_row_quant.py \
    --out $OUT/bench_row_quant.json 2>&1 | grep -v "^I1\|^W1"
elif [ "$stage" = s32b ]; then
  # (session 32) the grouped GPU tests s32a's limit did not reach (the capacity batch, the
  # last expert shapes), then the 8k-capacity FP4 rollout, 48 layers, generating 2,048
  # tokens a sequence (as s26c / s27b) with session 31's wgmma wait
  gpu_tests tests/kernels/test_kernels_gpu.py "capacity or grouped_expert" grouped2 \
    ${KTEST_TIMEOUT:-110}
  cap8k_2048 360
elif [ "$stage" = s32a ]; then
  # (session 32) session 31's wgmma wait (7af7252) against the tree before it (ab_old: a git
  # archive of 253a8af) at every chunk width it touches: grouped 2,208 rows (bm 32) both
  # expert shapes, prefill 32,768 (bm 64), dense 8192 x 28672 at 32 and 64 rows; the new
  # side also timed products of only the first 16 / 24 rows of each 32-row chunk (_mmaR: an
  # upper bound for per-chunk MMA widths, wrong results by design; apply
  # results/session32_h200_2026-12-04/mma_rows_probe.patch to rerun them); then the grouped GPU
  # tests with the change (ran: 22 passed of 26, then the limit; none failed)
  rows='moe_gateup_E128_K2048_N1536_M2208_nvfp4_auto$,moe_down_E128_K768_N2048_M2208_nvfp4_auto$'
  rows+=',moe_gateup_E128_K2048_N1536_M32768_nvfp4_auto$'
  rows+=',ffn_8192x28672_B32_nvfp4$,ffn_8192x28672_B64_nvfp4$'
  mma=',M2208_nvfp4_auto_mma16,M2208_nvfp4_auto_mma24'
  kernel_rows_ab $rows $mma ${BK_TIMEOUT:-200}
  gpu_tests tests/kernels/test_kernels_gpu.py \
    "grouped_ragged or grouped_expert or capacity or (test_dense and 64 and not stream and not group)" \
    grouped ${KTEST_TIMEOUT:-170}
elif [ "$stage" = s31e ]; then
  # (session 31; call 5 timed only its first row in 65 s: rerun with BK_TIMEOUT=150) the
  # grouped kernel at 32- and 64-row chunks waiting for all but the newest
  # wgmma before decoding the next tile (ptxas serialized every wgmma there for want of
  # registers, C7512): old (ab_old: a git archive of 253a8af) / new rows at 2,208 rows (bm 32, the
  # 8k-capacity rollout's batch) and 32,768 (bm 64, prefill), relerr against the reference in
  # the same run
  rows='moe_gateup_E128_K2048_N1536_M2208_nvfp4_auto$,moe_down_E128_K768_N2048_M2208_nvfp4_auto$'
  rows+=',moe_gateup_E128_K2048_N1536_M32768_nvfp4_auto$'
  kernel_rows_ab $rows '' ${BK_TIMEOUT:-60}
elif [ "$stage" = s31d ]; then
  # (session 31) the GEMV (8192 x 28672) with kb=2 weights: its stream-K runs' units half as
  # long (the longest 27.5 steps of 256 K against 28), 23% more instructions a K (SASS: 247 a
  # step of 128 K, 403 of 256), beside kb=4 (the default) in one process
  timeout -k 5 ${BK_TIMEOUT:-120} python3 benchmarks/bench_kernels.py --iters 20 \
    --only 'ffn_8192x28672_B1_nvfp4$,ffn_8192x28672_B1_nvfp4_kb2$,ffn_8192x28672_B16_nvfp4$,ffn_8192x28672_B16_nvfp4_kb2$' \
    --out $OUT 2>&1 | grep -v "^I1\|^W1\|Autotuning" | grep -A6 "us_call" | cut -c1-150
elif [ "$stage" = s31c ]; then
  # (session 31; ran once, mixed, reverted: results/session31_h200_2026-12-04/
  # parts_at_tiles.patch, apply it to rerun) the grouped stream-K parts at their tiles'
  # places ([2, C, bm, N], out's layout), so the output gather reads all three at the same
  # rows and computes which tiles are cut per element (no [rows, tiles] index kernel: 5
  # kernels a call, deviceless): GPU
  # tests of the grouped stream-K kernel, the engine smoke (B 8: 64 expert rows, stream-K),
  # then rows of both expert shapes at 64 and 256 rows, stream-K against the chunk schedule,
  # tokamax beside
  gpu_tests tests/kernels/test_kernels_gpu.py "grouped_stream_k" gsk_parts ${KTEST_TIMEOUT:-160}
  timeout -k 5 ${SMOKE_TIMEOUT:-100} python3 benchmarks/gpu_engine_smoke.py --layers 2 \
    --out $OUT/gpu_engine_smoke.json 2>&1 | grep -v "^I1\|^W1" | tail -4
  expert_rows "64 256" "auto auto_nosk" moe_gateup_E128_K2048_N1536_M256_tokamax \
    ${BK_TIMEOUT:-150} 12
elif [ "$stage" = s31b ]; then
  # (session 31; ran once, no gain, reverted: results/session31_h200_2026-12-04/
  # deferred_store_wait.patch, apply it to rerun) TMA stores that do not wait: a warpgroup's
  # tile store waits for its earlier stores to have read their staging before it writes one,
  # not for its own after (the
  # grouped stream-K kernel's ~9 flushes a CTA at 256 rows, the dense stream-K GEMV's mid-run
  # flush, the chunk schedule's chained tiles): GPU tests of the three kernels, then
  # old (ab_old: HEAD before) / new rows twice, interleaved, the tokamax row beside once
  gpu_tests tests/kernels/test_kernels_gpu.py \
    "gemv_shape or (dense_stream_k and nvfp4) or grouped_stream_k_expert or (grouped_ragged and nvfp4 and not bf16) or (grouped_expert and not bf16 and not stream)" \
    stores ${KTEST_TIMEOUT:-230}
  rows='ffn_8192x28672_B1_nvfp4$,ffn_8192x28672_B16_nvfp4$'
  for m in 64 256 2208; do
    rows+=",moe_gateup_E128_K2048_N1536_M${m}_nvfp4_auto\$,moe_down_E128_K768_N2048_M${m}_nvfp4_auto\$"
  done
  for round in ${ROUNDS:-1 2}; do
    kernel_rows_ab $rows ',moe_gateup_E128_K2048_N1536_M256_tokamax' ${BK_TIMEOUT:-100}
    for side in old new; do mv $OUT/bench_kernels_$side.json $OUT/bench_kernels_${side}_$round.json; done
  done
elif [ "$stage" = s31a ]; then
  # (prepared in session 30) the grouped stream-K kernel adding the cut tiles' parts in the
  # kernel (merge "kernel": the later part to finish adds the other's, read from L2; no parts
  # for XLA to gather): its GPU tests, then rows at 64-256 rows, XLA's add (auto) against the
  # kernel's (auto_mk) and the chunk schedule (auto_nosk), tokamax beside
  gpu_tests tests/kernels/test_kernels_gpu.py "stream_k" gsk_merge ${KTEST_TIMEOUT:-240}
  expert_rows "64 128 256" "auto auto_mk auto_nosk" moe_gateup_E128_K2048_N1536_M256_tokamax \
    ${BK_TIMEOUT:-240} 24
elif [ "$stage" = s30c ]; then
  # (session 30) s30a's rows again at 64-256 rows after the gather of the cut tiles' parts
  # became a row gather (s30a: per element, 5 us more a call than the chunk schedule's at 256
  # rows, 61 us at 2,208)
  expert_rows "64 128 256" "auto auto_nosk" \
    moe_gateup_E128_K2048_N1536_M128_tokamax,moe_gateup_E128_K2048_N1536_M256_tokamax \
    ${BK_TIMEOUT:-200} 20
elif [ "$stage" = s30b ]; then
  # (session 30) the grouped stream-K schedule in the FP4 decode step: 4 layers, B 32 and 64
  # (256 and 512 expert rows a layer), the chunk schedule (off) against the default (auto),
  # each in its own process; the step's wall time (command buffers on)
  for b in ${BATCHES:-32 64}; do
    for sk in off auto; do
      TRACE_JAX_GROUPED_STREAM_K=$sk timeout -k 5 ${PROF_TIMEOUT:-120} python3 \
        benchmarks/profile_decode.py --layers 4 --policy paper --path kernels --batch $b \
        --prompt_len 256 --new_tokens 128 --repeats 2 --out $OUT/profile_4l_b${b}_sk_$sk.json \
        2>&1 | grep -v "^I1\|^W1" | grep -E "guidance_on|decode loop|rror" | cut -c1-240 \
        | sed "s/^/[B$b $sk] /"
    done
  done
elif [ "$stage" = s29a ]; then
  # (session 29; ran once, then reverted: results/session29_h200_2026-12-03/rows_out_kernels.patch)
  # the grouped kernels writing the rows each chunk owns in the operand's order and zeros past
  # the groups' rows (before and after: every chunk's whole window, then an XLA gather): GPU
  # tests of the FP4 and bf16 grouped kernels and row chunks, the routing-tables kernel, the
  # engine smoke, then rows of the old tree (ab_old) and this one with tokamax beside
  gpu_tests tests/kernels/test_kernels_gpu.py "grouped_ragged or bf16_grouped or row_chunk" \
    grouped ${KTEST_TIMEOUT:-190}
  gpu_tests tests/kernels/test_routing.py "" routing ${RTEST_TIMEOUT:-50}
  timeout -k 5 ${SMOKE_TIMEOUT:-90} python3 benchmarks/gpu_engine_smoke.py --layers 2 \
    --out $OUT/gpu_engine_smoke.json 2>&1 | grep -v "^I1\|^W1" | tail -4
  rows='moe_gateup_E128_K2048_N1536_M256_nvfp4_auto$,moe_gateup_E128_K2048_N1536_M2208_nvfp4_auto$'
  rows+=',moe_down_E128_K768_N2048_M256_nvfp4_auto$'
  kernel_rows_ab $rows ',moe_gateup_E128_K2048_N1536_M256_tokamax' ${BK_TIMEOUT:-85}
elif [ "$stage" = s29b ]; then
  # (session 29) the three token draws alone (benchmarks/bench_sampler.py), then the 4-layer
  # FP4 decode step at the 8k-capacity shape (B 256) drawing with the hashed Gumbel noise
  # (call 1 of session 29 ran it with the other two draws)
  timeout -k 5 ${BS_TIMEOUT:-120} python3 benchmarks/bench_sampler.py \
    --out $OUT/bench_sampler.json 2>&1 | grep -v "^I1\|^W1" | tail -12
  TRACE_JAX_SAMPLER=hashed_gumbel cap_shape_profile 4 256 paper ${PROF_TIMEOUT:-170} \
    --no_command_buffers --out $OUT/profile_cap_4l_b256_hashed_gumbel.json \
    | grep -E "guidance_on|decode loop|reduce" | head -8
elif [ "$stage" = s28a ]; then
  # (session 28) the grouped call's chunk tables from group sizes in two XLA kernels instead of
  # four (each group reserves ceil((size + 7) / bm) chunks, so the chunk ends are a prefix sum
  # beside the row ends; the owners beside the slots where the rows fit the chunk grid): GPU
  # tests of the grouped kernels and the routing tables, the engine smoke, rows of the old tree
  # (ab_old) and this one with tokamax beside, then the FP4 decode step's kernels at the
  # 8k-capacity shape (4 layers, B 256) under the profiler (ran: that profile saw no loop
  # kernels, command buffers hide them; s28c is the one kept)
  gpu_tests tests/kernels/test_kernels_gpu.py "grouped_ragged" grouped ${KTEST_TIMEOUT:-120}
  gpu_tests tests/kernels/test_routing.py "" routing ${RTEST_TIMEOUT:-45}
  timeout -k 5 ${SMOKE_TIMEOUT:-100} python3 benchmarks/gpu_engine_smoke.py --layers 2 \
    --out $OUT/gpu_engine_smoke.json 2>&1 | grep -v "^I1\|^W1" | tail -4
  rows='moe_gateup_E128_K2048_N1536_M256_nvfp4_auto$,moe_gateup_E128_K2048_N1536_M512_nvfp4_auto$'
  rows+=',moe_down_E128_K768_N2048_M256_nvfp4_auto$'
  kernel_rows_ab $rows ',moe_gateup_E128_K2048_N1536_M256_tokamax' ${BK_TIMEOUT:-85}
  cap_shape_profile 4 256 paper ${PROF_TIMEOUT:-140} --out $OUT/profile_cap_4l_b256.json | tail -30
elif [ "$stage" = s28c ]; then
  # (session 28) where the decode step's time goes now, kernel by kernel (command buffers off:
  # inside them the profiler sees no kernels; the loop's kernels told from the prefill's by
  # their program): the FP4 `paper` step at the 8k-capacity shape (4 layers, B 256), then
  # `w4a16` at HF's batch-1 load (12 layers, prompt 64, 128 new)
  cap_shape_profile 4 256 paper ${PROF_TIMEOUT:-240} --no_command_buffers \
    --out $OUT/profile_cap_4l_b256_nocb.json | tail -45
  timeout -k 5 ${B1_TIMEOUT:-170} python3 benchmarks/profile_decode.py --layers 12 \
    --policy w4a16 --path kernels --batch 1 --prompt_len 64 --new_tokens 128 --repeats 1 \
    --no_command_buffers --out $OUT/profile_b1_w4a16.json 2>&1 | grep -v "^I1\|^W1" | tail -45
elif [ "$stage" = s28d ]; then
  # (session 28) the bf16 attention projections at decode batches past 64 rows (the `paper`
  # policy keeps them bf16; s28c: XLA's q/k/v product 21.5 us a layer at B 256 against 4.9 us of
  # weight bytes): XLA's dot against the bf16 grouped Mosaic kernel with the rows as one group
  timeout -k 5 ${SD_TIMEOUT:-200} python3 benchmarks/bench_small_dots.py --rows ${ROWS:-64,256} \
    --out $OUT/bench_small_dots.json 2>&1 | grep -v "^I1\|^W1" | grep -E "qkv|o_|router" | tail -30
elif [ "$stage" = s28e ]; then
  # (session 28) the GPU tests of s28a's table change that its limits left out: the grouped
  # kernels at the expert shapes, dense rows as one group, the capacity batch, row chunks; the
  # routing-tables kernel
  gpu_tests tests/kernels/test_kernels_gpu.py \
    "grouped_expert or row_chunk or capacity or one_group" grouped2 ${KTEST_TIMEOUT:-210}
  gpu_tests tests/kernels/test_routing.py "" routing2 ${RTEST_TIMEOUT:-90}
elif [ "$stage" = s28f ]; then
  # (session 28; prepared, not run: the device budget was spent) the inverse-CDF sampler
  # (TRACE_JAX_SAMPLER=inverse_cdf; s28c: the Gumbel draw 257 us a step at B 256) against the
  # default in the capacity-shaped step, each in its own process, the rollout GPU tests under
  # it; then JAX's Hopper bf16 matmul beside XLA's dot for the bf16 attention projections at
  # 128 and 256 rows (s28d: XLA 19.7 / 17.4 us at 256 rows against 4.9 / 3.9 of weight bytes)
  for sampler in gumbel inverse_cdf; do
    TRACE_JAX_SAMPLER=$sampler cap_shape_profile 4 256 paper ${PROF_TIMEOUT:-170} \
      --no_command_buffers --out $OUT/profile_cap_4l_b256_$sampler.json \
      | grep -E "guidance_on|decode loop|reduce" | head -8 | sed "s/^/[$sampler] /"
  done
  TRACE_JAX_SAMPLER=inverse_cdf gpu_tests tests/rollout/test_engine_gpu.py "" sampler \
    ${RTEST_TIMEOUT:-120}
  timeout -k 5 ${SD_TIMEOUT:-150} python3 benchmarks/bench_small_dots.py --rows 128,256 \
    --hopper --out $OUT/bench_small_dots_hopper.json 2>&1 | grep -v "^I1\|^W1" \
    | grep -E "qkv|o_" | tail -24
elif [ "$stage" = s27a ]; then
  # (session 27) FP4 KV caches of bit-placed code words ("kv_words": the Mosaic attention's
  # decode 13 instructions a word instead of 17): GPU tests (placed = nibble caches bit for bit
  # in every compiled kernel, the append kernel's placement, the Mosaic kernel against the
  # reference), decode attention nibbles vs kv_words side by side, the engine smokes (paper B8
  # 2 layers; w4a16 B80 1 layer with the first divergences of the dense-rows-as-a-group path)
  gpu_tests "tests/kernels/test_attention_gpu.py tests/kernels/test_kv_append.py" \
    "kv_words or mosaic_kernel_vs_reference or model_decode or model_prefill or xla_path" \
    kvwords ${ATEST_TIMEOUT:-200}
  timeout -k 5 ${BA_TIMEOUT:-200} python3 benchmarks/bench_attention.py --what decode \
    --batches 16,64 --contexts 8192,32768 --formats bf16,nvfp4_mosaic,nvfp4_mosaic_kvwords \
    --budget_s 160 --out $OUT/bench_attention_kvwords.json 2>&1 | grep -v "^I1\|^W1" | tail -14
  timeout -k 5 ${SMOKE_TIMEOUT:-100} python3 benchmarks/gpu_engine_smoke.py --layers 2 \
    --out $OUT/gpu_engine_smoke_paper.json 2>&1 | grep -v "^I1\|^W1" | tail -3
  timeout -k 5 ${SMOKE_TIMEOUT:-100} python3 benchmarks/gpu_engine_smoke.py --layers 1 \
    --batch 80 --policy w4a16 --out $OUT/gpu_engine_smoke_w4a16_b80.json 2>&1 \
    | grep -v "^I1\|^W1" | grep -E "same_tokens|divergen|diverging|logprob" | tail -8
elif [ "$stage" = s27b ]; then
  # (session 27) the 8k-capacity FP4 rollout, 48 layers, with the cache packing of
  # TRACE_JAX_KV_WORDS (placed: the default; nibbles: the A side), one row a call; TESTS=1
  # first reruns s27a's kv_words equality test and the model decode step's kernel choice
  [ "${TESTS:-0}" = 1 ] && gpu_tests tests/kernels/test_attention_gpu.py \
    "kv_words or model_decode" kvwords2 ${ATEST_TIMEOUT:-150}
  cap8k_2048 330
  mv $OUT/bench_rollout_cap8k_${LAYERS:-48}l.json \
    $OUT/bench_rollout_cap8k_${LAYERS:-48}l_fp4_${TRACE_JAX_KV_WORDS:-placed}.json
elif [ "$stage" = s26b ]; then
  # (session 26) `route`'s tables in four XLA kernels a layer (three reductions and a look-up;
  # nine before), the grouped call's from group sizes in four (five), the kernel operand's
  # padding rows by a clamped gather (no bounds-mask kernel): GPU tests of the grouped kernels
  # and the routing tables, the engine smoke (kernel path vs jnp reference tokens), then rows
  # of the old tree (ab_old) and this one, tokamax beside. (Ran: the tests' limits cut them at
  # 15 + 1 passed, none failed; session 26's call 3 ran the 7 grouped ones left, all passed)
  gpu_tests tests/kernels/test_kernels_gpu.py \
    "grouped_ragged or grouped_expert or row_chunk or capacity or one_group" grouped \
    ${KTEST_TIMEOUT:-170}
  gpu_tests tests/kernels/test_routing.py "" routing ${RTEST_TIMEOUT:-60}
  timeout -k 5 ${SMOKE_TIMEOUT:-130} python3 benchmarks/gpu_engine_smoke.py --layers 2 \
    --out $OUT/gpu_engine_smoke.json 2>&1 | grep -v "^I1\|^W1" | tail -4
  rows='moe_gateup_E128_K2048_N1536_M256_nvfp4_auto$,moe_gateup_E128_K2048_N1536_M2208_nvfp4_auto$'
  rows+=',moe_down_E128_K768_N2048_M256_nvfp4_auto$,ffn_8192x28672_B1_nvfp4$'
  kernel_rows_ab $rows ',M256_tokamax' ${BK_TIMEOUT:-100}
elif [ "$stage" = s26c ]; then
  # (session 26) the 8k-capacity rollout, 48 layers, FP4 then BF16 in one run (s15c) with
  # s26b's routing tables; SIDE=old runs the FP4 row of the tree carried as ab_old instead
  if [ "${SIDE:-new}" = old ]; then
    # bench_rollout puts its own tree first on sys.path: a tree of this one's scripts around
    # the old package
    old=/tmp/old_tree; script=$PWD/$0
    rm -rf $old && mkdir -p $old && cp -r launch benchmarks configs .whl $old/
    ln -s $PWD/ab_old/trace_jax $old/trace_jax
    (cd $old && HOST_RESERVE=20 ROWS_TIMEOUT=${CAP_TIMEOUT:-320} \
      ROW_TIMEOUT=$(( ${CAP_TIMEOUT:-320} - 10 )) GEN=2048 bash $script cap8k_inner | tail -4)
    mv $OUT/bench_rollout_cap8k_${LAYERS:-48}l.json \
      $OUT/bench_rollout_cap8k_${LAYERS:-48}l_fp4_old.json
  else
    CAP_TIMEOUT=${CAP_TIMEOUT:-320} BF16_TIMEOUT=${BF16_TIMEOUT:-170} bash $0 s15c_inner
  fi
elif [ "$stage" = s26a ]; then
  # (written in session 25, not yet run) what bounds the FP4 matmul kernels after the
  # bit-placed decode (GEMV 37.3 us kernel, 403 SASS instructions a step; moving decode work to
  # the FMA pipe or dropping uniform-datapath instructions did not help, s25a/s25b): Nsight
  # Compute on the GEMV and the grouped kernel at 256 and 2,208 rows (stall reasons per SASS
  # instruction: is the per-step wgmma wait the exposed latency?), then s24c's timing rows
  NCU_CASES="gemv grouped256 grouped2208" bash $0 s23b_inner
  timeout -k 5 ${BK_TIMEOUT:-200} python3 benchmarks/bench_kernels.py --iters 20 --only B256 \
    --out $OUT 2>&1 | grep -v "^I1\|^W1\|Autotuning" | grep "us_call" | cut -c1-150
elif [ "$stage" = s25d ]; then
  # (session 25) the FP4 matmul GPU tests s25a and s25b's limits cut, on the final decode:
  # the last expert shapes, dense products as one group, the capacity batch, row-chunk routing
  gpu_tests tests/kernels/test_kernels_gpu.py \
    "grouped_expert_shapes and (8-4 or 8-6) or one_group or capacity or row_chunk" fp4d \
    ${KTEST_TIMEOUT:-170}
elif [ "$stage" = s25b ]; then
  # (session 25) the FP4 matmul weights' code words bit-placed for a move and a mask per decoded
  # register (WEIGHT_DECODE_ASM: 13 instructions a word against 17; s25a: GEMV 37.1 us kernel,
  # grouped 256 rows 58.4, against 39.5 / 64.4 in sessions 23-24). Rows of the old tree
  # (ab_old: bcaa2bb) and of this one in both forms of the decode (TRACE_JAX_WEIGHT_DECODE at
  # 50037391: shifts on the ALU pipe, multiplies on the FMA pipe; the switch is gone since, with
  # the multiplies), each side its own process, tokamax and XLA bf16 beside; then the GPU tests
  # s25a's limit cut (grouped, dense as one group, routing)
  rows='ffn_8192x28672_B1_nvfp4$,ffn_8192x28672_B1_mxfp4$,ffn_8192x28672_B16_nvfp4$'
  rows+=',attn_q_2048x4096_B1_nvfp4$,moe_gateup_E128_K2048_N1536_M256_nvfp4_auto$'
  rows+=',moe_gateup_E128_K2048_N1536_M2208_nvfp4_auto$,moe_down_E128_K768_N2048_M256_nvfp4_auto$'
  rows+=',moe_down_E128_K768_N2048_M2208_nvfp4_auto$'
  for side in old shifts multiplies; do
    root=$PWD; extra=""
    [ $side = old ] && root=$PWD/ab_old
    [ $side = shifts ] && extra=',M256_tokamax,ffn_8192x28672_B1_xla_bf16$'
    mkdir -p $OUT/$side
    TRACE_JAX_WEIGHT_DECODE=${side/old/shifts} PYTHONPATH=/tmp/site:$root timeout -k 5 \
      ${BK_TIMEOUT:-125} python3 benchmarks/bench_kernels.py --iters 20 --only "$rows$extra" \
      --out $OUT/$side 2>&1 | grep -v "^I1\|^W1\|Autotuning" | grep "us_call" \
      | sed "s/^/[$side] /" | cut -c1-150
    mv $OUT/$side/bench_kernels.json $OUT/bench_kernels_$side.json 2>/dev/null
  done
  gpu_tests tests/kernels/test_kernels_gpu.py \
    "grouped_ragged or grouped_expert or one_group or capacity or row_chunk" fp4b \
    ${KTEST_TIMEOUT:-130}
elif [ "$stage" = s25a ]; then
  # (session 25, ran at 2a6c59f, whose mma_tiles option and _mt rows are gone since: no gain)
  # fewer instructions a step in the FP4 matmul kernels: the weights' code words
  # bit-placed for a move and a mask per register (WEIGHT_DECODE_ASM: 13 instructions a word
  # against 17; the GEMV loop 467 -> 403 in the SASS) and the option of several 64x64 tiles per
  # wgmma call (mma_tiles: Mosaic recomputes the activation descriptor per call; 403 -> 373 at
  # 4). Rows of the old tree (ab_old: bcaa2bb) and this one (with the _mt variants), tokamax and
  # XLA bf16 beside; then the GPU tests of the FP4 matmul kernels
  kernel_rows_ab ffn_8192x28672_B1_nvfp4,ffn_8192x28672_B1_mxfp4,ffn_8192x28672_B16_nvfp4,\
ffn_8192x28672_B1_xla_bf16,attn_q_2048x4096_B1_nvfp4,M256_nvfp4_auto,M2208_nvfp4_auto,\
moe_down_E128_K768_N2048_M256_nvfp4_auto ,M256_tokamax ${BK_TIMEOUT:-170}
  gpu_tests tests/kernels/test_kernels_gpu.py "not bf16_grouped and not bf16_expert" fp4 \
    ${KTEST_TIMEOUT:-170}
elif [ "$stage" = s24c ]; then
  # (written in session 24; its GPU tests passed in s25d, its rows not yet run) dense FP4
  # products past the GEMV kernel's 64 rows (policies with FP4 attention weights, w4a16 / w4a4 / all_linear, at decode
  # batches of 65-512; `paper` keeps them bf16): GPU tests of `fp4_mgpu.matmul_as_group`, then
  # at 256 rows through the fused q/k/v and o shapes the engine's path (the weight decoded to
  # bf16 every call, XLA's dot) against the grouped FP4 kernel with the rows as one group (its
  # default launch `dense_group_config`; n_inner 1 with 1, 2, 4 K splits; `grouped_parallelism`'s
  # launch), XLA bf16 beside. If the kernel wins: TRACE_JAX_DENSE_GROUP_ROWS's default (0), then
  # a w4a16 rollout at B 128-256 with and without it
  gpu_tests tests/kernels/test_kernels_gpu.py dense_as_one_group dense_group ${KTEST_TIMEOUT:-120}
  timeout -k 5 ${BK_TIMEOUT:-200} python3 benchmarks/bench_kernels.py --iters 20 --only B256 \
    --out $OUT 2>&1 | grep -v "^I1\|^W1\|Autotuning" | grep "us_call" | cut -c1-150
elif [ "$stage" = s24b ]; then
  # (session 24) the SMEM budget at 227 KiB - 1 KiB (was 224 KiB): the capacity batch's gate+up
  # (2,208 rows, bm 32, 6 chained tiles of 8 steps) runs 4 pipeline stages instead of 2 (3 missed
  # by 1 KiB, and chaining needs a divisor of 8); no other engine shape changes. GPU tests (that
  # shape with bf16 out, the expert shapes), rows of the old tree (ab_old: d1017b1) and this one
  # (with tokamax and the other bm at 2,208), then ncu on the new grouped2208
  gpu_tests tests/kernels/test_kernels_gpu.py "capacity_batch or grouped_expert_shapes" cap \
    ${KTEST_TIMEOUT:-150}
  kernel_rows_ab M2208_nvfp4_auto,M256_nvfp4_auto ,M2208_tokamax,M256_tokamax ${BK_TIMEOUT:-150}
  NCU_CASES="grouped2208" bash $0 s23b_inner
elif [ "$stage" = s24a ]; then
  # (written in session 23, not yet run) Nsight Compute on the kernels s23b could not profile:
  # the grouped FP4 kernel at the capacity batch (2,208 rows, bm 32: no faster with the new
  # decode, 89.6 us) and at 256 rows, the attention-shaped dense product at one row, the decode
  # attention at B 16 x 8k (fixed costs). Then `s17e` (w4a16 vs BF16 at B 1 and 32) and `s15c`
  # (the 8k-capacity rollout) give the new decode's effect on whole rollouts
  NCU_CASES="grouped2208 grouped256 qproj1 attn_b16_8k" bash $0 s23b_inner
elif [ "$stage" = s23d ]; then
  # (session 23) the rest of s23c's GPU tests (its 150 s ran out after 25 passed, none failed),
  # then Nsight Compute on the decode attention and the new GEMV
  gpu_tests tests/kernels/test_kernels_gpu.py \
    "(grouped_ragged and None-2) or test_grouped_expert_shapes or row_chunk" mm2 \
    ${KTEST_TIMEOUT:-170}
  NCU_CASES="attn_b64_32k gemv" bash $0 s23b_inner
elif [ "$stage" = s23c ]; then
  # (session 23) the FP4 matmul kernels with natural-nibble code words (one row a word, 8 ALU
  # instructions a word instead of 11) and dense calls that read no chunk table: GPU tests,
  # then rows of the old tree (ab_old) and this one, each side in its own process
  gpu_tests tests/kernels/test_kernels_gpu.py \
    "stream_k or grouped_ragged or grouped_expert or (test_dense and 512)" mm ${KTEST_TIMEOUT:-150}
  rows=ffn_8192x28672_B1_nvfp4,ffn_8192x28672_B16_nvfp4,attn_q_2048x4096_B1_nvfp4
  rows=$rows,attn_o_4096x2048_B1_nvfp4,M8_nvfp4_auto,M256_nvfp4_auto,M2208_nvfp4_auto
  kernel_rows_ab $rows ,ffn_8192x28672_B1_xla_bf16,M256_tokamax ${BK_TIMEOUT:-130}
elif [ "$stage" = s23b ]; then
  # (session 23) Nsight Compute's counters for each Mosaic kernel (issue slots, pipes, warp
  # stall reasons, stall samples per SASS instruction): what bounds them. Reports and CSV
  # exports (ncu_reports.tgz), `ncu_summary.py`'s reading in the log and ncu_CASE_summary.json
  # (s23b/s23d ran a grep of the details page instead). No preallocation: ncu backs up the
  # device memory in use before its replays (with XLA's 94% it crashed, s23b)
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  echo "ncu: $NCU $($NCU --version 2>&1 | tail -1)"
  for case in ${NCU_CASES:-attn_b64_32k gemv grouped256 qproj1 attn_b16_8k}; do
    ncu_case $case mosaic_gpu ${NCU_TIMEOUT:-150}
  done
  # few files come back from a call: the reports and exports in one archive
  (cd $OUT && tar czf ncu_reports.tgz ncu_* && rm -f ncu_*.ncu-rep ncu_*.csv ncu_*.log)
elif [ "$stage" = s23a ]; then
  # (written in session 22, run in session 23 on a40d25d, then removed: 2-10% slower) both
  # kernels' PV products left in flight into the next tile (TRACE_JAX_ATTN_DEFER_PV): their GPU
  # tests, then decode rows of new (the stream default) and defer, then splits and splits_defer
  # (live rows by split count)
  gpu_tests tests/kernels/test_attention_gpu.py "deferred_pv" attn_defer ${MOSAIC_TIMEOUT:-150}
  LIVE_KERNELS=stream attention_ab "new defer" 8 ${BENCH_TIMEOUT:-95}
  for side in splits splits_defer; do
    LIVE_KERNELS=splits attention_ab $side 20 ${BENCH_TIMEOUT:-120}
  done
  rm -f $OUT/*.png
elif [ "$stage" = s22e ]; then
  # (session 22) the attention bar's rows in one run: bf16 KV (the Pallas kernel) beside the
  # landed Mosaic FP4-KV kernel, full rows and the stream schedule's live rows
  timeout -k 5 ${BENCH_TIMEOUT:-220} python3 benchmarks/bench_attention.py --what decode \
    --formats bf16,nvfp4_mosaic --batches 16,64 --contexts 8192,32768 \
    --live 276x8192x1536,64x8192x1536,16x8192x2048 --live_kernels stream,bf16 \
    --budget_s $(( ${BENCH_TIMEOUT:-220} - 35 )) --out $OUT/bench_attention_bar.json 2>&1 \
    | grep -v "^I1\|^W1" | tail -16
  rm -f $OUT/*.png
elif [ "$stage" = s22d ]; then
  # (session 22) the landed form (no automatic barriers, 3 stages): the split schedule's GPU
  # tests (s22b/c ran the stream ones), then the 8k-capacity rows, FP4 then BF16, in one run
  gpu_tests tests/kernels/test_attention_gpu.py "mosaic_kernel_splits or in_kernel_merge" \
    attn_splits ${MOSAIC_TIMEOUT:-130}
  CAP_TIMEOUT=${CAP_TIMEOUT:-300} BF16_TIMEOUT=${BF16_TIMEOUT:-160} bash $0 s15c_inner
elif [ "$stage" = s22c ]; then
  # (session 22) the slot's codes and scales released once in registers (the tile's start),
  # 3 stages by default: GPU tests, then decode rows of late_release (s22b's stages3 side),
  # stages2 (early release, 2 stages), new (early release, 3 stages), stagger600_er
  gpu_tests tests/kernels/test_attention_gpu.py "stream or mosaic_kernel_vs" attn_early \
    ${MOSAIC_TIMEOUT:-150}
  LIVE_KERNELS=stream attention_ab "late_release stages2 new stagger600_er" 8 \
    ${BENCH_TIMEOUT:-95}
  rm -f $OUT/*.png
elif [ "$stage" = s22b ]; then
  # (session 22) the decode attention without Mosaic's automatic barriers around SMEM stores
  # (4 warpgroup barriers a tile fewer): its GPU tests, then decode rows (full rows and the
  # stream schedule's live rows) of auto_barriers (the landed kernel), new, stages3, and
  # stagger600 / stagger1200 (odd warpgroups started late)
  gpu_tests tests/kernels/test_attention_gpu.py "stream or mosaic_kernel_vs" attn_nobar \
    ${MOSAIC_TIMEOUT:-150}
  LIVE_KERNELS=stream attention_ab "auto_barriers new stages3 stagger600 stagger1200" 8 \
    ${BENCH_TIMEOUT:-90}
elif [ "$stage" = s22a ]; then
  # (written in session 21, not yet run) the stream schedule as it landed (each part's queries
  # fetched once; s21b measured the form that loaded them with every tile): decode rows with
  # the split schedule and the stream one (full rows: the attention bar's), then the 8k-capacity
  # FP4 row (s20b)
  attention_ab "splits new" 20 ${BENCH_TIMEOUT:-130}
  CAP_TIMEOUT=${CAP_TIMEOUT:-300} bash $0 s20b_inner
elif [ "$stage" = s21c ]; then
  # (session 21) the stream schedule (now the default) with each part's queries fetched once
  # (s21b: with every tile): its GPU tests, then if they pass the 8k-capacity rows, FP4 then
  # BF16 in one run (s15c)
  gpu_tests tests/kernels/test_attention_gpu.py "stream or mosaic_kernel_vs" attn_stream \
    ${MOSAIC_TIMEOUT:-120}
  t=$OUT/test_attn_stream.txt
  if grep -q " passed" $t && ! grep -q " failed" $t; then
    CAP_TIMEOUT=${CAP_TIMEOUT:-300} BF16_TIMEOUT=${BF16_TIMEOUT:-190} bash $0 s15c_inner
  fi
elif [ "$stage" = s21b ]; then
  # (session 21) the stream schedule of the decode attention (one CTA per SM, runs of (row,
  # tile) units crossing rows): the Mosaic attention GPU tests (both schedules), then decode
  # rows with the split schedule (new) and the stream one (stream); live rows carry both
  gpu_tests tests/kernels/test_attention_gpu.py mosaic attn_mosaic ${MOSAIC_TIMEOUT:-200}
  attention_ab "new stream" 20 ${BENCH_TIMEOUT:-150}
elif [ "$stage" = s21a ]; then
  # (session 21) the decode attention with 3 TMA stages (SMEM has had room for them since the
  # kernel's buffers shrank) and a dynamic pipeline grid (a split loads its needed tiles only):
  # the Mosaic attention GPU tests, then decode rows: old (ab_old: 2 stages, static grid),
  # stages2 (this tree with 2 stages: the dynamic grid alone), new (3 stages)
  gpu_tests tests/kernels/test_attention_gpu.py mosaic attn_mosaic ${MOSAIC_TIMEOUT:-120}
  attention_ab "old stages2 new" 16 ${BENCH_TIMEOUT:-140}
elif [ "$stage" = s20a ]; then
  # (session 20) the split combine inside the attention kernel (the last live split of a row
  # merges the others through L2): the Mosaic attention GPU tests, then decode rows with XLA's
  # combine (TRACE_JAX_ATTN_MERGE=xla) and the kernel's, 16/64 x 8k/32k and rollout-shaped
  # live rows (LIVE)
  gpu_tests tests/kernels/test_attention_gpu.py mosaic attn_mosaic ${MOSAIC_TIMEOUT:-150}
  for side in xla_merge new; do
    LIVE=${LIVE:-276x8192x1536,64x8192x1536,16x8192x2048} ROWS_SHOWN=24 \
      attention_side_rows $side nvfp4_mosaic ${BENCH_TIMEOUT:-170} $(( ${BENCH_TIMEOUT:-170} - 40 ))
  done
elif [ "$stage" = s20c ]; then
  # (session 20) s20a's kernel with the merge in one online pass, 4 splits' loads at a time (s20a:
  # two passes, a split a round): its GPU tests, its decode rows, and if the tests pass the
  # 8k-capacity FP4 row (s20b)
  gpu_tests tests/kernels/test_attention_gpu.py mosaic attn_mosaic ${MOSAIC_TIMEOUT:-150}
  t=$OUT/test_attn_mosaic.txt
  if grep -q " passed" $t && ! grep -q " failed" $t; then
    LIVE=${LIVE:-276x8192x1536,64x8192x1536,16x8192x2048} ROWS_SHOWN=16 \
      attention_side_rows new nvfp4_mosaic ${BENCH_TIMEOUT:-150} $(( ${BENCH_TIMEOUT:-150} - 40 ))
    bash $0 s20b_inner
  fi
elif [ "$stage" = s20b ]; then
  # (session 20) the 8k-capacity FP4 row with the in-kernel split combine (s19d: 10,865 tok/s
  # vs BF16 3,658 in s15c/s19, 2.97x)
  cap8k_2048 330
elif [ "$stage" = s19d ]; then
  # (session 19) the lazy running max (s19a's kernel at 518 instructions a tile: FP4 10,746 vs
  # BF16 3,658 tok/s at 8k capacity in s15c, 2.94x): the Mosaic attention GPU tests (both
  # maxima), the decode rows with the exact max and the lazy one, then the 8k-capacity FP4 row
  gpu_tests tests/kernels/test_attention_gpu.py mosaic attn_mosaic ${MOSAIC_TIMEOUT:-110}
  for side in exact_max new; do
    attention_side_rows $side nvfp4_mosaic ${BENCH_TIMEOUT:-60} $(( ${BENCH_TIMEOUT:-60} - 15 ))
  done
  cap8k_2048 300
elif [ "$stage" = s18e ]; then
  # (session 18) s18d at B 32: w4a16 fused, not fused, BF16 (s17e: 12,014 vs 7,315 tok/s)
  POLICIES=w4a16 BATCHES=32 HF_TAG=_w4a16_b32 ROWS_TIMEOUT=100 ROW_TIMEOUT=95 \
    bash $0 hf_load_inner | tail -1
  TRACE_JAX_FUSE_PROJECTIONS=off POLICIES=w4a16 BATCHES=32 HF_TAG=_w4a16_nofuse_b32 \
    ROWS_TIMEOUT=100 ROW_TIMEOUT=95 bash $0 hf_load_inner | tail -1
  POLICIES=bf16 BATCHES=32 HF_TAG=_bf16_b32 ROWS_TIMEOUT=90 ROW_TIMEOUT=85 \
    bash $0 hf_load_inner | tail -1
elif [ "$stage" = s18d ]; then
  # (session 18) the attention's FP4 q, k and v weights side by side in one kernel call at
  # rollout (`kernels.fuse_projections`; w4a16 at B 1 ran six FP4 calls a layer, 0.97x BF16 in
  # s17e): the model test on the GPU (fused vs three projections through the kernels), then
  # w4a16 at HF's B 1 load fused, not fused, and BF16
  JAX_PLATFORMS=cuda timeout -k 5 90 python3 -m pytest -q -p no:xdist -o addopts="" \
    tests/models/test_transformer.py -k fused > $OUT/test_fused_model_gpu.txt 2>&1
  echo "fused model test rc=$?"
  grep -E "Error|assert|passed|failed" $OUT/test_fused_model_gpu.txt | tail -4
  POLICIES=w4a16 BATCHES=1 HF_TAG=_w4a16 ROWS_TIMEOUT=150 ROW_TIMEOUT=140 \
    bash $0 hf_load_inner | tail -2
  TRACE_JAX_FUSE_PROJECTIONS=off POLICIES=w4a16 BATCHES=1 HF_TAG=_w4a16_nofuse \
    ROWS_TIMEOUT=150 ROW_TIMEOUT=140 bash $0 hf_load_inner | tail -2
  POLICIES=bf16 BATCHES=1 HF_TAG=_bf16 ROWS_TIMEOUT=140 ROW_TIMEOUT=130 \
    bash $0 hf_load_inner | tail -2
elif [ "$stage" = s18c ]; then
  # (session 18) the engine's GPU tests (not run since session 17's router product and compiled
  # eager quantize) and the row-chunk routing through both grouped kernels
  gpu_tests tests/rollout/test_engine_gpu.py "" engine 300
  gpu_tests tests/kernels/test_kernels_gpu.py row_chunk row_chunk 120
elif [ "$stage" = s18b ]; then
  # (session 18) stream-K limited to chunks of <= 32 rows, release=1 dropped: the stream-K GPU
  # tests (s18a's timed out at 240 s making 8192 x 28672 weights per case), the grouped tests
  # (the kernel's step body and block specs are shared helpers now), the GPU quantization
  # numerics (eager quantize runs compiled since session 17), then the GEMV rows with 32 rows
  gpu_tests tests/kernels/test_kernels_gpu.py stream_k stream_k 150
  gpu_tests tests/kernels/test_kernels_gpu.py grouped grouped 150
  gpu_tests tests/quant/test_gpu_numerics.py "" numerics 60
  timeout -k 5 ${BK_TIMEOUT:-150} python3 benchmarks/bench_kernels.py --iters 20 \
    --only ${KERNEL_ROWS:-ffn_} --out $OUT 2>&1 | grep -v "^I1\|^W1" | tail -25
elif [ "$stage" = s18a ]; then
  # (session 18) the dense FP4 kernel's stream-K schedule (the 8192 x 28672 GEMV on 128 SMs
  # instead of 112) and release=1 (a step's products in flight into the next): GPU tests of the
  # dense kernel against the reference, then the dense bench rows (as is, _nosk, _rel, kb 8)
  gpu_tests tests/kernels/test_kernels_gpu.py dense dense ${TEST_TIMEOUT:-240}
  timeout -k 5 ${BK_TIMEOUT:-270} python3 benchmarks/bench_kernels.py --iters 20 \
    --only ${KERNEL_ROWS:-ffn_,attn_} --out $OUT 2>&1 | grep -v "^I1\|^W1" | tail -45
elif [ "$stage" = s17f ]; then
  # (session 17) s17e: w4a16 at B 1 ran 1.06 ms a step against BF16's 1.05 (its floor 0.238 ms
  # vs 0.466): where its batch-1 step goes, kernel by kernel
  b1_profile w4a16 w4a16 ${B1_TIMEOUT:-110} 40
elif [ "$stage" = s17e ]; then
  # (session 17) what a solo builder would run at B 1: FP4 weights with bf16 activations and a
  # bf16 cache (`w4a16`: every linear weight FP4, dense ones through the FP4 GEMV kernel) beside
  # BF16, at HF's load, B 1 and 32 (the `paper` policy, W4A4 + FP4 KV with guidance, is the RL
  # rollout's: 1.13 ms a step at B 1 against BF16's 1.04, s17c)
  POLICIES=bf16,w4a16 BATCHES=1,32 HF_TAG=_w4a16 ROWS_TIMEOUT=${ROWS_TIMEOUT:-400} \
    ROW_TIMEOUT=140 bash $0 hf_load_inner | tail -8
elif [ "$stage" = s17d ]; then
  # (session 17) the one-row products' zero second row costs a concatenate kernel (~1.4 us, three
  # a layer at B 1): the row broadcast to two instead (TRACE_JAX_SINGLE_ROW=bcast), alone
  # (bench_small_dots) and in the BF16 and FP4 engines at HF's B 1 load (s17c: 902.2 / 825.6
  # tok/s), then the BF16 B 1 step profiled with it (s17c: 1.095 ms, 303 kernels). Ran at
  # 8a89fa3; the setting was dropped after it (1.100 ms: XLA moved the work into other kernels)
  timeout -k 5 ${DOTS_TIMEOUT:-120} python3 benchmarks/bench_small_dots.py --rows 1 \
    --out $OUT/bench_small_dots_bcast.json 2>&1 | grep -v "^I1\|^W1" | tail -16
  TRACE_JAX_SINGLE_ROW=bcast POLICIES=bf16,paper BATCHES=1 HF_TAG=_bcast \
    ROWS_TIMEOUT=${ROWS_TIMEOUT:-170} ROW_TIMEOUT=80 bash $0 hf_load_inner | tail -4
  TRACE_JAX_SINGLE_ROW=bcast b1_profile bf16 bcast ${B1_TIMEOUT:-90} 26
elif [ "$stage" = s17c ]; then
  # (session 17) after s17b (the router's one-row dot as a two-row product; NVFP4 decode
  # attention over short caches through the Pallas kernel): the 12-layer engine at HF's B 1 load
  # with HF in the same run (session 16: BF16 869-882 tok/s, FP4 779-792, HF static 245-309),
  # then the BF16 B 1 step profiled kernel by kernel (session 16: 1.129 ms, 315 kernels)
  POLICIES=bf16,paper BATCHES=1 HF_PEER=true ROWS_TIMEOUT=${HF_TIMEOUT:-260} ROW_TIMEOUT=90 \
    bash $0 hf_load_inner | tail -8
  b1_profile bf16 router_pad ${B1_TIMEOUT:-100} 26
  b1_profile paper router_pad ${B1_TIMEOUT:-100} 26
elif [ "$stage" = s17b ]; then
  # (session 17) the batch-1 step's small products each way (the router's float32 dot ran as two
  # kernels of 3.2 us a layer, the bf16 q/k/v and o projections at about half of their bytes'
  # time), the model-level GPU test of the decode attention choice (short caches now go to the
  # Pallas kernel), and the FP4 B 1 step profiled with it (s16c: Mosaic attention 89 us a step)
  timeout -k 5 ${DOTS_TIMEOUT:-150} python3 benchmarks/bench_small_dots.py --rows 1,8 \
    --out $OUT/bench_small_dots.json 2>&1 | grep -v "^I1\|^W1" | tail -24
  gpu_tests tests/kernels/test_attention_gpu.py model_decode_step attn_dispatch_gpu \
    ${TEST_TIMEOUT:-100}
  b1_profile paper fp4_short_attn ${B1_TIMEOUT:-110} 34
elif [ "$stage" = s17a ]; then
  # (session 17) the grouped FP4 kernel's column tiles per CTA (n_inner) in the capacity-shaped
  # FP4 step (12 layers, B 276, 2,208 expert rows a layer): "all" makes one CTA per 32-row chunk,
  # so a batch whose routing needs more than 132 chunks runs a second, nearly empty wave (the
  # kernel took ~1.5-2x its isolated time in the loop, sessions 13-16). Then decode attention at
  # B 1 over short caches, bf16 / NVFP4 Pallas / NVFP4 Mosaic (FP4 at B 1 was slower than BF16)
  STEP_AB="AB=baseline;TRACE_JAX_GROUPED_N_INNER=1;TRACE_JAX_GROUPED_N_INNER=2;TRACE_JAX_GROUPED_N_INNER=3" \
    PROFILE_TIMEOUT=${PROFILE_TIMEOUT:-125} bash $0 step_ab_inner
  timeout -k 5 ${BENCH_TIMEOUT:-110} python3 benchmarks/bench_attention.py --what decode \
    --formats bf16,nvfp4,nvfp4_mosaic --batches 1,16 --contexts 256,1024 \
    --budget_s $(( ${BENCH_TIMEOUT:-110} - 25 )) --out $OUT/bench_attention_short.json 2>&1 \
    | grep -v "^I1\|^W1" | tail -16
elif [ "$stage" = s16a ]; then
  # (session 16) step_ab's default (as is; cuBLAS for XLA's dots; splits of <= 32 tiles), then
  # the 12-layer BF16 step at HF's B 1 load (1.09 ms against 0.47 of bytes; HF's 3x bar wants
  # ~1.0) profiled kernel by kernel (no command buffers: with them the profiler sees graphs),
  # as is and with cuBLAS for XLA's dots
  PROFILE_TIMEOUT=${PROFILE_TIMEOUT:-130} bash $0 step_ab_inner
  for setting in "AB=baseline" "XLA_FLAGS=--xla_gpu_enable_triton_gemm=false"; do
    tag=$(echo "$setting" | md5sum | cut -c1-6)
    echo "== B1 bf16 $setting [$tag]"
    ( eval "export $setting"; b1_profile bf16 $tag ${B1_TIMEOUT:-90} 30 )
  done
elif [ "$stage" = s16b ]; then
  # (session 16) row-chunk routing (one token's top-8 needs no ordering kernels): its GPU test
  # (both grouped kernels against the reference), the 12-layer engine at HF's B 1 load with HF
  # in the same run (session 15: BF16 808.8 tok/s, 1.09 ms a step, HF static 291.5), and the
  # BF16 B 1 step profiled again (s16a: 398 kernels a step, 1.253 ms of kernels)
  gpu_tests tests/kernels/test_kernels_gpu.py row_chunk row_chunks_gpu ${TEST_TIMEOUT:-150}
  POLICIES=bf16,paper BATCHES=1 HF_PEER=true ROWS_TIMEOUT=${HF_TIMEOUT:-250} ROW_TIMEOUT=90 \
    bash $0 hf_load_inner | tail -6
  b1_profile bf16 row_chunks ${B1_TIMEOUT:-90} 24
elif [ "$stage" = s16c ]; then
  # (session 16) s16b's BF16 B 1 row: first call 18.6 s, then one-token calls of 10.96 s and
  # 0.039 s (FP4: 0.024, 0.010): what runs in the slow second call (JAX's compile log, three
  # one-token calls); then the FP4 B 1 step (1.21 ms against BF16's 0.85) profiled kernel by kernel
  JAX_LOG_COMPILES=1 timeout -k 5 ${LOG_TIMEOUT:-150} python3 launch/bench_rollout.py \
    --preset=qwen3_30b_a3b_12l --batches=1 --policies=bf16 --paths=kernels --prompt_len=64 \
    --new_tokens=128 --repeats=2 --one_token_repeats=3 --hf_peer=false \
    --out=$OUT/bench_b1_bf16_compile_log.json > $OUT/b1_bf16_compile_log.txt 2>&1
  echo "compile-log row rc=$?"
  grep -E "Finished XLA compilation|Finished tracing|\] [a-z]|prefill \+ one|median|tok/s" \
    $OUT/b1_bf16_compile_log.txt | sed -E 's/with global shapes.*//' | cut -c1-160 | tail -45
  b1_profile paper fp4 ${B1_TIMEOUT:-100} 34
elif [ "$stage" = s16d ]; then
  # (session 16) tokamax imported before programs compile (s16c: importing it inside the first
  # rollout's trace created JAX user contexts, so the BF16 program compiled again at the second
  # call, 12.5 s): the GPU test (one compile over three rollouts in a fresh process), the
  # 12-layer engine at HF's B 1 load with HF in the same run, then the 8k-capacity BF16 row
  # (48 layers; session 15: one-token call 20.0 s, whole rollout 44.6 s)
  gpu_tests tests/rollout/test_engine_gpu.py compiles_its_program_once compile_once_gpu \
    ${TEST_TIMEOUT:-120}
  POLICIES=bf16,paper BATCHES=1 HF_PEER=true ROWS_TIMEOUT=${HF_TIMEOUT:-200} ROW_TIMEOUT=80 \
    bash $0 hf_load_inner | tail -6
  POLICIES=bf16 ROWS_TIMEOUT=${BF16_TIMEOUT:-210} ROW_TIMEOUT=$(( ${BF16_TIMEOUT:-210} - 10 )) \
    GEN=2048 bash $0 cap8k_inner | tail -4
elif [ "$stage" = s15 ]; then
  # (session 15) after step_ab (XLA command buffers 7.20 -> 5.06 ms a step, splits of <= 16
  # tiles 7.20 -> 6.19 at 12 layers, B 276; both now defaults): the engine's GPU test (same
  # rollout with and without command buffers), then the 8k-capacity FP4 row (48 layers)
  JAX_PLATFORMS=cuda timeout -k 5 ${ETEST_TIMEOUT:-150} python3 -m pytest -q -m gpu \
    -p no:xdist -o addopts="" tests/rollout/test_engine_gpu.py > $OUT/test_engine_gpu.txt 2>&1
  echo "engine gpu test rc=$?"
  grep -v "^I1\|^W1" $OUT/test_engine_gpu.txt | grep -E "Error|assert|passed|failed" | tail -6
  ROWS_TIMEOUT=${CAP_TIMEOUT:-380} ROW_TIMEOUT=$(( ${CAP_TIMEOUT:-380} - 10 )) GEN=2048 \
    bash $0 cap8k_inner | tail -5
elif [ "$stage" = s15c ]; then
  # (session 15) s15's FP4 row was refused: compiling took 15 GiB of host memory against the
  # 12 GiB reserved (276 planned on 119.2 GiB free, 268 fit on 104.2): both 8k-capacity rows,
  # FP4 with 20 GiB reserved, then BF16
  cap8k_2048 340
  mv $OUT/bench_rollout_cap8k_${LAYERS:-48}l.json $OUT/bench_rollout_cap8k_${LAYERS:-48}l_fp4.json
  POLICIES=bf16 ROWS_TIMEOUT=${BF16_TIMEOUT:-200} ROW_TIMEOUT=$(( ${BF16_TIMEOUT:-200} - 10 )) \
    GEN=2048 bash $0 cap8k_inner | tail -4
elif [ "$stage" = s15b ]; then
  # (session 15) the BF16 engine at HF's load (12 layers, B 32 and 1) with command buffers and
  # HF in the same run (session 13: 762.7 tok/s at B 1 against HF static 294.3, 2.59x), then
  # B 1 without them (the 8k-capacity BF16 row's prefill + first step read 20.0 s with them,
  # 0.9 s in session 12 without)
  POLICIES=bf16 HF_PEER=true ROWS_TIMEOUT=${HF_TIMEOUT:-230} ROW_TIMEOUT=90 \
    bash $0 hf_load_inner | tail -9
  POLICIES=bf16 BATCHES=1 HF_TAG=_nocmdbuf HF_ARGS=--nocommand_buffers ROWS_TIMEOUT=100 \
    ROW_TIMEOUT=90 bash $0 hf_load_inner | tail -3
elif [ "$stage" = s13_final ]; then
  # (session 13) after the attention splits, the combine in the kernel's layout and the bf16
  # grouped kernel as the default up to 256 rows: the Mosaic attention tests against the
  # reference, BF16 at HF's load with HF in the same run, then the 8k-capacity FP4 row (48 layers)
  JAX_PLATFORMS=cuda timeout -k 5 ${MOSAIC_TIMEOUT:-60} python3 -m pytest -q -x -m gpu \
    -p no:xdist -o addopts="" -k mosaic_kernel_vs_reference tests/kernels/test_attention_gpu.py \
    > $OUT/test_attn_mosaic.txt 2>&1; echo "mosaic tests rc=$?"
  grep -v "^I1\|^W1" $OUT/test_attn_mosaic.txt | grep -E "Error|assert|passed|failed" | tail -4
  POLICIES=bf16 HF_PEER=true ROWS_TIMEOUT=${HF_TIMEOUT:-160} ROW_TIMEOUT=75 \
    bash $0 hf_load_inner | tail -9
  ROWS_TIMEOUT=${CAP_TIMEOUT:-360} ROW_TIMEOUT=$(( ${CAP_TIMEOUT:-360} - 10 )) GEN=2048 \
    bash $0 cap8k_inner | tail -4
elif [ "$stage" = compile_diag ]; then
  # where XLA's compile time goes (session 9: the 48-layer BF16 generate program did not compile
  # in ~370 s, the FP4 one took 152 s): XLA's pass and phase timers per policy and layer count,
  # summed by benchmarks/compile_passes.py; DIAG_LAYERS (4 8), DIAG_POLICIES (bf16 paper),
  # DIAG_TAG (a file name suffix), DIAG_LOGS=0 drops the raw logs (a call returns few files),
  # DIAG_ARGS (more compile_time.py flags, e.g. "--batch 64 --prompt_len 2048": two prefill
  # passes; session 10's prompt-2048 rows took 95 s / 89 s to a first token, session 9's 54 / 62)
  for pol in ${DIAG_POLICIES:-bf16 paper}; do
    for l in ${DIAG_LAYERS:-4 8}; do
      name=${pol}_${l}l${DIAG_TAG:-}
      TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=hlo_pass_pipeline=1,gpu_compiler=1,nvptx_compiler=1 \
        timeout ${DIAG_TIMEOUT:-150} python3 benchmarks/compile_time.py --policy $pol \
        --layers $l ${DIAG_ARGS:-} --out $OUT/compile_$name.json 2> $OUT/xla_log_$name.txt
      echo "== $name (rc $?): $(tail -c 300 $OUT/compile_$name.json | tr -d '\n ')"
      python3 benchmarks/compile_passes.py $OUT/xla_log_$name.txt --top 14 \
        --out $OUT/passes_$name.json
      if [ "${DIAG_LOGS:-1}" = 1 ]; then gzip -f $OUT/xla_log_$name.txt; else rm $OUT/xla_log_$name.txt; fi
    done
  done
elif [ "$stage" = 12l ]; then
  timeout 570 python3 launch/bench_rollout.py --preset=qwen3_30b_a3b_12l --batches=64,1 \
    --policies=bf16,paper --isolate --row_timeout=240 --prompt_len=256 \
    --new_tokens=512 --repeats=2 --hf_peer=false --out=$OUT/bench_rollout_12l.json \
    2>&1 | grep -v "^I1\|^W1"
elif [ "$stage" = 48l ]; then
  timeout 560 python3 launch/bench_rollout.py --preset=qwen3_30b_a3b --batches=64,1 \
    --policies=bf16,paper --paths=kernels --isolate --row_timeout=280 --prompt_len=256 \
    --new_tokens=1024 --repeats=1 --hf_peer=false --out=$OUT/bench_rollout_48l.json \
    2>&1 | grep -v "^I1\|^W1"
else
  # an unknown stage ran the 48-layer rollout here until session 41 (10 device minutes lost)
  echo "unknown stage '$stage' (the list is in this script's header)"; exit 2
fi
