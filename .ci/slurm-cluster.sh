#!/usr/bin/env bash
# A one-node Slurm cluster on loopback for the workflow's Slurm test (Debian's packages; root; no
# systemd): munge, MariaDB + slurmdbd (so that sacct works), slurmctld, slurmd.
#   .ci/slurm-cluster.sh start    install what is missing, write the configs, start the daemons
#   .ci/slurm-cluster.sh stop     stop them (by the pids they wrote)
set -euo pipefail
action=${1:-start}
conf=/etc/slurm
state=/var/lib/slurm
logs=/var/log/slurm
cpus=$(nproc)
# leave the node's memory some headroom, or slurmd reports less than slurm.conf and the node drains
memory_mb=$(( $(awk '/MemTotal/ {print int($2 / 1024)}' /proc/meminfo) * 85 / 100 ))

stop() {
  for pidfile in /run/slurmd.pid /run/slurmctld.pid /run/slurmdbd.pid; do
    [ -f "$pidfile" ] && kill "$(cat "$pidfile")" 2>/dev/null || true
  done
  [ -f /run/mysqld/mysqld.pid ] && kill "$(cat /run/mysqld/mysqld.pid)" 2>/dev/null || true
  [ -f /run/munge/munged.pid ] && kill "$(cat /run/munge/munged.pid)" 2>/dev/null || true
  return 0
}

wait_for() {  # wait_for SECONDS COMMAND...
  local deadline=$((SECONDS + $1)); shift
  until "$@" >/dev/null 2>&1; do
    if [ $SECONDS -ge $deadline ]; then echo "slurm-cluster: timed out waiting for: $*" >&2; return 1; fi
    sleep 1
  done
}

if [ "$action" = stop ]; then stop; exit 0; fi

if [ "$(id -u)" != 0 ]; then echo "slurm-cluster: needs root (it installs and starts daemons)" >&2; exit 1; fi
if ! command -v slurmctld >/dev/null || ! command -v slurmdbd >/dev/null || ! command -v mariadbd >/dev/null; then
  # the packages must not start their services through invoke-rc.d (no init system here)
  printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurmctld slurmd slurm-client slurmdbd munge mariadb-server >/dev/null
  rm -f /usr/sbin/policy-rc.d
fi

mkdir -p "$state/slurmctld" "$state/slurmd" "$logs" /run/munge /run/mysqld
chown munge:munge /run/munge && chown mysql:mysql /run/mysqld
[ -f /etc/munge/munge.key ] || runuser -u munge -- mungekey -c
pgrep -u munge munged >/dev/null || runuser -u munge -- /usr/sbin/munged
wait_for 30 bash -c 'munge -n | unmunge'

if ! mysqladmin ping >/dev/null 2>&1; then
  (mariadbd --user=mysql --pid-file=/run/mysqld/mysqld.pid >"$logs/mariadb.log" 2>&1 &)
  wait_for 60 mysqladmin ping
fi
mysql -e "CREATE DATABASE IF NOT EXISTS slurm_acct_db;
          CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurm';
          GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';"

cat > "$conf/slurmdbd.conf" <<EOF
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
PidFile=/run/slurmdbd.pid
LogFile=$logs/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
EOF
chmod 600 "$conf/slurmdbd.conf"

cat > "$conf/slurm.conf" <<EOF
ClusterName=moeshrink
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$state/slurmctld
SlurmdSpoolDir=$state/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=$logs/slurmctld.log
SlurmdLogFile=$logs/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/linux
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoreFlags=job_comment
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU_Memory
MpiDefault=none
ReturnToService=2
MinJobAge=600
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$memory_mb State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
echo "CgroupPlugin=cgroup/v1" > "$conf/cgroup.conf"

pgrep -x slurmdbd >/dev/null || slurmdbd
wait_for 60 sacctmgr -n list cluster
sacctmgr -i add cluster moeshrink >/dev/null 2>&1 || true
sacctmgr -i add account moeshrink Cluster=moeshrink >/dev/null 2>&1 || true
sacctmgr -i add user "$(id -un)" Account=moeshrink >/dev/null 2>&1 || true
pgrep -x slurmctld >/dev/null || slurmctld
wait_for 60 scontrol ping
pgrep -x slurmd >/dev/null || slurmd -N localhost
wait_for 60 bash -c 'sinfo -h -N -o %T | grep -Eq "idle|mixed|allocated"' || {
  scontrol update nodename=localhost state=resume || true
  wait_for 30 bash -c 'sinfo -h -N -o %T | grep -Eq "idle|mixed|allocated"'
}
srun -N1 -n1 true
echo "slurm-cluster: up ($cpus CPUs, $memory_mb MB, partition debug); sacct: $(sacct -n -X -o JobID | wc -l) job(s) recorded"
