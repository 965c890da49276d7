#!/bin/bash
# hpc_ddp training job: one task per GPU on every allocated node, all started by srun.
# Written by hpc-ddp from its train.sh template; it runs: 'configs/my runs/it'"'"'s; echo PWNED.yaml' 'run.name=$(touch PWNED)' 'run.output_dir=`touch PWNED2`' 'tracking.experiment="x y"'
#
#   sbatch job.sh                     # as written
#   sbatch --nodes=4 job.sh           # sbatch's options override the directives below
#   sbatch job.sh other.py --lr 1e-3  # another program, or other arguments
#
# It works in /the/folder/it/was/rendered/in: relative paths are read from there.
#
#SBATCH --job-name=hpc-ddp
# Nodes to spread the job over.
#SBATCH --nodes=1
# Tasks (= training ranks) per node: one per GPU, so keep it equal to --gpus-per-node below
# (`hpc-ddp render --gpus-per-node N` writes both; a mismatch stops at start with a HINT).
#SBATCH --ntasks-per-node=3
# GPUs per node, shared by the node's tasks: each task sees them all and drives
# cuda:LOCAL_RANK. Unlike --gpus-per-task (one GPU visible per task), this lets NCCL move
# gradients directly between the GPUs of a node (CUDA IPC over NVLink or PCIe).
# (--gpus-per-node not requested)
# CPU cores per task, for the training process and its DataLoader workers.
#SBATCH --cpus-per-task=2
# Wall-clock limit (HH:MM:SS).
#SBATCH --time=30
# stdout and stderr of the batch script and every task: <job name>-<job id>.out. Slurm opens
# it before the script runs and never creates its folder (a missing one fails the job with no
# log at all): as checked in, it goes to the directory sbatch was called from; `hpc-ddp
# render` writes its --log-dir here (./logs by default) and creates it.
#SBATCH --output=/the/folder/it/was/rendered/in/logs/%x-%j.out
#SBATCH --error=/the/folder/it/was/rendered/in/logs/%x-%j.out
# Append, so a requeued job adds its attempt to the same log instead of truncating it.
#SBATCH --open-mode=append
# SIGUSR1 to every task 120 s before the time limit: time to checkpoint and stop.
#SBATCH --signal=USR1@120
# Allow Slurm (and the job itself) to requeue this job after preemption or a node failure.
#SBATCH --requeue

set -euo pipefail

# The folder the script was written in: the program's relative paths (the script, its
# configs, slurm/site.sh) are read from there, wherever the script is submitted from.
workdir=/the/folder/it/was/rendered/in
if ! cd -- "$workdir"; then
    echo "error: cannot work in $workdir, the folder this script was written in." \
        "HINT: write it again with hpc-ddp render in the project's folder" >&2
    exit 2
fi

# The warning signal of the --signal directive above: the ranks check that it is the one they
# handle (preempt.signal) and refuse to start if not. `hpc-ddp render` writes both; if you pass
# --signal to sbatch, also pass --export=ALL,HPC_DDP_JOB_SIGNAL=<that signal>.
export HPC_DDP_JOB_SIGNAL=${HPC_DDP_JOB_SIGNAL:-USR1}

# The program when the sbatch command line gives none (`hpc-ddp render` fills it): a .yaml
# config (and overrides) for the built-in trainer, a script, or -m and a module.
DEFAULT_ARGS=('configs/my runs/it'"'"'s; echo PWNED.yaml' 'run.name=$(touch PWNED)' 'run.output_dir=`touch PWNED2`' 'tracking.experiment="x y"')

# Where NCCL's flight-recorder dumps go, beside the job's log (`hpc-ddp render` writes both).
HPC_DDP_LOG_DIR=${HPC_DDP_LOG_DIR:-/the/folder/it/was/rendered/in/logs}

# Site specifics (module load, venv or conda activation, NCCL settings) go in one optional
# file: $HPC_DDP_SITE, else slurm/site.sh in the folder the job works in.
site_file=${HPC_DDP_SITE:-slurm/site.sh}
if [[ -f $site_file ]]; then
    # shellcheck source=/dev/null
    source "$site_file"
fi

# The part both job templates share (NCCL's flight recorder, the program every rank runs),
# from the installed hpc_ddp: this script runs from Slurm's spool, away from any checkout.
# $PYTHON; else the python of the environment slurm/site.sh activated; else the one
# this script was written with.
if [[ -n ${PYTHON:-} ]]; then
    python=$PYTHON
elif [[ -f $site_file ]]; then
    python=python
else
    python=/the/python/that/rendered/it
fi
if ! body=$("$python" -m hpc_ddp.launch.templates); then
    echo "error: $python cannot import hpc_ddp. HINT: activate its environment in" \
        "slurm/site.sh (or \$HPC_DDP_SITE), or set PYTHON to its python" >&2
    exit 2
fi
# shellcheck source=/dev/null
source "$body"

# One thread pool per task, sized to the cores Slurm gave it.
export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}

echo "job ${queue_job} on ${SLURM_JOB_NODELIST}: ${args[*]}"
# --kill-on-bad-exit: one failed rank ends the whole step at once instead of leaving the
# other ranks waiting in a collective until the time limit. --label: each line of the log
# starts with its task's rank ("3: "); srun passes a task's output on in pieces of 1 KB, and
# a longer line from one rank would otherwise be cut into another's. Each rank starts with
# the stop signals blocked until its first line holds them (job-body.sh).
#
# A rank lost to its host (killed by a signal it did not ask for, or its device failed) then
# leaves that host out of the job, which is requeued to go on from its last checkpoint
# (preempt.max_node_failures): rank 0 tells where the run keeps its record in the file below,
# and python -m hpc_ddp.launch.step_failure reads srun's lines of this attempt in the log.
export HPC_DDP_STEP_HANDOFF=${TMPDIR:-/tmp}/hpc-ddp-step-${SLURM_JOB_ID}-${SLURM_RESTART_COUNT:-0}.json
trap 'rm -f -- "${HPC_DDP_STEP_HANDOFF:-}"' EXIT  # also when a preemption's requeue ends it
log_from=$(stat -L -c %s "/proc/$$/fd/2" 2>/dev/null || echo 0)
status=0
srun --kill-on-bad-exit=1 --label "${blocked_until_held[@]}" "$python" "${program[@]}" || status=$?
if ((status != 0)); then
    # Its requeue sends this batch step SIGTERM: the script (and the helper with it) ignores
    # it, so the job is never left held half-way; Slurm ends the step after KillWait anyway.
    trap '' TERM
    answered=0
    "$python" -m hpc_ddp.launch.step_failure "$status" "$log_from" || answered=$?
    status=$answered
fi
exit "$status"
