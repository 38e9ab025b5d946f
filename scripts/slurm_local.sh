#!/usr/bin/env bash
# A real one-node SLURM cluster on this machine, for CI and tests/test_slurm.py.
#
#   scripts/slurm_local.sh up       install (if missing) munge + slurm, write /etc/slurm/slurm.conf,
#                                   start munged, slurmctld, slurmd, wait for the node to be idle and
#                                   run a trivial srun and sbatch job. Idempotent.
#   scripts/slurm_local.sh status   daemons, sinfo, squeue
#   scripts/slurm_local.sh down     cancel jobs, stop slurmd, slurmctld, munged. Idempotent.
#
# Debian / Ubuntu, no systemd needed: the daemons are started directly as root (munged as user
# munge). Needs root; re-runs itself with sudo when available. Environment knobs:
#   SLURM_LOCAL_FORCE=1      overwrite an /etc/slurm/slurm.conf that this script did not write
#   SLURM_LOCAL_TIMEOUT=90   seconds to wait for the node / the smoke-test jobs
set -euo pipefail

CONF_DIR=/etc/slurm
CONF=$CONF_DIR/slurm.conf
MARKER="# written by scripts/slurm_local.sh"
PACKAGES=(munge slurm-client slurmctld slurmd)
STATE_DIR=/var/spool/slurmctld
SPOOL_DIR=/var/spool/slurmd
LOG_DIR=/var/log/slurm
CTLD_PID=/run/slurmctld.pid
SLURMD_PID=/run/slurmd.pid
MUNGE_PID=/run/munge/munged.pid
MUNGE_KEY=/etc/munge/munge.key
TIMEOUT=${SLURM_LOCAL_TIMEOUT:-90}

say() { printf '[slurm_local] %s\n' "$*"; }
die() { printf '[slurm_local] ERROR: %s\n' "$*" >&2; exit 1; }

need_root() {
    if [[ $EUID -ne 0 ]]; then
        command -v sudo >/dev/null || die "must run as root (no sudo found)"
        exec sudo -E "$0" "$@"
    fi
}

# pid from a pid file, only if that process is alive and is the expected program
live_pid() {  # live_pid <pidfile> <comm>
    local pid
    [[ -f $1 ]] || return 1
    pid=$(cat "$1" 2>/dev/null) || return 1
    [[ $pid =~ ^[0-9]+$ ]] || return 1
    [[ -r /proc/$pid/comm && $(cat "/proc/$pid/comm" 2>/dev/null) == "$2"* ]] || return 1
    # a killed daemon can linger as a zombie until its parent reaps it: that is not running
    [[ $(sed 's/.*) //' "/proc/$pid/stat" 2>/dev/null | cut -c1) != Z ]] || return 1
    echo "$pid"
}

stop_pid() {  # stop_pid <pidfile> <comm>: SIGTERM, wait up to 20 s, then SIGKILL
    local pid i
    pid=$(live_pid "$1" "$2") || { say "$2 is not running"; return 0; }
    say "stopping $2 (pid $pid)"
    kill "$pid" 2>/dev/null || true
    for i in $(seq 1 40); do
        kill -0 "$pid" 2>/dev/null || { rm -f "$1"; return 0; }
        sleep 0.5
    done
    say "$2 (pid $pid) ignored SIGTERM, sending SIGKILL"
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$1"
}

install_packages() {
    local missing=() p
    for p in "${PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    if [[ ${#missing[@]} -eq 0 ]]; then
        say "packages present: ${PACKAGES[*]} ($(dpkg-query -W -f='${Version}' slurmctld))"
        return
    fi
    command -v apt-get >/dev/null || die "missing ${missing[*]} and no apt-get: install them by hand"
    say "installing ${missing[*]} (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null
    apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
}

