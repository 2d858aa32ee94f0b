# Edit a copy of the workflow for an A/B of the 4-bit states' rounding (snaketune.train.states4bit), for the
# experiments of bench/convergence/cpu_tiny.sh, cpu_real.sh and converge.sh named after a variant:
#   *_nearest  m and v rounded to the nearest code, as torchao does (ROUNDING)
#   *_v_in_v   v rounded stochastically so that v is unbiased, not its fourth root (V_ROUNDED_IN)
# Any other experiment: no edit. Fails when the file has no line to edit.
#   bash bench/convergence/states_variant.sh WORKFLOW_COPY EXPERIMENT
f=${1:?usage: bench/convergence/states_variant.sh WORKFLOW_COPY EXPERIMENT}/workflow/snaketune/train/states4bit.py
case ${2:?usage: bench/convergence/states_variant.sh WORKFLOW_COPY EXPERIMENT} in
*_nearest) from='^ROUNDING = "stochastic"$' to='ROUNDING = "nearest"' ;;
*_v_in_v) from='^V_ROUNDED_IN = "fourth_root"$' to='V_ROUNDED_IN = "v"' ;;
*) exit 0 ;;
esac
sed -i "s/$from/$to/" "$f"
grep -Hn "^$to\$" "$f" || { echo "$f: no line matching $from to edit" >&2; exit 1; }
