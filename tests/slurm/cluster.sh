#!/usr/bin/env bash
# A two-node Slurm cluster on loopback, for tests and for trying the sbatch files on one machine.
#   tests/slurm/cluster.sh start STATE_DIR   # prints `export SLURM_CONF=...` on success
#   tests/slurm/cluster.sh stop STATE_DIR    # stops exactly the daemons it started (by PID), removes STATE_DIR
# Needs Debian's slurmctld, slurmd, slurm-client and munge, and root (slurmd runs jobs as their user).
set -euo pipefail
action=${1:?start|stop}
state=$(realpath -m "${2:?STATE_DIR}")

stop() {
  for pidfile in "$state"/pids/*.pid; do
    [[ -f "$pidfile" ]] || continue
    kill "$(cat "$pidfile")" 2>/dev/null || true
  done
  sleep 1
  for pidfile in "$state"/pids/*.pid; do
    [[ -f "$pidfile" ]] || continue
    kill -9 "$(cat "$pidfile")" 2>/dev/null || true
  done
  case "$state" in /tmp/*) rm -rf "$state" ;; esac  # only ever delete our own scratch directory
}

if [[ "$action" == stop ]]; then
  stop
  exit 0
fi

mkdir -p "$state"/{pids,munge,ctld,log}
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
ctld_port=$(free_port)
chown munge: "$state/munge"
n1_port=$(free_port)
n2_port=$(free_port)

runuser -u munge -- munged --socket="$state/munge/munge.socket" --pid-file="$state/munge/munged.pid" \
  --log-file="$state/munge/munged.log" --seed-file="$state/munge/munged.seed" --key-file=/etc/munge/munge.key
cp "$state/munge/munged.pid" "$state/pids/munged.pid"

cat > "$state/slurm.conf" <<CONF
ClusterName=fsdp2test
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket=$state/munge/munge.socket
StateSaveLocation=$state/ctld
SlurmdSpoolDir=$state/slurmd-%n
SlurmctldPidFile=$state/pids/slurmctld.pid
SlurmdPidFile=$state/pids/slurmd-%n.pid
SlurmctldLogFile=$state/log/slurmctld.log
SlurmdLogFile=$state/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
JobRequeue=1
SlurmdTimeout=60
KillWait=10
NodeName=n1 NodeHostname=$(hostname) NodeAddr=127.0.0.1 Port=$n1_port CPUs=1 State=UNKNOWN
NodeName=n2 NodeHostname=$(hostname) NodeAddr=127.0.0.1 Port=$n2_port CPUs=1 State=UNKNOWN
PartitionName=debug Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
export SLURM_CONF="$state/slurm.conf"
slurmctld -f "$SLURM_CONF"
for node in n1 n2; do
  slurmd -f "$SLURM_CONF" -N "$node"
done
for _ in $(seq 60); do
  if [[ -f "$state/pids/slurmd-n1.pid" && -f "$state/pids/slurmd-n2.pid" && $(sinfo -h -N -o "%T" 2>/dev/null | grep -c idle) == 2 ]]; then
    echo "export SLURM_CONF=$SLURM_CONF"
    exit 0
  fi
  sleep 0.5
done
echo "slurm did not come up; logs in $state/log" >&2
stop
exit 1