setup_munge() {
    install -d -o munge -g munge -m 0700 /etc/munge /var/log/munge
    install -d -o munge -g munge -m 0711 /var/lib/munge
    install -d -o munge -g munge -m 0755 /run/munge
    if [[ ! -s $MUNGE_KEY ]]; then
        say "creating munge key $MUNGE_KEY"
        dd if=/dev/urandom of=$MUNGE_KEY bs=1024 count=1 status=none
    fi
    # munged refuses a key readable by others or not owned by its user
    chown munge:munge $MUNGE_KEY
    chmod 0400 $MUNGE_KEY
}

start_munge() {
    if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
        say "munged is running"
        return
    fi
    say "starting munged"
    runuser -u munge -- /usr/sbin/munged || die "munged failed to start: see /var/log/munge/munged.log"
    local i
    for i in $(seq 1 20); do
        munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return
        sleep 0.5
    done
    die "munged does not answer (munge -n | unmunge): see /var/log/munge/munged.log"
}

CONF_CHANGED=0
write_conf() {  # sets CONF_CHANGED=1 when the file was (re)written
    local node host tmp
    host=$(hostname -s)
    # the node as slurmd sees it (CPUs, sockets, cores, threads, RealMemory): a node that claims
    # more than the hardware has is drained by slurmctld ("Low RealMemory" / "Low CPUs")
    node=$(slurmd -C | head -n1)
    [[ $node == NodeName=* ]] || die "unexpected 'slurmd -C' output: $node"
    tmp=$(mktemp)
    cat >"$tmp" <<EOF
$MARKER: a one-node test cluster; edit the script, not this file.
ClusterName=localcluster
SlurmctldHost=$host(127.0.0.1)
SlurmUser=slurm
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
# no cgroups: plain process tracking, no CPU binding (works in containers)
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
# no slurmdbd: sacct is unavailable (submitit then polls for its result files, see the test)
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# a node that went DOWN (e.g. slurmd restarted) comes back by itself when slurmd registers
ReturnToService=2
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=$STATE_DIR
SlurmdSpoolDir=$SPOOL_DIR
SlurmctldPidFile=$CTLD_PID
SlurmdPidFile=$SLURMD_PID
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
SlurmctldTimeout=120
SlurmdTimeout=300
InactiveLimit=0
MinJobAge=300
KillWait=10
Waittime=0
$node NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
    if [[ -f $CONF ]] && ! grep -qF "$MARKER" "$CONF" && [[ ${SLURM_LOCAL_FORCE:-0} != 1 ]]; then
        rm -f "$tmp"
        die "$CONF exists and was not written by this script: set SLURM_LOCAL_FORCE=1 to replace it"
    fi
    if [[ -f $CONF ]] && cmp -s "$tmp" "$CONF"; then
        rm -f "$tmp"
        say "$CONF is up to date"
        return
    fi
    install -d -m 0755 $CONF_DIR
    install -m 0644 "$tmp" "$CONF"
    rm -f "$tmp"
    say "wrote $CONF ($node)"
    CONF_CHANGED=1
}

make_dirs() {
    install -d -o slurm -g slurm -m 0755 $STATE_DIR $LOG_DIR
    install -d -o root -g root -m 0755 $SPOOL_DIR
}

node_name() { sed -n 's/^NodeName=\([^ ]*\).*/\1/p' "$CONF" | head -n1; }

node_state() { sinfo -h -N -n "$(node_name)" -o '%T' 2>/dev/null | head -n1; }

wait_for_node() {
    local node state i resumed=0
    node=$(node_name)
    say "waiting for node $node to be idle (up to ${TIMEOUT}s)"
    for i in $(seq 1 $((TIMEOUT * 2))); do
        state=$(node_state || true)
        case $state in
            idle|mixed|allocated|completing)
                say "node $node is $state"; return 0 ;;
            *drain*|*down*|*fail*|*inval*)
                # left over from an earlier run (slurmd killed, hardware changed): resume it once;
                # ReturnToService=2 does this by itself for a plain DOWN node
                if [[ $resumed == 0 ]]; then
                    say "node $node is $state ($(scontrol show node "$node" | sed -n 's/.*Reason=\(.*\)/\1/p')), resuming"
                    scontrol update NodeName="$node" State=RESUME 2>/dev/null || true
                    resumed=1
                fi ;;
        esac
        sleep 0.5
    done
    sinfo -N -l || true
    scontrol show node "$node" || true
    tail -n 20 $LOG_DIR/slurmctld.log $LOG_DIR/slurmd.log >&2 || true
    die "node $node is not idle after ${TIMEOUT}s (state: ${state:-unknown})"
}

