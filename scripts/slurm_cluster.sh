#!/usr/bin/env bash
# A throwaway SLURM cluster on this machine, for trying the workflow's SLURM profile and for its test
# (tests/test_slurm.py): Debian's munged, slurmctld and slurmd, started by hand as root (no systemd),
# with fake GPUs as GRES. Everything it makes lives under one state directory, except a symlink
# /etc/slurm/slurm.conf to its conf (made only where none exists) and, for two nodes, two marked lines in
# /etc/hosts and a network namespace; stop removes those again.
#
#   scripts/slurm_cluster.sh start [STATE_DIR]   start (or find running) and print `export SLURM_CONF=...`
#   scripts/slurm_cluster.sh stop  [STATE_DIR]   cancel its jobs, stop its daemons by their pid files
#   scripts/slurm_cluster.sh status [STATE_DIR]  exit 0 when its node is up
#
# STATE_DIR defaults to $SNAKETUNE_SLURM_DIR, else ${TMPDIR:-/tmp}/snaketune-slurm. Both start and stop are
# idempotent. Knobs (environment): SLURM_FAKE_GPUS (3), SLURM_CLUSTER_NODES (1; 2 puts a second slurmd in a
# network namespace, a second "node" on the same file system), SLURM_CLUSTER_PORT (6817; slurmd uses +1),
# SLURM_FAKE_CPUS (32) and SLURM_FAKE_MEM_MB (262144): what each node advertises.
# Needs: apt-get install slurmctld slurmd slurm-client munge (Debian 12: slurm 22.05, munge 0.5.15).
# What works here and why (fake GPU devices, DefMemPerCPU, ReturnToService, no accounting): docs/facts.md,
# "SLURM on one machine".
set -euo pipefail

cmd=${1:-}
state=${2:-${SNAKETUNE_SLURM_DIR:-${TMPDIR:-/tmp}/snaketune-slurm}}
gpus=${SLURM_FAKE_GPUS:-3}
nodes=${SLURM_CLUSTER_NODES:-1}
port=${SLURM_CLUSTER_PORT:-6817}
conf=$state/etc/slurm.conf
netns=snaketune-slurm  # network namespace of the second node (SLURM_CLUSTER_NODES=2)
# Addresses when there are two nodes: node1 stays in this namespace, node2 gets its own.
addr1=10.213.0.1 addr2=10.213.0.2

die() { echo "slurm_cluster.sh: $*" >&2; exit 1; }

# pid from a pid file, only while that process is alive and is the program named (pids get reused).
live_pid() {
  local file=$1 name=$2 pid
  [[ -s $file ]] || return 1
  pid=$(<"$file")
  [[ $pid =~ ^[0-9]+$ ]] && [[ -r /proc/$pid/stat ]] || return 1
  [[ $(</proc/"$pid"/comm) == "$name"* ]] || return 1
  # A zombie is dead already (its parent has not reaped it).
  [[ $(awk '{print $3}' /proc/"$pid"/stat 2>/dev/null) != Z ]] || return 1
  echo "$pid"
}

stop_pid() {
  local file=$1 name=$2 pid i
  if pid=$(live_pid "$file" "$name"); then
    kill -TERM "$pid" 2>/dev/null || true
    for i in $(seq 50); do live_pid "$file" "$name" >/dev/null || break; sleep 0.1; done
    if live_pid "$file" "$name" >/dev/null; then kill -KILL "$pid" 2>/dev/null || true; fi
  fi
  rm -f "$file"
}

node_names() { if ((nodes == 1)); then echo localhost; else echo node1 node2; fi; }

nodes_idle() {
  local states
  states=$(SLURM_CONF=$conf timeout 5 sinfo -h -N -o '%t' 2>/dev/null) || return 1
  [[ -n $states ]] && ! grep -qv -E '^(idle|mix|alloc)$' <<<"$states"
}

