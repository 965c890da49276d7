#!/bin/bash
# hpc_ddp training job, torchrun flavour: ONE Slurm task per node runs torchrun, which starts
# one rank per GPU on its node. The ranks meet at a c10d rendezvous on the first node.
#
#   sbatch --nodes=2 slurm/train-torchrun.sh train.py --lr 3e-4     # your script
#   sbatch --nodes=2 slurm/train-torchrun.sh -m mypkg.train          # your module
#   sbatch slurm/train-torchrun.sh                                   # the built-in trainer
#   sbatch --nodes=2 slurm/train-torchrun.sh configs/x.yaml train.epochs=5
#
#SBATCH --job-name=hpc-ddp-torchrun
# Nodes to spread the job over (torchrun's --nnodes is read from Slurm, never written twice).
#SBATCH --nodes=1
# One torchrun agent per node.
#SBATCH --ntasks-per-node=1
# GPUs per node: torchrun starts one rank for each.
#SBATCH --gpus-per-node=2
# CPU cores for the whole node's ranks.
#SBATCH --cpus-per-task=2
# Wall-clock limit (HH:MM:SS).
#SBATCH --time=01:00:00
# The job's log, <job name>-<job id>.out, where sbatch was called (see slurm/train.sh).
#SBATCH --output=%x-%j.out
#SBATCH --error=%x-%j.out
#SBATCH --open-mode=append
# SIGUSR1 to the tasks 120 s before the time limit.
#SBATCH --signal=USR1@120
#SBATCH --requeue

set -euo pipefail

# The warning signal of the --signal directive above: the ranks check that it is the one they
# handle (preempt.signal) and refuse to start if not. `hpc-ddp render` writes both; if you pass
# --signal to sbatch, also pass --export=ALL,HPC_DDP_JOB_SIGNAL=<that signal>.
export HPC_DDP_JOB_SIGNAL=${HPC_DDP_JOB_SIGNAL:-USR1}

# The program when the command line gives none: as in slurm/train.sh.
DEFAULT_ARGS=(configs/digits.yaml)

# Where NCCL's flight-recorder dumps go, beside the job's log (`hpc-ddp render` writes both).
HPC_DDP_LOG_DIR=${HPC_DDP_LOG_DIR:-$PWD}

site_file=${HPC_DDP_SITE:-slurm/site.sh}
if [[ -f $site_file ]]; then
    # shellcheck source=/dev/null
    source "$site_file"
fi

# The part both job templates share (NCCL's flight recorder, the program every rank runs),
# from the installed hpc_ddp: this script runs from Slurm's spool, away from any checkout.
python=${PYTHON:-python}
if ! body=$("$python" -m hpc_ddp.launch.templates); then
    echo "error: $python cannot import hpc_ddp. HINT: activate its environment in" \
        "slurm/site.sh (or \$HPC_DDP_SITE), or set PYTHON to its python" >&2
    exit 2
fi
# shellcheck source=/dev/null
source "$body"

head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
# The same job-id-derived port every hpc_ddp launch uses (range 10000-29999).
rendezvous_port=$("$python" -m hpc_ddp port)
# Ranks per node: the GPUs Slurm gave this node, or $NPROC_PER_NODE on CPU-only nodes.
ranks_per_node=${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-1}}
threads=$(( ${SLURM_CPUS_PER_TASK:-1} / ranks_per_node ))
export OMP_NUM_THREADS=$(( threads > 0 ? threads : 1 ))

# Slurm signals every process of the step, torchrun included, and torchrun dies of any signal
# it does not handle: the warning signal would end the agents while the ranks checkpoint. Let
# torchrun handle USR1/USR2 too (torch >= 2.9 reads these; older torch ignores them) and give
# the ranks time to finish their checkpoint before it kills them.
export PET_SIGNALS_TO_HANDLE=${PET_SIGNALS_TO_HANDLE:-SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2}
export PET_SHUTDOWN_TIMEOUT=${PET_SHUTDOWN_TIMEOUT:-100}
# A worker that dies (a crash, kill -9, a lost GPU) does not end the job: torchrun's agents
# restart every worker in this allocation, up to this many times, and they resume from the
# newest checkpoint. Past it the step fails (--kill-on-bad-exit); where the last round's
# worker was lost to its host (see below), that host is left out and the job requeued.
max_restarts=${TORCHRUN_MAX_RESTARTS:-3}
# Each round of workers meets in a store of its own, at a port the agents agree on. With the
# agents' shared store, the workers' keys are told apart by each agent's own restart count,
# and an agent whose workers did not fail does not count the restart: on several nodes the
# rounds' keys would then differ between nodes.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}

echo "job ${queue_job} on ${SLURM_JOB_NODELIST}: torchrun on ${SLURM_JOB_NUM_NODES} node(s) x ${ranks_per_node} ranks, rendezvous ${head_node}:${rendezvous_port}"
# When torchrun's restarts run out on a worker lost to its host (a signal it did not ask for,
# or its device failed), that host is left out of the job, which is requeued to go on from
# its last checkpoint (preempt.max_node_failures), as slurm/train.sh does. Rank 0 says where
# the run keeps its record in the file below: beside the job's log, since under torchrun
# rank 0 may run on any node of the job, not only on this one.
export HPC_DDP_STEP_HANDOFF=${HPC_DDP_LOG_DIR}/.hpc-ddp-step-${SLURM_JOB_ID}-${SLURM_RESTART_COUNT:-0}.json
trap 'rm -f -- "${HPC_DDP_STEP_HANDOFF:-}"' EXIT  # also when a preemption's requeue ends it
log_from=$(stat -L -c %s "/proc/$$/fd/2" 2>/dev/null || echo 0)
status=0
# --label: each line of the log starts with its node's task number (see train.sh).
srun --kill-on-bad-exit=1 --label "$python" -m torch.distributed.run \
    --nnodes="$SLURM_JOB_NUM_NODES" \
    --nproc-per-node="$ranks_per_node" \
    --max-restarts="$max_restarts" \
    --rdzv-backend=c10d \
    --rdzv-endpoint="${head_node}:${rendezvous_port}" \
    --rdzv-id="$SLURM_JOB_ID" \
    "${program[@]}" || status=$?
if ((status != 0)); then
    trap '' TERM  # as in slurm/train.sh: the requeue's SIGTERM must not stop the answer
    answered=0
    HPC_DDP_ONE_TASK_PER_NODE=1 "$python" -m hpc_ddp.launch.step_failure "$status" "$log_from" ||
        answered=$?
    status=$answered
fi
exit "$status"