smoke_test() {
    local out
    say "smoke test: srun hostname"
    out=$(timeout "$TIMEOUT" srun -N1 -n1 -t 1 hostname) || die "srun hostname failed"
    say "  srun ran on: $out"
    say "smoke test: sbatch --wait --wrap"
    out=$(mktemp)
    timeout "$TIMEOUT" sbatch --wait -Q -t 1 -o "$out" --wrap 'echo "sbatch job $SLURM_JOB_ID on $(hostname)"' \
        || { cat "$out" >&2; rm -f "$out"; die "sbatch --wait --wrap failed"; }
    say "  $(cat "$out")"
    rm -f "$out"
}

cmd_up() {
    install_packages
    setup_munge
    make_dirs
    write_conf
    start_munge
    if [[ $CONF_CHANGED == 1 ]] && { live_pid $CTLD_PID slurmctld >/dev/null || live_pid $SLURMD_PID slurmd >/dev/null; }; then
        say "slurm.conf changed: restarting the slurm daemons"
        stop_pid $SLURMD_PID slurmd
        stop_pid $CTLD_PID slurmctld
    fi
    if live_pid $CTLD_PID slurmctld >/dev/null; then
        say "slurmctld is running (pid $(live_pid $CTLD_PID slurmctld))"
    else
        say "starting slurmctld"
        /usr/sbin/slurmctld || die "slurmctld failed: see $LOG_DIR/slurmctld.log"
    fi
    local i
    for i in $(seq 1 $((TIMEOUT * 2))); do
        scontrol ping 2>/dev/null | grep -q UP && break
        sleep 0.5
    done
    scontrol ping 2>/dev/null | grep -q UP || { tail -n 30 $LOG_DIR/slurmctld.log >&2; die "slurmctld does not answer"; }
    if live_pid $SLURMD_PID slurmd >/dev/null; then
        say "slurmd is running (pid $(live_pid $SLURMD_PID slurmd))"
    else
        say "starting slurmd"
        /usr/sbin/slurmd || die "slurmd failed: see $LOG_DIR/slurmd.log"
    fi
    wait_for_node
    smoke_test
    say "cluster is up:"
    sinfo
}

cmd_down() {
    if live_pid $CTLD_PID slurmctld >/dev/null; then
        local jobs
        jobs=$(squeue -h -o '%i' 2>/dev/null || true)
        if [[ -n $jobs ]]; then
            say "cancelling jobs: $(echo $jobs)"
            # shellcheck disable=SC2086
            scancel $jobs || true
            sleep 2
        fi
    fi
    stop_pid $SLURMD_PID slurmd
    stop_pid $CTLD_PID slurmctld
    stop_pid $MUNGE_PID munged
    say "cluster is down"
}

cmd_status() {
    local p
    for p in "$MUNGE_PID munged" "$CTLD_PID slurmctld" "$SLURMD_PID slurmd"; do
        set -- $p
        if pid=$(live_pid "$1" "$2"); then say "$2: running (pid $pid)"; else say "$2: not running"; fi
    done
    if live_pid $CTLD_PID slurmctld >/dev/null; then
        sinfo -N -l || true
        squeue || true
    fi
}

case ${1:-} in
    up) need_root "$@"; cmd_up ;;
    down) need_root "$@"; cmd_down ;;
    status) cmd_status ;;
    *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
