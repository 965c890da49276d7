"""The bad inputs the toolkit is tried with, each with the answer it must give: the exit code
and a piece of its one-line message (with a HINT, never a traceback from the toolkit).

tests/test_bad_inputs.py runs every case; docs/reliability.md shows them as a table, kept
equal to :func:`table` (regenerate with ``python -m tests.bad_inputs > docs/reliability.md``).

Kinds: ``cli`` is `hpc-ddp ARGS`; ``train`` is `python -m hpc_ddp.train --dry-run ARGS` with
the given launcher environment (the dry run resolves the launch, builds the data and puts one
sample through the model, without a process group); ``yaml`` is the built-in trainer with a
config file holding ``text``; ``script`` is a user's script of one rank (plain python) whose
lines after ``import torch, hpc_ddp`` are ``text``, and ``RUN`` stands for
``run = hpc_ddp.start(tracking={"enabled": False})``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Case:
    kind: str
    args: tuple[str, ...]
    code: int
    says: str
    environ: dict[str, str] = field(default_factory=dict)
    #: yaml: the config file's text.
    text: str = ""

    @property
    def shown(self) -> str:
        if self.kind == "yaml":
            return f"config file: `{self.text.strip()[:60]!r}`".replace("|", "\\|")
        if self.kind == "script":
            return f"script: `{self.text.strip()}`".replace("|", "\\|").replace("\n", "; ")
        prefix = {"cli": "hpc-ddp", "train": "train"}[self.kind]
        env = " ".join(f"{key}={value[:30]}" for key, value in self.environ.items())
        words = "".join(c if c.isprintable() else repr(c)[1:-1] for c in " ".join(self.args))
        if len(words) > 90:
            words = words[:90] + "..."
        return f"`{(env + ' ' if env else '')}{prefix} {words}`".replace("|", "\\|")


def cli(*args: str, code: int = 2, says: str) -> Case:
    return Case("cli", args, code, says)


def train(*args: str, says: str, code: int = 2, environ: dict[str, str] | None = None) -> Case:
    return Case("train", args, code, says, dict(environ or {}))


def yaml_file(text: str, says: str, code: int = 2) -> Case:
    return Case("yaml", (), code, says, text=text)


def sweep_submit(*options: str, says: str) -> Case:
    """`hpc-ddp sweep submit --name s OPTIONS -- tests/programs/regression.py`."""
    return cli("sweep", "submit", "--name", "s", *options, "--", "tests/programs/regression.py",
               says=says)  # fmt: skip


def script(text: str, says: str, code: int = 2) -> Case:
    return Case("script", (), code, says, text=text)


#: 400 bytes of YAML that stand for 9**9 values through aliases.
ALIAS_BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{name}: &{name} [{', '.join([f'*{previous}'] * 9)}]\n"
    for previous, name in zip("abcdefgh", "bcdefghi", strict=True)
)

#: A start with dist.strategy=fsdp, to which a case adds its own arguments and ``)``.
FSDP_RUN = 'run = hpc_ddp.start(tracking={"enabled": False}, dist={"strategy": "fsdp"}'
#: What ``RUN`` stands for in a script case.
RUN = 'run = hpc_ddp.start(tracking={"enabled": False})'


SYNTHETIC = ("--config", "configs/synthetic.yaml")
TORCHRUN = {
    "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "x",
}  # fmt: skip
SLURM_STEP = {
    "SLURM_JOB_ID": "77", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "2",
    "SLURM_NNODES": "1", "SLURM_NODEID": "0", "SLURM_STEP_NODELIST": "n1",
    "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_TASKS_PER_NODE": "2",
    "SLURM_JOB_NODELIST": "n1", "SLURM_STEP_ID": "0",
}  # fmt: skip


def _override_cases() -> list[Case]:
    """A bad value for each checked setting of the built-in trainer."""
    values = {
        "run.seed=-1": "run.seed=-1 is invalid",
        "run.seed=99999999999999999999999": "within a 64-bit integer",
        "run.id=../../escaped": "run.id",
        "run.name=a/b": "run.name",
        "run.output_dir=": "run.output_dir='' is invalid: expected a folder",
        "run.output_dir=~/runs": "starts with '~', which no shell expands",
        "train.epochs=017": "train.epochs: got '017' (str), expected int",
        "train.epochs=4:16": "train.epochs: got '4:16' (str), expected int",
        "data.batch_size=0x10": "data.batch_size: got '0x10' (str)",
        "data.batch_size=1_000": "data.batch_size: got '1_000' (str)",
        "tracking.enabled=yes": "tracking.enabled: got 'yes' (str), expected bool",
        "data.kind=imagenet": "data.kind",
        "data.kind=parquet": "data.train_path",
        "data.kind=custom": "data.kind=custom needs data.factory",
        "data.batch_size=0": "data.batch_size",
        "data.batch_size=-5": "data.batch_size",
        "data.batch_size=lots": "data.batch_size",
        "data.val_fraction=1.5": "data.val_fraction",
        "data.val_fraction=0": "data.val_fraction",
        "data.num_samples=0": "data.num_samples",
        "data.num_samples=99999999999999999999999": "within a 64-bit integer",
        "data.num_val_samples=0": "data.num_val_samples",
        "data.num_features=0": "data.num_features",
        "data.num_classes=1": "data.num_classes",
        "data.num_workers=-1": "data.num_workers",
        "data.num_workers=many": "data.num_workers",
        "data.factory=nocolon": "is set but data.kind=synthetic: it would be ignored",
        "model.factory=x:y": "is set but model.kind=mlp: it would be ignored",
        "model.kind=transformer": "model.kind",
        "model.kind=custom": "model.kind=custom needs model.factory",
        "model.hidden_sizes=[0]": "model.hidden_sizes",
        "model.hidden_sizes=wide": "model.hidden_sizes",
        "model.dropout=1": "model.dropout",
        "model.dropout=-0.1": "model.dropout",
        "optim.name=adam": "optim.name",
        "optim.lr=0": "optim.lr",
        "optim.lr=-1": "optim.lr",
        "optim.lr=.inf": "optim.lr",
        "optim.lr=.nan": "optim.lr",
        "optim.momentum=-1": "optim.momentum",
        "optim.momentum=1": "optim.momentum",
        "optim.weight_decay=-1": "optim.weight_decay",
        "optim.schedule=exp": "optim.schedule",
        "optim.warmup_steps=-1": "optim.warmup_steps",
        "optim.grad_clip_norm=0": "optim.grad_clip_norm",
        "train.epochs=0": "train.epochs",
        "train.epochs=1.5": "train.epochs",
        "train.grad_accum_steps=0": "train.grad_accum_steps",
        "train.precision=fp8": "train.precision",
        "train.log_interval=0": "train.log_interval",
        "train.max_steps=0": "train.max_steps",
        "train.train_accuracy=maybe": "train.train_accuracy",
        "dist.backend=mpi": "dist.backend",
        "dist.backend=nccl": "dist.backend=nccl",
        "dist.device=tpu": "dist.device",
        "dist.init_timeout_s=0": "dist.init_timeout_s",
        "dist.timeout_s=-1": "dist.timeout_s",
        "dist.stall_timeout_s=0": "dist.stall_timeout_s",
        "dist.master_port=0": "dist.master_port",
        "dist.master_port=70000": "dist.master_port",
        "checkpoint.every_steps=0": "checkpoint.every_steps",
        "checkpoint.every_minutes=0": "checkpoint.every_minutes",
        "checkpoint.keep_last=0": "checkpoint.keep_last",
        "checkpoint.enabled=perhaps": "checkpoint.enabled",
        "checkpoint.save_mode=fast": "checkpoint.save_mode",
        "dist.strategy=zero3": "dist.strategy",
        "dist.shard_blocks=layers": "dist.shard_blocks",
        "dist.mixed_precision=fp8": "dist.mixed_precision",
        "preempt.warning_s=0": "preempt.warning_s",
        "preempt.signal=KILL": "preempt.signal",
        "preempt.max_requeues=-1": "preempt.max_requeues",
        "preempt.check_every_steps=0": "preempt.check_every_steps",
        "preempt.requeue_timeout_s=0": "preempt.requeue_timeout_s",
        "tracking.enabled=sometimes": "tracking.enabled",
        "checks.min_free_gpu_memory=2": "checks.min_free_gpu_memory",
        "checks.timeout_s=0": "checks.timeout_s",
        "checks.min_allreduce_gbps=0": "checks.min_allreduce_gbps",
        "train.epochz=3": "unknown key 'train.epochz'",
        "nosection.key=1": "nosection",
        "train.epochs": "train.epochs",
        "=3": "=3",
        "train=3": "train",
    }
    extra = {
        "dist.backend=nccl": ("dist.device=cpu",),
        "data.kind=custom": (),
    }
    return [
        train(*SYNTHETIC, override, *extra.get(override, ()), says=message)
        for override, message in values.items()
    ]


CASES: list[Case] = [
    # -- the command line --------------------------------------------------------------------
    cli("local", "--nproc", "0", "x.py", says="--nproc: 0 is too small: at least 1"),
    cli("local", "--nproc", "two", "x.py", says="--nproc: 'two' is not a whole number"),
    cli("local", "--nproc", "2", "missing.py", says="script 'missing.py' does not exist"),
    cli(
        "local",
        "--nproc",
        "2",
        "tests/programs/broken_script",
        says="tests/programs/broken_script, line 2: invalid syntax",
    ),
    cli("local", "-m", "no_such_pkg.train", says="module 'no_such_pkg.train' cannot be found"),
    cli("local", "-m", "json", says="module 'json' is a package without a __main__ module"),
    cli("local", "--config", "missing.yaml", says="missing.yaml"),
    cli("local", "--dry-run", "tests/programs/faults.py", says="--dry-run applies to the built-in"),
    cli("run", "--config", "configs/digits.yaml", says="hpc-ddp run starts your own script"),
    cli(
        "doctor",
        "--json-dir",
        "/proc/no-such-folder",
        "--config",
        "configs/synthetic.yaml",
        says="cannot write doctor-rank-0.json there",
    ),
    cli("render", "--nodes", "0", says="--nodes: 0 is too small: at least 1"),
    cli("render", "--gpus-per-node", "-1", says="--gpus-per-node"),
    cli("render", "--tasks-per-node", "0", says="--tasks-per-node: 0 is too small"),
    cli("render", "--cpus-per-task", "-3", says="--cpus-per-task: -3 is too small"),
    cli("render", "--time", "x", says="time='x' is not accepted"),
    cli(
        "render",
        "--slurm",
        "time=10",
        "--config",
        "configs/synthetic.yaml",
        says="--slurm time=10: --time is set from hpc-ddp's own options",
    ),
    cli(
        "render",
        "--slurm",
        "qos=a\nb",
        "--config",
        "configs/synthetic.yaml",
        says="holds a line break, NUL or backslash",
    ),
    cli("render", "--time", "0", says="time='0' is not accepted"),
    cli("render", "--time", "25:99:99:99", says="is not accepted"),
    cli("render", "--partition", "gpu;rm -rf /", says="partition='gpu;rm -rf /' is not accepted"),
    cli("render", "--job-name", "a b", says="job name='a b' is not accepted"),
    cli("render", "--launcher", "mpirun", says="invalid choice: 'mpirun'"),
    cli("render", "--signal", "KILL", says="invalid choice: 'KILL'"),
    cli("render", "--signal", "USR1", "preempt.signal=USR2", says="--signal USR1 but the config"),
    cli("render", "-o", "/nonexistent/dir/job.sh", says="the directory /nonexistent/dir does not"),
    cli("render", "train.epochz=1", says="unknown key 'train.epochz'"),
    cli(
        "local",
        "--set",
        "checkpoint.evry_steps=5",
        "tests/programs/regression.py",
        says="--set 'checkpoint.evry_steps=5': unknown key 'checkpoint.evry_steps' (did you mean "
        "'checkpoint.every_steps'?)",
    ),
    cli(
        "local",
        "--set",
        "checkpoint.every_steps=five",
        "tests/programs/regression.py",
        says="--set 'checkpoint.every_steps=five': checkpoint.every_steps: got 'five' (str)",
    ),
    cli(
        "local",
        "--set",
        "train.epochz=3",
        "--config",
        "configs/digits.yaml",
        says="--set 'train.epochz=3': unknown key 'train.epochz' (did you mean 'train.epochs'?)",
    ),
    cli(
        "check-resume",
        "--set",
        "chekpoint.every_steps=1",
        "tests/programs/regression.py",
        says="--set 'chekpoint.every_steps=1': unknown section 'chekpoint' (did you mean "
        "'checkpoint'?)",
    ),
    cli(
        "check-resume",
        "--epochs",
        "3",
        "tests/programs/regression.py",
        says="HINT: hpc-ddp's options go before the program and the program's own after it",
    ),
    cli(
        "local",
        "--nprocs",
        "2",
        "tests/programs/regression.py",
        says="HINT: hpc-ddp local has --nproc, not --nprocs",
    ),
    cli("render", "missing.py", says="script 'missing.py' does not exist"),
    cli(
        "render",
        "-o",
        "/tmp",
        "tests/programs/regression.py",
        says="cannot write /tmp: it is a directory",
    ),
    cli(
        "render",
        "-o",
        "/proc/version",
        "tests/programs/regression.py",
        says="cannot write /proc/version",
    ),
    cli("render", "$(touch PWNED).py", says="does not exist"),
    cli("submit", "--nodes", "0", says="--nodes: 0 is too small: at least 1"),
    cli("submit", "--tasks-per-node", "0", says="--tasks-per-node: 0 is too small"),
    cli("submit", "--cluster", "aws", says="invalid choice: 'aws'"),
    cli("submit", "--cluster", "local", "missing.py", says="script 'missing.py' does not exist"),
    cli(
        "submit",
        "--cluster",
        "local",
        "--gpus-per-node",
        "2",
        "tests/programs/regression.py",
        says="gpus_per_node=2 on submitit's 'local' executor",
    ),
    cli("port", "--job-id", "abc", says="unrecognized arguments: --job-id abc"),
    cli("sweep", "submit", "missing.yaml", "--", "train.py", says="sweep file 'missing.yaml'"),
    cli("sweep", "submit", "--grid", "lr=1,2", "--", "train.py", says="the sweep has no name"),
    cli("sweep", "submit", "--name", "s", "--", "missing.py", says="script 'missing.py' does"),
    cli("sweep", "submit", "--name", "s", "--grid", "lr=", "--", "x.py", says="is not KEY=V1"),
    sweep_submit("--grid", "optim.lr=1,2", says="not a setting of hpc_ddp"),
    cli("sweep", "submit", "--name", "s", says="no program: the sweep needs"),
    cli("sweep", "status", "/nonexistent/sweep", says="holds no sweep"),
    sweep_submit(
        "--grid",
        "lr=1,2",
        "--output-dir",
        "/nonexistent/a b",
        says="cannot be named in an #SBATCH line",
    ),
    cli("sweep", "resume", "/nonexistent/sweep", "--set", "lr=1\n2", says="holds a line break"),
    sweep_submit("--grid", "lr=1,1", says="grid.--lr: '1' listed more than once"),
    sweep_submit(
        "--grid", "preempt.signal=USR1,USR2", says="preempt.signal goes into the one job script"
    ),
    cli("sweep", "resume", "/nonexistent/sweep", says="holds no sweep"),
    cli("data", "make", "--rows", "0", "--out", "/tmp/x", says="--rows: 0 is too small"),
    cli("data", "make", "--rows", "10", "--features", "0", "--out", "/tmp/x", says="--features"),
    cli("data", "make", "--rows", "10", "--classes", "0", "--out", "/tmp/x", says="--classes"),
    cli("data", "make", "--rows", "10", "--kind", "mnist", "--out", "/x", says="invalid choice"),
    cli("data", "make", "--rows", "10", "--out", "/etc/hostname/x", says="/etc/hostname"),
    cli("data", "make", "--rows", "10", says="the following arguments are required: --out"),
    cli("data", says="the following arguments are required: COMMAND"),
    cli("runs", "/nonexistent/runs", says="no such directory: /nonexistent/runs"),
    cli("plot", "nothing/here", "--output-dir", "/nonexistent", says="no run 'nothing/here'"),
    cli("tracking", "sync", "nothing/here", "--output-dir", "/nonexistent", says="no run"),
    cli("frobnicate", says="invalid choice: 'frobnicate'"),
    cli(says="the following arguments are required: COMMAND"),
    cli("--version", code=0, says="hpc-ddp "),
    # -- the launcher's environment ----------------------------------------------------------
    train(*SYNTHETIC, says="MASTER_PORT", environ={**TORCHRUN, "MASTER_PORT": "99999"}),
    train(*SYNTHETIC, says="MASTER_PORT", environ={**TORCHRUN, "MASTER_PORT": "http"}),
    train(*SYNTHETIC, says="LOCAL_WORLD_SIZE", environ={**TORCHRUN, "LOCAL_WORLD_SIZE": "0"}),
    train(*SYNTHETIC, says="RANK", environ={**TORCHRUN, "RANK": "2"}),
    train(*SYNTHETIC, says="RANK", environ={**TORCHRUN, "RANK": "-1"}),
    train(*SYNTHETIC, says="WORLD_SIZE", environ={**TORCHRUN, "WORLD_SIZE": "0"}),
    train(*SYNTHETIC, says="LOCAL_RANK", environ={**TORCHRUN, "LOCAL_RANK": "5"}),
    train(
        *SYNTHETIC,
        says="n[0-99999999]",
        environ={**SLURM_STEP, "SLURM_STEP_NODELIST": "n[0-99999999]"},
    ),
    train(*SYNTHETIC, says="n[3-1]", environ={**SLURM_STEP, "SLURM_STEP_NODELIST": "n[3-1]"}),
    train(*SYNTHETIC, says="SLURM_PROCID", environ={**SLURM_STEP, "SLURM_PROCID": "9"}),
    train(*SYNTHETIC, says="warning signal", environ={"HPC_DDP_JOB_SIGNAL": "USR2"}),
    train(
        *SYNTHETIC,
        says="WORLD_SIZE=2 (RANK=1) is set, but no launcher",
        environ={"RANK": "1", "WORLD_SIZE": "2"},
    ),
    train(
        *SYNTHETIC,
        says="GLOO_SOCKET_IFNAME=nope0 names no network interface",
        environ={"GLOO_SOCKET_IFNAME": "nope0"},
    ),
    train(*SYNTHETIC, "data.batch_size=7", says="data.batch_size=7", environ=TORCHRUN),
    train(*SYNTHETIC, "train.grad_accum_steps=3", says="train.grad_accum_steps", environ=TORCHRUN),
    train(*SYNTHETIC, "run.output_dir=/etc/hostname", says="/etc/hostname is not a directory"),
    train(*SYNTHETIC, "data.kind=custom", "data.factory=nocolon", says="is not an import path"),
    train(
        *SYNTHETIC,
        "data.kind=custom",
        "data.factory=tests.factories:strings_dataset",
        says="returned str as train_dataset",
    ),
    train(
        *SYNTHETIC,
        "data.kind=custom",
        "data.factory=tests.factories:dataset_without_seed",
        says="cannot be called the way the trainer calls it",
    ),
    train(
        *SYNTHETIC,
        "data.kind=custom",
        "data.factory=no_such_module:build",
        says="cannot import module 'no_such_module'",
    ),
    train(
        *SYNTHETIC,
        "data.kind=custom",
        "data.factory=tests.factories:nothing",
        says="has no callable 'nothing'",
    ),
    train(
        *SYNTHETIC,
        "model.kind=custom",
        "model.factory=tests.factories:not_a_module",
        says="returned str, not a torch.nn.Module",
    ),
    train(
        *SYNTHETIC,
        "model.kind=custom",
        "model.factory=tests.factories:model_without_classes",
        says="cannot be called the way the trainer calls it",
    ),
    train(
        *SYNTHETIC,
        "model.kind=custom",
        "model.factory=tests.factories:too_narrow_model",
        says="the model cannot take one sample of the data",
    ),
    train(
        *SYNTHETIC,
        "data.kind=parquet",
        "data.train_path=/nonexistent/*.parquet",
        "data.val_path=/nonexistent",
        says="no Parquet files at '/nonexistent/*.parquet'",
    ),
    train(
        *SYNTHETIC,
        "data.kind=parquet",
        "data.train_path=configs/synthetic.yaml",
        "data.val_path=configs/synthetic.yaml",
        says="cannot read Parquet file",
    ),
    train("--config", "missing.yaml", says="missing.yaml"),
    train("--config", "configs", says="configs"),
    train("--config", "README.md", says="README.md"),
    *_override_cases(),
    # -- config files ------------------------------------------------------------------------
    yaml_file("run: 5\n", says="section 'run' is 5, not a mapping of keys"),
    yaml_file("1: a\n", says="section name 1 is a int, not text"),
    yaml_file(
        "train:\n  epochs: 1\ntrain:\n  epochs: 2\n",
        says="config.yaml: key 'train' is written twice (line 3)",
    ),
    yaml_file("train:\n  epochs: 1\n  epochs: 2\n", says="key 'epochs' is written twice"),
    yaml_file("train: [1, 2\n", says="HINT"),
    yaml_file("train:\n\tepochs: 1\n", says="HINT"),
    yaml_file("- a\n- b\n", says="mapping"),
    yaml_file("'just text'\n", says="mapping"),
    yaml_file("train:\n  epochs: !!python/object:os.system x\n", says="HINT"),
    yaml_file("data:\n  batch_size: 1e400\n", says="data.batch_size"),
    yaml_file("model:\n  hidden_sizes: {a: 1}\n", says="model.hidden_sizes"),
    yaml_file("unknown_section:\n  a: 1\n", says="unknown_section"),
    yaml_file(ALIAS_BOMB, says="expands to more than 100,000 values"),
    yaml_file(
        "a:\n" + "".join("  " * depth + "b:\n" for depth in range(1, 3000)),
        says="nested deeper than YAML can be read here",
    ),
    train(
        *SYNTHETIC,
        "optim.lr=" + "[" * 3000 + "]" * 3000,
        says="nested deeper than YAML can be read here",
    ),
    yaml_file(
        "model:\n  hidden_sizes: [[1, 2, 3, 4, 5, 6, 7, 8, 9]]\n", says="got [1, 2, 3, 4, ...]"
    ),
    # -- a user's script: the public API -----------------------------------------------------
    script("hpc_ddp.start(run=5)", says="expected a mapping of run settings or a RunConfig"),
    script(
        "import threading\nfailed = []\ndef main():\n    try:\n        hpc_ddp.start()\n"
        "    except Exception as error:\n        failed.append(error)\n"
        "thread = threading.Thread(target=main)\nthread.start()\nthread.join()\nraise failed[0]",
        says="hpc_ddp.start() called in thread 'Thread-1 (main)': stop signals",
    ),
    script('hpc_ddp.start(dist=["x"])', says="expected a mapping of dist settings"),
    script(
        'hpc_ddp.start(log_interval="10")',
        says="hpc_ddp.start(log_interval)='10': expected a whole",
    ),
    script(
        'hpc_ddp.start(tracking={"enabled": False}, fingerprint={"model": object()})',
        says="fingerprint value 'model' (object) is shown with a memory address",
    ),
    script(f'{RUN}\nlist(run.epochs("3"))', says="run.epochs(num_epochs)='3': expected a whole"),
    script(f"{RUN}\nlist(run.epochs(-1))", says="run.epochs(num_epochs)=-1: expected a whole"),
    script(f"{RUN}\nlist(run.epochs(0))", says="run.epochs(num_epochs)=0: expected a whole"),
    script(f"{RUN}\nlist(run.epochs(2.5))", says="(got type float)"),
    script(f"{RUN}\nlist(run.epochs(2, max_steps=-1))", says="run.epochs(max_steps)=-1"),
    script(f"{RUN}\nlist(run.iterations(-1))", says="run.iterations(max_steps)=-1"),
    script(f"{RUN}\nrun.every(0)", says="run.every(steps)=0"),
    script('hpc_ddp.spawn("main", nprocs=2)', says="the first argument is a str, expected"),
    script("hpc_ddp.spawn(print, args=3, nprocs=2)", says="args is a int, expected a tuple"),
    script("hpc_ddp.spawn(print, nprocs=2, join=False)", says="join=False): the ranks run to"),
    script(
        "def main(): pass\nhpc_ddp.spawn(main, nprocs=2)",
        says="each rank calls main(rank, *args), which does not fit its parameters",
    ),
    script(f"{RUN}\nlist(run.steps([]))", says="the list gave no batch in epoch 0"),
    script(
        f"{RUN}\nclass Seekable(list):\n    steps_per_epoch = 2\n"
        "    def set_position(self, epoch, step): pass\nlist(run.steps(Seekable([1, 2])))",
        says="with set_position() and steps_per_epoch, but no whole grad_accum_steps",
    ),
    script(
        f"{RUN}\nfor batch in run.steps([1, 2]):\n    list(run.steps([3]))",
        says="run.steps() inside a loop over run.steps() or run.iterations()",
    ),
    script(
        f"{RUN}\nfor step in run.iterations(2):\n    list(run.steps([3]))",
        says="run.steps() inside a loop over run.steps() or run.iterations()",
    ),
    script(
        f"{RUN}\nlist(run.steps([1, 2, 3], grad_accum_steps=4))",
        says="gave no 4 micro-batches (grad_accum_steps) in epoch 0",
    ),
    script(
        f"{RUN}\nbatches = iter([1, 2])\nfor epoch in run.epochs(2):\n"
        "    for batch in run.steps(batches): pass",
        says="the list_iterator gave no batch in epoch 1",
    ),
    script(
        f"{RUN}\nrun.finish()\nfor step in run.iterations(2): pass",
        says="run.steps() after run.finish(): the run has ended",
    ),
    script(f'{RUN}\nrun.wrap("model")', says="run.wrap got a str, not a torch.nn.Module"),
    script(f"{RUN}\nm = torch.nn.Linear(2, 1)\nrun.wrap(m)\nrun.wrap(m)", says="wrapped already"),
    script(f"{RUN}\nrun.wrap(torch.nn.ReLU())", says="no parameter that requires a gradient"),
    script(
        f'{RUN}\nrun.wrap(torch.nn.Sequential(torch.nn.Linear(2, 2, device="meta"), '
        "torch.nn.Linear(2, 1)))",
        says="on the meta device and the others (1.weight, 1.bias) hold data",
    ),
    script(
        f'{RUN}\nrun.wrap(torch.nn.MultiheadAttention(4, 2, device="meta"))',
        says="holds parameters or buffers but no reset_parameters()",
    ),
    script(
        f"{RUN}\nrun.wrap(torch.nn.Linear(2, 1), init_weights=print)",
        says="there is nothing to initialise",
    ),
    script(
        f"{FSDP_RUN}, overrides=['dist.shard_blocks=[head]'])\nrun.wrap(torch.nn.Linear(2, 1))",
        says="dist.shard_blocks names 'head', which is neither a submodule nor a class",
    ),
    script(
        f"{FSDP_RUN})\nmodel = torch.nn.Linear(2, 1)\n"
        "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "run.register(model=run.wrap(model), optimizer=optimizer)",
        says="the optimizer 'optimizer' updates none of the parameters of the sharded model",
    ),
    script(
        f"{FSDP_RUN})\nrun.wrap(torch.nn.Linear(2, 1), find_unused_parameters=True)",
        says="DistributedDataParallel's options",
    ),
    script(
        f"{FSDP_RUN}, checkpoint={{'save_mode': 'single_file'}})\nrun.wrap(torch.nn.Linear(2, 1))",
        says="one rank cannot write a sharded model's state alone",
    ),
    script(
        f"{RUN}\nfrom torch.distributed.fsdp import fully_shard\n"
        "run.wrap(fully_shard(torch.nn.Linear(2, 1)))",
        says="run.wrap(FSDPLinear): the model is sharded already",
    ),
    script(
        "run = hpc_ddp.start(tracking={'enabled': False}, checkpoint={'save_mode': "
        "'single_file'})\nfrom torch.distributed.fsdp import fully_shard\n"
        "run.register(model=fully_shard(torch.nn.Linear(2, 1)))",
        says="run.register(model=...) of sharded state with checkpoint.save_mode=single_file",
    ),
    script(
        f"{RUN}\nrun.train_loader(list(range(10)), batch_size=64)",
        says="fewer than one global batch",
    ),
    script(
        f"{RUN}\nrun.train_loader(list(range(10)), batch_size=2.5)",
        says="run.train_loader(batch_size)=2.5",
    ),
    script(
        f"{RUN}\nrun.train_loader(list(range(10)), batch_size=2, num_workers=-1)",
        says="num_workers=-1",
    ),
    script(
        f'{RUN}\nrun.train_loader(list(range(10)), batch_size=2, num_workers="4")',
        says="num_workers='4'",
    ),
    script(f"{RUN}\nrun.train_loader(iter(range(10)), batch_size=2)", says="without a length"),
    script(
        f"{RUN}\nrun.eval_loader(list(range(10)), batch_size=0)",
        says="run.eval_loader(batch_size)=0",
    ),
    script(f'{RUN}\nrun.log("loss@top1", 1.0, 1)', says="MLflow refuses this name: holds '@'"),
    script(f'{RUN}\nrun.log("loss", "abc", 1)', says="the total is a str"),
    script(f'{RUN}\nrun.log("loss", 1.0, 0)', says="the count must be a number above 0"),
    script(f'{RUN}\nrun.log("loss", 1.0, -4)', says="count=-4"),
    script(f'{RUN}\nrun.log_metrics({{"acc@1": 0.5}})', says="run.log_metrics('acc@1', ...)"),
    script(
        f'{RUN}\nrun.log_metrics({{"acc": 0.5}}, step=1.5)',
        says="step=1.5): the step must be a whole number of 0 or more",
    ),
    script(f'{RUN}\nrun.log_text("../notes.txt", "x")', says="reads as the path"),
    script(
        f"{RUN}\nrun.finish()\nimport os, signal, time\nos.kill(os.getpid(), signal.SIGUSR1)\n"
        'time.sleep(0.5)\nprint("ALIVE after the job signal")',
        code=0,
        says="ALIVE after the job signal",
    ),
    script(
        f"{RUN}\nfor epoch in run.epochs(1):\n    for _ in run.steps(range(4)):\n"
        '        run.log("loss", float("nan"), 1)\nrun.finish()',
        code=0,
        says="loss is nan in the metrics at step 4: training diverged",
    ),
]


#: Faults survived, each with the test that inflicts it for real and what it asserts.
FAULTS: list[tuple[str, str, str]] = [
    ("a node's own health check (checks.command) fails", "every rank ends before the first "
     "step, one line naming the host and the command's output, --exclude hinted, checks.json",
     "test_checks.py::test_a_failing_site_check_ends_every_rank_before_training_naming_the_host"),
    ("checkpoints that cannot fit the run directory's file system", "refused before the first "
     "step with the free space and the estimate", "test_checks.py::test_checkpoints_that_cannot_fit_stop_the_run_before_its_first_step"),
    ("rank killed with kill -9 (Slurm)", "the step ends at once (not after dist.timeout_s) "
     "naming the task; its node is left out (ExcNodeList) and the job requeued; it resumes "
     "from the newest checkpoint on the other nodes, bitwise equal to a run never killed",
     "test_slurm_fault_tolerance.py::test_a_rank_killed_on_one_node_leaves_it_out_and_the_job_resumes_on_the_others"),
    ("an operation with no deterministic kernel under run.deterministic=true", "every rank "
     "ends with torch's error, the user's frames and a HINT, exit code 2", "test_user_script.py::test_run_deterministic_refuses_an_operation_without_a_deterministic_kernel"),
    ("a rank raises in the user's code", "job ends fast naming the rank, the user's frames "
     "shown, MLflow FAILED", "test_user_script.py::test_an_error_in_the_users_code_shows_their_frames_and_the_rank"),
    ("kill -9 during a checkpoint write (folder and single file)", "previous checkpoint kept "
     "and resumed from, the partial write removed", "test_slurm_fault_tolerance.py::test_kill_during_a_checkpoint_write_keeps_the_previous_one"),
    ("kill -9 of every rank during a background save", "the folder without .metadata is no "
     "checkpoint; the rerun resumes from the previous one, bitwise equal", "test_sharded_checkpoints.py::test_a_kill_during_a_background_save_leaves_the_previous_checkpoint"),
    ("a stop signal during a background save", "that save finishes, then the stop's own; both "
     "whole; a save slower than the signal's warning named once", "test_sharded_checkpoints.py::test_a_stop_during_a_background_save_waits_for_it_then_saves"),
    ("a run stopped with an earlier version's single-file checkpoint", "goes on under folder "
     "checkpoints, bitwise equal", "test_sharded_checkpoints.py::test_a_single_file_checkpoint_goes_on_as_a_folder_run"),
    ("an FSDP2 checkpoint of 4 ranks resumed on 2 and on 3; DDP's under FSDP2 and back",
     "model and optimizer reshard; weights as an uninterrupted run's", "test_fsdp.py::test_an_fsdp_checkpoint_of_4_ranks_goes_on_at_2_and_at_3"),
    ("disk full while checkpointing (tmpfs)", "previous checkpoint loadable, no partial file, "
     "one line with path and free space", "test_fault_tolerance.py::test_a_full_disk_keeps_the_previous_checkpoint_and_names_the_path"),
    ("preemption signal (USR1) mid-epoch", "checkpoint, requeue, bitwise-equal weights, one "
     "MLflow run", "test_slurm_fault_tolerance.py::test_preemption_requeues_resumes_exactly_in_one_mlflow_run"),
    ("preemption with preempt.signal=USR2", "rendered --signal=USR2, stop, requeue, "
     "completed", "test_slurm_fault_tolerance.py::test_a_script_rendered_for_usr2_stops_on_usr2_and_requeues"),
    ("job signal the ranks do not handle", "refused at start with a HINT",
     "test_slurm_fault_tolerance.py::test_a_job_whose_warning_signal_the_ranks_do_not_handle_fails_at_start"),
    ("time limit reached", "checkpoint on the warning signal; a resubmission resumes",
     "test_slurm_fault_tolerance.py::test_time_limit_signal_checkpoints_and_a_resubmission_resumes"),
    ("corrupt newest checkpoint", "reported, moved to checkpoints/unreadable/, the previous "
     "one used", "test_fault_tolerance.py::test_corrupt_newest_checkpoint_falls_back_with_a_warning"),
    ("a folder checkpoint's shard truncated, missing, one bit flipped or taken from another "
     "checkpoint", "named (size or SHA-256), moved to checkpoints/unreadable/, the previous one "
     "used", "test_loop_parts.py::test_a_folder_whose_files_do_not_match_its_metadata_is_set_aside_for_the_one_before"),
    ("`hpc-ddp export` while the run saves and prunes the checkpoint it chose", "the newest "
     "one then is read; with --step, one line; a pruned folder is never seen half removed",
     "test_loop_parts.py::test_an_export_reads_the_newest_when_the_run_prunes_the_one_it_chose"),
    ("50 USR1 per rank during a stopped run's exit, or after a finished run's last checkpoint",
     "the stop stays exit 3 and the end exit 0, no rank blamed",
     "test_fault_tolerance.py::test_a_burst_of_warning_signals_while_a_run_exits_changes_nothing"),
    ("a run directory one rank does not see (each node's own disk)", "every rank ends with "
     "one line naming the rank and host, before any checkpoint is split between hosts",
     "test_rundir.py::test_a_run_directory_one_rank_does_not_see_is_refused_before_any_checkpoint"),
    ("`hpc-ddp local` from a working directory that was removed", "one line and exit 2 "
     "before any rank starts", "test_rundir.py::test_a_launch_from_a_removed_working_directory_is_one_line"),
    ("`hpc-ddp tracking sync --uri` of an unknown scheme or a SQLite file that is no database",
     "one line naming the store, exit 2",
     "test_view.py::test_tracking_sync_into_a_store_that_cannot_open_is_one_line"),
    ("`hpc-ddp plot -o` with an extension matplotlib cannot write, none, or a directory",
     "one line listing the extensions, nothing written",
     "test_view.py::test_a_plot_to_a_file_matplotlib_cannot_write_is_one_line"),
    ("a full disk under the run directory when its lock is written (tmpfs)", "one line "
     "naming the lock file, the lock let go",
     "test_rundir.py::test_a_full_disk_at_the_run_directory_lock_is_one_line"),
    ("`hpc-ddp sweep status` of a sweep.json with an empty task, text where a list goes, an "
     "unknown state or a task out of place", "one line naming the field, exit 2",
     "test_sweeps.py::test_sweep_status_of_a_damaged_record_is_one_line_naming_the_field"),
    ("sbatch refuses the second of a sweep's three arrays (a limit on queued jobs)", "one "
     "line naming the tasks queued and those not, and the resume that submits the rest",
     "test_sweeps.py::test_sbatch_refusing_a_later_array_says_which_tasks_are_queued_and_how_to_submit_the_rest"),
    ("a sweep's task state file or array line torn or naming a task the sweep lacks", "one "
     "line naming the file; the record itself never rewritten as tasks run",
     "test_sweeps.py::test_what_tasks_do_is_kept_beside_the_record_which_stays_as_submitted"),
    ("a USR1 in a finished rank's last moment, as the interpreter finalizes", "ignored by the "
     "kernel (SIG_IGN at exit), not exit 138; `hpc-ddp local` too", "test_fault_tolerance.py::test_the_warning_signal_stays_ignored_while_the_interpreter_exits"),
    ("the only checkpoint empty, garbage, truncated or of a newer format", "refused in one "
     "line, the file untouched", "test_fault_tolerance.py::test_a_run_whose_only_checkpoint_cannot_be_read_is_refused_and_the_file_kept"),
    ("the same, on real ranks; then checkpoint.start_fresh_if_unreadable=true", "every rank "
     "refuses, exit 2; then step 0 with the file moved aside, never overwritten",
     "test_fault_tolerance.py::test_an_unreadable_checkpoint_stops_every_rank_and_a_fresh_start_keeps_it"),
    ("a damaged checkpoint numbered above the run's steps, keep_last=1", "the checkpoint "
     "just written is kept", "test_fault_tolerance.py::test_pruning_never_removes_the_checkpoint_just_written"),
    ("<run dir>/checkpoints a regular file or a link loop", "refused at the start in one line",
     "test_fault_tolerance.py::test_a_checkpoints_path_that_cannot_hold_them_is_refused_at_the_start"),
    ("summary.json refused by the file system at the run's end", "one warning, exit 0, the "
     "run recorded finished with its checkpoint", "test_fault_tolerance.py::test_a_summary_that_cannot_be_written_leaves_the_run_finished"),
    ("a child the user's code forks exits", "the parent's run (and its MLflow run) is not "
     "ended by it", "test_loop_parts.py::test_a_forked_child_does_not_hold_the_parents_run"),
    ("a metric name MLflow refuses reaches the tracker", "that call dropped with one "
     "warning, tracking and the run's end go on", "test_tracking_guard.py::test_a_call_mlflow_refuses_is_dropped_and_tracking_goes_on"),
    ("a damaged value in a run's status.json", "hpc-ddp runs names that file in one line "
     "and lists every other run", "test_view.py::test_a_damaged_record_is_one_line_and_every_other_run_still_lists"),
    ("damaged lines in metrics.jsonl", "left out of runs, plot and sync",
     "test_view.py::test_damaged_lines_of_metrics_jsonl_are_left_out_of_runs_plot_and_sync"),
    ("rendezvous port in use", "one line naming the port, exit 2",
     "test_training.py::test_rendezvous_port_in_use_is_reported"),
    ("a second process reaches for a local run's store", "answered on 127.0.0.1 only, "
     "refused at another address of the host", "test_training.py::test_a_local_runs_store_listens_on_loopback_only"),
    ("ranks whose datasets give different steps per epoch", "refused on every rank naming each "
     "count, no hang", "test_any_loop.py::test_ranks_with_datasets_of_different_lengths_are_refused_not_left_waiting"),
    ("rank 0 never starts", "the others give up in init_timeout_s, one line each",
     "test_training.py::test_a_rank_without_rank_0_gives_up_in_one_line"),
    ("tracking server down at start", "one warning, training and its record whole; sync "
     "later adds every point once", "test_tracking_outage.py::test_a_tracking_server_that_is_down_costs_one_warning_and_nothing_else"),
    ("tracking server killed mid-run", "one warning, exit 0, record whole; sync completes the "
     "same MLflow run", "test_tracking_outage.py::test_an_mlflow_server_killed_mid_run_leaves_training_and_its_record_whole"),
    ("tracking server down for a stopped attempt, up for the next", "the next attempt's MLflow "
     "run holds both attempts' points, each once, and counts 2 attempts",
     "test_tracking_outage.py::test_the_attempt_after_one_whose_mlflow_was_down_puts_its_points_in_mlflow"),
    ("stalled rank (sleeping in user code)", "job ends at the stall (not after dist.timeout_s), "
     "the frame in the log, exit 5; the rank waiting for it inside torch exits 4; "
     "`hpc-ddp runs NAME/ID` names the stalled rank and its line", "test_watchdog.py::test_a_rank_sleeping_in_the_users_code_ends_the_job_and_shows_the_frame"),
    ("one rank killed with kill -9 (hpc-ddp local)", "`hpc-ddp runs NAME/ID` names it as "
     "the rank that left no line, before the rank that lost it",
     "test_view.py::test_runs_names_what_ended_a_failed_attempt"),
    ("hung DataLoader worker", "named as such, job ends, worker killed",
     "test_watchdog.py::test_a_hung_dataloader_worker_is_named"),
    ("one rank stopped with SIGSTOP (rank 1, or rank 0 holding the store)", "the waiting "
     "rank's stall report names it (or says the store does not answer), exit 4",
     "test_watchdog.py::test_a_stall_report_names_the_rank_that_stopped_answering"),
    ("4 concurrent runs on one fresh MLflow store", "every run gets its MLflow run",
     "test_tracking_outage.py::test_runs_that_open_a_new_sqlite_store_at_once_all_get_their_mlflow_run"),
    ("second live run with the same run.id", "refused naming the first's host and pid",
     "test_rundir.py::test_a_second_live_run_with_the_same_id_is_refused_naming_the_first"),
    ("links planted at a run directory's file names; umask 000", "never written through, "
     "nothing made group- or world-writable; a link at .lock refused in one line",
     "test_rundir.py::test_links_planted_in_a_run_directory_are_never_written_through"),
    ("a run directory owned by another user", "refused in one line",
     "test_rundir.py::test_a_run_directory_of_another_user_is_refused"),
    ("the local launcher killed with kill -9", "its ranks stop as on a preemption",
     "test_fault_tolerance.py::test_ranks_end_when_their_local_launcher_is_killed"),
    ("a rank leaves the loop early (sys.exit(0/3/None), os._exit(0))", "named as the cause, "
     "not the rank that lost contact with it", "test_training.py::test_a_rank_that_leaves_the_loop_early_is_named_as_the_cause"),
    ("a sweep's or job's function that only the submitting script's sys.path reaches",
     "refused before anything is queued, naming the folder and the fix",
     "test_importable.py::test_a_sweep_of_a_function_only_the_submitting_script_can_import_is_refused"),
    ("a process a rank started is left running when the ranks end", "ended with them: "
     "`hpc-ddp local ... | tee` returns", "test_fault_tolerance.py::test_processes_a_rank_started_end_with_the_ranks"),
]  # fmt: skip


def table() -> str:
    """docs/reliability.md: every case and its answer."""
    lines = [
        "# Bad input and faults: what the toolkit answers",
        "",
        "Generated from `tests/bad_inputs.py` (`python -m tests.bad_inputs > "
        "docs/reliability.md`); `tests/test_bad_inputs.py` runs every row and fails when this",
        "page and the cases differ. Every answer is one line (`error: ...` with a `HINT:`), no",
        "traceback, and the exit code shown; `train` is `python -m hpc_ddp.train --dry-run`.",
        "",
        f"{len(CASES)} bad inputs.",
        "",
        "| # | input | exit | the answer says |",
        "|---|---|---|---|",
    ]
    for number, case in enumerate(CASES, 1):
        says = case.says.replace("|", "\\|")
        lines.append(f"| {number} | {case.shown} | {case.code} | {says} |")
    lines += [
        "",
        "## Faults",
        "",
        f"{len(FAULTS)} faults, each inflicted for real by the test named (under `tests/`).",
        "",
        "| fault | outcome | test |",
        "|---|---|---|",
    ]
    lines += [f"| {fault} | {outcome} | `{test}` |" for fault, outcome, test in FAULTS]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(table(), end="")
