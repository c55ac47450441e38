#!/usr/bin/env bash
# capture.sh OUTDIR NODE1 - capture what SLURM prints for the parsers of slurmrun/slurm/ (the
# golden files of tests/test_slurm_goldens.py), on a live cluster of >= 2 nodes with 2 fake
# GPUs each (tests/cluster/slurm-cluster.sh, or a Debian rootfs's cluster beside it).
# $RUN prefixes every SLURM command (e.g. a chroot's exec wrapper); $WORK is the jobs' folder.
# NODE1 is the cluster's first node name: the submit line names it, as a user's words might.
set -euo pipefail
OUT=$(readlink -f "$1"); NODE1=$2
RUN=${RUN:-}
WORK=${WORK:-$(mktemp -d)}
mkdir -p "$OUT"
s() { $RUN bash -c "cd '$WORK' && $*"; }
printf '#!/bin/sh\nsleep 90\n' >"$WORK/job.sh"; chmod +x "$WORK/job.sh"

state() { s "squeue -h -j $1 -o %T" 2>/dev/null | head -1; }
wait_running() {  # job id: every element/component running
  for _ in $(seq 120); do
    st=$(s "squeue -h --array -j $1 -o %T" 2>/dev/null | sort -u | tr '\n' ' ')
    [ "$st" = "RUNNING " ] && return 0; sleep 0.5
  done
  echo "capture: job $1 did not start ($st)" >&2; return 1
}
wait_gone() {
  for _ in $(seq 120); do [ -z "$(s "squeue -h -j $1 -o %T" 2>/dev/null)" ] && return 0; sleep 0.5; done
}
submit() { s "sbatch --parsable $*" | cut -d';' -f1; }
show() { s "scontrol show job -d $1" >"$OUT/$2"; }

s "scontrol --version" >"$OUT/version.txt"
s "scontrol show config" >"$OUT/config.txt"
s "scontrol show partition" >"$OUT/partition.txt"
s "scontrol show node $NODE1" >"$OUT/node.txt"

# CPU job: the submit line (and, for sbatch, Command) holds words that look like fields.
j=$(submit "-J 'cpu job' -N2 -n3 job.sh NumTasks=5 Nodes=$NODE1 GRES=gpu:8")
wait_running "$j"; show "$j" job_cpu.txt; s "scancel $j"; wait_gone "$j"

# A wrapped script of several lines, one indented like a field line.
j=$(submit "-N1 -n1 --comment='two words' --wrap=\$'sleep 90\n   NumTasks=7 srun true\nNumNodes=9'")
wait_running "$j"; show "$j" job_wrap.txt; s "scancel $j"; wait_gone "$j"

# GPU jobs (fake gres).
j=$(submit "-N2 --ntasks-per-node=1 --gpus-per-node=2 job.sh")
wait_running "$j"; show "$j" job_gpu.txt; s "scancel $j"; wait_gone "$j"
j=$(submit "-N1 -n2 -c1 --gres=gpu:1 job.sh")
wait_running "$j"; show "$j" job_gres.txt; s "scancel $j"; wait_gone "$j"

# Array: running elements, then a held (pending) one, as squeue prints it with and without --array.
j=$(submit "--array=0-2 -n1 job.sh")
wait_running "$j"; show "$j" job_array.txt
s "squeue --noheader --states=all --jobs=${j}_0,${j}_1,${j}_2 --format='%i|%T'" >"$OUT/squeue_array_running.txt"
s "scancel $j"; wait_gone "$j"
j=$(submit "--hold --array=0-2 -n1 job.sh")
sleep 1; show "$j" job_array_pending.txt
s "squeue --noheader --states=all --jobs=${j}_0,${j}_1,${j}_2 --format='%i|%T'" >"$OUT/squeue_array_pending.txt"
s "squeue --array --noheader --states=all --jobs=${j}_0,${j}_1,${j}_2 --format='%i|%T'" >"$OUT/squeue_array_pending_array.txt"
echo "$j" >"$OUT/array_pending_id.txt"
s "scancel $j"; wait_gone "$j"

# Heterogeneous job.
j=$(submit "-n1 : -n2 job.sh")
sleep 1; wait_running "$j" || true; show "$j" job_het.txt; s "scancel $j"; wait_gone "$j"

# sacct without accounting: its status and what it says.
{ s "sacct --noheader --parsable2 --allocations --jobs=$j --format=JobID,State" 2>&1; echo "rc=$?"; } >"$OUT/sacct.txt" || true
echo "capture: $(cat "$OUT/version.txt") -> $OUT" >&2
