#!/usr/bin/env bash
# A one-machine Slurm cluster from Debian's packages (munge, slurmctld, slurmd),
# for the tests and for trying accel under srun/sbatch. Everything lives in one
# folder (config, state, logs, munge socket); nothing under /etc is changed.
#
#   scripts/slurm_cluster.sh start DIR   start it; prints `export SLURM_CONF=DIR/slurm.conf`
#   scripts/slurm_cluster.sh stop DIR    stop every daemon it started and remove DIR
#
# Needs root (slurmd runs jobs as their user) and the packages slurmd,
# slurmctld, slurm-client and munge (`make slurm-setup`). The node has
# 8 CPUs whatever the machine has (SlurmdParameters=config_overrides) and its
# partition oversubscribes, so 2-core machines run multi-rank jobs.
set -euo pipefail
cmd=${1:-}; DIR=${2:-}
[[ -n $cmd && -n $DIR ]] || { echo "usage: $0 start|stop DIR" >&2; exit 2; }
log() { echo "slurm-cluster: $*" >&2; }

stop() {
    for p in slurmd slurmctld munged; do
        if [[ -f $DIR/$p.pid ]]; then
            pid=$(cat "$DIR/$p.pid")
            kill "$pid" 2>/dev/null || true
            for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
            kill -9 "$pid" 2>/dev/null || true
        fi
    done
    # Job steps slurmstepd left behind.
    pkill -9 -f "slurmstepd.*$DIR" 2>/dev/null || true
    rm -rf "$DIR"
}

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

start() {
    [[ $(id -u) = 0 ]] || { log "needs root"; exit 1; }
    for b in slurmd slurmctld srun munged; do
        command -v $b >/dev/null || { log "$b not found: make slurm-setup"; exit 1; }
    done
    mkdir -p "$DIR"/{state,spool,log}
    DIR=$(cd "$DIR" && pwd)
    host=$(hostname -s)
    # munge: its own key and socket in DIR.
    dd if=/dev/urandom of="$DIR/munge.key" bs=1024 count=1 status=none
    chmod 400 "$DIR/munge.key"
    munged --force --key-file="$DIR/munge.key" --socket="$DIR/munge.sock" \
        --pid-file="$DIR/munged.pid" --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge.seed"
    cat >"$DIR/slurm.conf" <<CONF
ClusterName=accel
# Job ids (and so the ports srun-alone runs derive from them) differ between clusters.
FirstJobId=$(( (RANDOM << 8 | RANDOM) % 1000000 + 1 ))
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$DIR/munge.sock
CredType=cred/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
KillWait=10
InactiveLimit=0
MinJobAge=10
NodeName=$host NodeAddr=127.0.0.1 CPUs=8 State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES OverSubscribe=FORCE MaxTime=INFINITE State=UP
CONF
    export SLURM_CONF=$DIR/slurm.conf
    slurmctld -f "$SLURM_CONF"
    slurmd -f "$SLURM_CONF"
    for _ in $(seq 100); do
        if sinfo -h -o %t 2>/dev/null | grep -qE '^(idle|mix|alloc)'; then
            log "up in $DIR"; echo "export SLURM_CONF=$SLURM_CONF"; return 0
        fi
        sleep 0.2
    done
    log "the node did not come up; logs:"; tail -5 "$DIR"/log/*.log >&2
    stop; exit 1
}

case $cmd in
    start) start ;;
    stop) stop ;;
    *) echo "usage: $0 start|stop DIR" >&2; exit 2 ;;
esac
