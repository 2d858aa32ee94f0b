#!/usr/bin/env bash
# Issue #53 on a real model's template: tool-calling chat data (single and parallel calls, a system turn, multi-turn)
# through the workflow on the real SmolLM2-135M-Instruct (SNAKETUNE_BENCH_GGUF; its ChatML template, which renders no
# tools: the project's tool form inside its turns), on this machine's CPU: data, the template check, SFT, evaluation,
# GGUF export with its parity check (each file renders the conversations, tools included, to the training tokens and
# stops at <|im_end|>), the benchmark on mmlu_dev's first 20 questions, the report. Prints the checks' records.
#   python -m bench smollm2_tools
set -uo pipefail
OUT=${OUT:-/tmp/out}
W=${WORK:-/tmp/snaketune-smollm2-tools}
rm -rf "$W" && mkdir -p "$W" && cp -r Snakefile workflow config envs "$W/"
cp "${SNAKETUNE_BENCH_GGUF:?the SmolLM2 GGUF file}" "$W/SmolLM2-135M-Instruct.Q4_1.gguf"
python3 - "$W/tool_chats.jsonl" <<'PY'
import json, random, sys
rng = random.Random(0)
cities = ["Oslo", "Rome", "Lima", "Kyoto", "Cairo", "Quito", "Perth", "Riga"]
tools = [{"type": "function", "function": {"name": "weather", "description": "The weather in a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "time", "description": "The time in a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
rows = []
for i in range(120):
    asked = rng.sample(cities, 2 if i % 4 == 1 else 1)
    name = "weather" if i % 2 == 0 else "time"
    calls = [{"id": f"c{i}-{j}", "type": "function", "function": {"name": name, "arguments": json.dumps({"city": c})}}
             for j, c in enumerate(asked)]
    results = [f"{rng.randint(-5, 30)} degrees, {rng.choice(['sunny', 'rain', 'cloudy'])}" if name == "weather"
               else f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}" for _ in asked]
    messages = [{"role": "system", "content": "Use the tools to answer."}] if i % 4 == 2 else []
    messages.append({"role": "user", "content": f"What is the {name} in {' and '.join(asked)}?"})
    messages.append({"role": "assistant", "content": None, "tool_calls": calls})
    messages += [{"role": "tool", "tool_call_id": c["id"], "content": r} for c, r in zip(calls, results)]
    messages.append({"role": "assistant", "content": "; ".join(f"{c}: {r}" for c, r in zip(asked, results)) + "."})
    if i % 4 == 3:
        messages += [{"role": "user", "content": "Thanks!"}, {"role": "assistant", "content": "You are welcome."}]
    rows.append({"tools": tools, "messages": messages})
with open(sys.argv[1], "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
PY
cat >"$W/tools.yaml" <<'YAML'
dataset: {source: tool_chats.jsonl, languages: []}
preference: {enabled: false}
eval: {max_new_tokens: 48}
benchmark: {limit: 20, quants: [q4_k_m], models: [base, sft]}
YAML
echo "=== $(date -u +%T) SmolLM2 on tool-calling chats"
start=$(date +%s)
(cd "$W" && CUDA_VISIBLE_DEVICES= timeout -k 10 "${LIMIT_S:-1800}" python3 -m snakemake --cores "${CORES:-2}" \
    --resources gpu=1 --configfile config/examples/smollm2-135m-real.yaml config/examples/smollm2-135m-cpu.yaml \
    tools.yaml >"$OUT/workflow.log" 2>&1)
rc=$?
echo "=== $(date -u +%T) workflow exit $rc, $(( $(date +%s) - start )) s wall"
tail -n 3 "$OUT/workflow.log"
cd "$W" || exit 1
python3 - <<'PY'
import json, pathlib
conv = json.loads(pathlib.Path("results/data/conversations/stats.json").read_text())
print("conversations with tool calls:", conv.get("with_tool_calls"))
for p in pathlib.Path("results/tokenized").glob("*/stats.json"):
    print("template check:", json.dumps(json.loads(p.read_text()).get("template_check"))[:600])
for p in sorted(pathlib.Path("results/export").glob("*/*/metrics.json")):
    m = json.loads(p.read_text())
    print(f"{p}: parity {json.dumps(m.get('parity'))[:600]}")
    print("  files:", [(f["type"], f["failing"]) for f in m["files"]])
for line in pathlib.Path("results/eval/default/generations.jsonl").read_text().splitlines()[:3]:
    r = json.loads(line)
    print("reply:", r.get("prompt", "")[:60], "->", str(r.get("dpo") or r.get("tuned"))[:120])
PY
tar czf "$OUT/tools_run.tar.gz" benchmarks logs results/report/report.md results/data/conversations/stats.json \
    results/tokenized/*/stats.json results/export/*/*/metrics.json results/eval 2>/dev/null
exit $rc
