# The part every hpc_ddp job template shares, sourced by train.sh and train-torchrun.sh after
# their settings (DEFAULT_ARGS, HPC_DDP_LOG_DIR) and the site file; `python -m
# hpc_ddp.launch.templates` prints where the installed copy is. It sets `args` (the
# program's arguments), `program` (what follows python on every rank), `blocked_until_held`
# (what srun starts python with) and `queue_job` (the job, for the log's first line).

# NCCL's flight recorder: the last collectives of every rank, dumped when a collective times
# out, to $HPC_DDP_LOG_DIR/nccl-trace-<job id>-rank-<rank>; `torchfrtrace` on that folder
# names the rank that stalled. Costs a ring buffer of 2000 entries per process group. Set 0 to turn it
# off. Only the TORCH_FR_* names: the older TORCH_NCCL_* ones make every rank print a
# deprecation warning, a line per rank in the job's log.
export TORCH_FR_BUFFER_SIZE=${TORCH_FR_BUFFER_SIZE:-2000}
export TORCH_NCCL_DUMP_ON_TIMEOUT=${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}
export TORCH_FR_DUMP_TEMP_FILE=${TORCH_FR_DUMP_TEMP_FILE:-$HPC_DDP_LOG_DIR/nccl-trace-${SLURM_JOB_ID:-0}-rank-}

# The program: the job's own arguments, else DEFAULT_ARGS (overrides alone go after them).
# One rule with hpc-ddp's own (hpc_ddp.launch.program.is_setting): a first word is a setting
# when it reads section.key=value and no file or folder of that name exists.
is_setting() { [[ $1 =~ ^[A-Za-z_][A-Za-z0-9_]*\.[A-Za-z_][A-Za-z0-9_]*= && ! -e $1 ]]; }
args=("$@")
if ((${#args[@]} == 0)) || is_setting "${args[0]}"; then
    args=("${DEFAULT_ARGS[@]}" "${args[@]}")
fi
# A .yaml first: the built-in trainer with that config and overrides. Anything else is your
# own program, run by hpc_ddp on every rank (signals held from the start, exit codes).
if [[ ${args[0]} == *.yaml || ${args[0]} == *.yml ]]; then
    program=(-m hpc_ddp.train --config "${args[@]}")
else
    program=(-m hpc_ddp run "${args[@]}")
fi

# A stop signal that reaches a rank before Python runs its first line (a requeued attempt
# that scancel's retried signal meets at once) would end it on the spot: no checkpoint, no
# requeue. So each rank starts with the stop signals blocked, pending rather than lost, and
# its first line unblocks them once it holds them. `env --block-signal` is coreutils 8.31 or
# later; where it is older, plain `env` starts python as before.
blocked_until_held=(env)
if env --block-signal=USR1 true 2>/dev/null; then
    blocked_until_held=(env --block-signal=USR1,USR2,TERM,HUP,ALRM)
fi

# The job as squeue names it: an array task's <array id>_<task id> (its SLURM_JOB_ID is a
# number of its own).
queue_job="${SLURM_JOB_ID}"
if [[ -n "${SLURM_ARRAY_JOB_ID:-}" && -n "${SLURM_ARRAY_TASK_ID:-}" ]]; then
    queue_job="${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID} (id ${SLURM_JOB_ID})"
fi
