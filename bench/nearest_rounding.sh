# Make a copy of the workflow round its 4-bit states to nearest, as torchao does (snaketune.train.states4bit.ROUNDING),
# for the in_backward_4bit_nearest experiments of bench/cpu_states_rounding.sh, cpu_real_states.sh and
# device_in_backward.sh. Fails when the file has no stochastic ROUNDING line to edit.
#   bash bench/nearest_rounding.sh WORKFLOW_COPY
f=${1:?usage: bench/nearest_rounding.sh WORKFLOW_COPY}/workflow/snaketune/train/states4bit.py
sed -i 's/^ROUNDING = "stochastic"$/ROUNDING = "nearest"/' "$f"
grep -Hn '^ROUNDING = "nearest"$' "$f" || { echo "$f: no 'ROUNDING = \"stochastic\"' line to edit" >&2; exit 1; }