write_config() {
  local cpus mem gres_dev last=$((gpus - 1))
  # The node advertises SLURM_FAKE_CPUS CPUs and SLURM_FAKE_MEM_MB memory whatever the machine has
  # (SlurmdParameters=config_overrides), so that the shipped profile's requests fit; nothing is enforced
  # (no cgroups) and the train launcher caps its threads at the cores it can really use.
  cpus=${SLURM_FAKE_CPUS:-32}
  mem=${SLURM_FAKE_MEM_MB:-262144}
  gres_dev=$state/dev/nvidia
  mkdir -p "$state"/{etc,dev,log,ctld,munge}
  echo "$nodes" >"$state/nodes"
  for i in $(seq 0 "$last"); do
    # A GRES without File= is dropped and File=/dev/null is refused; a character device works (docs/facts.md).
    [[ -c $gres_dev$i ]] || mknod "$gres_dev$i" c 1 3
  done
  local ctld_host="localhost(127.0.0.1)"
  ((nodes == 1)) || ctld_host="$(hostname)($addr1)"
  cat >"$conf" <<EOF
# Written by scripts/slurm_cluster.sh; rewritten at every start.
ClusterName=snaketune
SlurmctldHost=$ctld_host
SlurmctldPort=$port
SlurmdPort=$((port + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$state/munge/munge.socket
StateSaveLocation=$state/ctld
SlurmdSpoolDir=$state/slurmd-%n
SlurmctldPidFile=$state/slurmctld.pid
SlurmdPidFile=$state/slurmd-%n.pid
SlurmctldLogFile=$state/log/slurmctld.log
SlurmdLogFile=$state/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
GresTypes=gpu
DefMemPerCPU=1024
ReturnToService=2
MpiDefault=none
SlurmdTimeout=30
SlurmdParameters=config_overrides
EOF
  if ((nodes == 1)); then
    echo "NodeName=localhost NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem Gres=gpu:$gpus State=UNKNOWN" >>"$conf"
  else
    # Two nodes share the machine's CPUs and memory: each claims them all (SLURM trusts the config).
    echo "NodeName=node1 NodeAddr=$addr1 CPUs=$cpus RealMemory=$mem Gres=gpu:$gpus State=UNKNOWN" >>"$conf"
    echo "NodeName=node2 NodeAddr=$addr2 CPUs=$cpus RealMemory=$mem Gres=gpu:$gpus State=UNKNOWN" >>"$conf"
  fi
  echo "PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP" >>"$conf"
  echo "Name=gpu File=${gres_dev}[0-$last]" >"$state/etc/gres.conf"
}

# The conf must also be at SLURM's default path: snakemake-executor-plugin-slurm-jobstep 0.6 clears every
# SLURM_* variable but a few job ids (SLURM_CONF included) before the `srun` that runs a job, and that srun
# then finds no configuration ("fetch_config: DNS SRV lookup failed"). A symlink, only where none exists.
default_conf=/etc/slurm/slurm.conf
link_default_conf() {
  if [[ -L $default_conf && $(readlink "$default_conf") == "$conf" ]]; then return 0; fi
  if [[ -L $default_conf ]]; then
    # Left by a cluster of this script in another state directory that is no longer running: replace it.
    local old old_state
    old=$(readlink "$default_conf")
    old_state=${old%/etc/slurm.conf}
    if [[ $old_state != "$old" ]] && ! live_pid "$old_state/slurmctld.pid" slurmctld >/dev/null; then
      rm -f "$default_conf"
    fi
  fi
  [[ -e $default_conf || -L $default_conf ]] && die "$default_conf exists (another SLURM setup?); not replacing it"
  mkdir -p "$(dirname "$default_conf")"
  ln -s "$conf" "$default_conf"
}

unlink_default_conf() {
  if [[ -L $default_conf && $(readlink "$default_conf") == "$conf" ]]; then rm -f "$default_conf"; fi
}

# Second node: a network namespace with its own address, joined to this one by a veth pair; node names
# resolve through /etc/hosts lines that carry a marker, removed again by stop.
setup_network() {
  ((nodes == 2)) || return 0
  ip netns list | grep -qw "$netns" || ip netns add "$netns"
  if ! ip link show sts0 >/dev/null 2>&1; then
    ip link add sts0 type veth peer name sts1
    ip link set sts1 netns "$netns"
    ip addr add "$addr1/24" dev sts0
    ip link set sts0 up
    ip netns exec "$netns" ip addr add "$addr2/24" dev sts1
    ip netns exec "$netns" ip link set sts1 up
    ip netns exec "$netns" ip link set lo up
  fi
  grep -q "# snaketune-slurm" /etc/hosts || printf '%s node1 # snaketune-slurm\n%s node2 # snaketune-slurm\n' \
    "$addr1" "$addr2" >>/etc/hosts
}

teardown_network() {
  if ip netns list 2>/dev/null | grep -qw "$netns"; then ip netns delete "$netns"; fi
  if ip link show sts0 >/dev/null 2>&1; then ip link delete sts0 2>/dev/null || true; fi
  if grep -q "# snaketune-slurm" /etc/hosts 2>/dev/null; then
    # /etc/hosts may be a bind mount: rewrite it in place rather than replace it.
    local kept
    kept=$(grep -v "# snaketune-slurm" /etc/hosts)
    printf '%s\n' "$kept" >/etc/hosts
  fi
}

start_slurmd() {
  local name=$1
  if live_pid "$state/slurmd-$name.pid" slurmd >/dev/null; then return 0; fi
  mkdir -p "$state/slurmd-$name"
  if [[ $name == node2 ]]; then
    # nsenter, not `ip netns exec`: that remounts /sys, hiding the cgroup mount slurmd checks for.
    nsenter --net="/run/netns/$netns" unshare --uts sh -c "hostname node2 && exec slurmd -f '$conf' -N node2"
  elif [[ $name == node1 ]]; then
    # Its own hostname, so that the ranks it starts resolve it to $addr1 (gloo binds the hostname's address).
    unshare --uts sh -c "hostname node1 && exec slurmd -f '$conf' -N node1"
  else
    slurmd -f "$conf" -N "$name"
  fi
}

do_start() {
  for prog in munged slurmctld slurmd sinfo mknod; do
    command -v "$prog" >/dev/null || die "$prog not found: apt-get install slurmctld slurmd slurm-client munge"
  done
  [[ $(id -u) == 0 ]] || die "must run as root (it starts daemons and makes device files)"
  if nodes_idle && live_pid "$state/slurmctld.pid" slurmctld >/dev/null; then
    echo "export SLURM_CONF=$conf"
    return 0
  fi
  do_stop quiet  # a half-started cluster: start again from a clean slate
  write_config
  link_default_conf
  setup_network
  local key=$state/munge/munge.key
  if [[ ! -s $key ]]; then
    (umask 077 && head -c 1024 /dev/urandom >"$key")
  fi
  chmod 755 "$state/munge"
  chmod 400 "$key"
  # Its own socket and key, so a munged the machine may already run is left alone; as root it needs --force.
  munged --force --socket="$state/munge/munge.socket" --key-file="$key" \
    --pid-file="$state/munge/munged.pid" --log-file="$state/log/munged.log" --seed-file="$state/munge/seed"
  slurmctld -c -f "$conf"
  for name in $(node_names); do start_slurmd "$name"; done
  for _ in $(seq 150); do
    nodes_idle && break
    sleep 0.2
  done
  if ! nodes_idle; then
    SLURM_CONF=$conf sinfo -N -l >&2 || true
    tail -n 20 "$state"/log/*.log >&2 || true
    do_stop quiet
    die "the node did not become idle within 30 s (logs in $state/log)"
  fi
  echo "export SLURM_CONF=$conf"
}

do_stop() {
  [[ -d $state ]] || return 0
  # Tear down what start made, whatever SLURM_CLUSTER_NODES says now.
  local made=$nodes
  if [[ -s $state/nodes ]]; then made=$(<"$state/nodes"); fi
  if live_pid "$state/slurmctld.pid" slurmctld >/dev/null; then
    # Cancel this cluster's jobs first, so that slurmstepd ends the job's processes.
    local jobs
    jobs=$(SLURM_CONF=$conf timeout 5 squeue -h -o '%A' 2>/dev/null || true)
    if [[ -n $jobs ]]; then
      # shellcheck disable=SC2086
      SLURM_CONF=$conf timeout 5 scancel $jobs 2>/dev/null || true
      for _ in $(seq 50); do
        [[ -z $(SLURM_CONF=$conf timeout 5 squeue -h -o '%A' 2>/dev/null || true) ]] && break
        sleep 0.2
      done
    fi
  fi
  for pidfile in "$state"/slurmd-*.pid; do
    [[ -e $pidfile ]] && stop_pid "$pidfile" slurmd
  done
  stop_pid "$state/slurmctld.pid" slurmctld
  stop_pid "$state/munge/munged.pid" munged
  if ((made == 2)); then teardown_network; fi
  unlink_default_conf
  [[ ${1:-} == quiet ]] || echo "stopped the SLURM cluster in $state"
}

case $cmd in
  start) do_start ;;
  stop) do_stop ;;
  status) nodes_idle ;;
  *) die "usage: $0 start|stop|status [STATE_DIR]" ;;
esac
