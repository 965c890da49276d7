"""Any cluster's sbatch options: --slurm on the command line, the site profiles
(slurm/site.yaml, ~/.config/hpc_ddp/site.yaml), sbatch= from Python; options hpc_ddp sets
itself refused; an option this cluster's sbatch does not know refused in sbatch's words."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from hpc_ddp.launch.sbatch import RenderRequest, render_sbatch, template_path
from hpc_ddp.launch.slurmoptions import (
    api_options,
    check_with_sbatch,
    from_words,
    job_options,
    slurm_config_here,
)
from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.sweep.submit import _job_fields, job_from
from tests.slurm_cluster import SlurmCluster, prepare_workdir


def profile(folder: Path, text: str) -> Path:
    path = folder / "site.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_command_line_options_are_read_as_sbatch_writes_them() -> None:
    assert from_words(["account=lab", "--qos=high", "exclusive", "qos=low", "mail_type=END"]) == {
        "account": "lab",
        "qos": "low",
        "exclusive": None,
        "mail-type": "END",
    }
    with pytest.raises(HpcDdpError, match="--time is set from hpc-ddp's own options") as own:
        from_words(["time=10"])
    assert own.value.hint == "use --time instead"
    with pytest.raises(HpcDdpError, match="not an sbatch option name"):
        from_words(["acc ount=lab"])
    with pytest.raises(HpcDdpError, match="line break"):
        from_words(["comment=a\n#SBATCH --nodes=99"])
    with pytest.raises(HpcDdpError, match="backslash"):
        from_words(["comment=a\\b"])
    with pytest.raises(HpcDdpError, match=r"long name .*account=lab \(not A=lab\)"):
        from_words(["A=lab"])


def test_the_projects_profile_wins_over_yours_and_the_command_line_over_both(
    tmp_path: Path,
) -> None:
    home = tmp_path / "home"
    profile(home / ".config" / "hpc_ddp", "sbatch:\n  account: mine\n  qos: low\n  mem: 8G\n")
    project = tmp_path / "project"
    profile(project / "slurm", "sbatch:\n  account: lab\n  mem: false\n  exclusive: true\n")
    environ = {"HOME": str(home)}
    assert job_options(["qos=high"], project, environ) == {
        "account": "lab",
        "qos": "high",
        "exclusive": None,
    }, "mem dropped by the project's profile"
    xdg = {"HOME": str(home), "XDG_CONFIG_HOME": str(tmp_path / "elsewhere")}
    assert job_options([], project, xdg) == {"account": "lab", "exclusive": None}
    assert api_options({"account": "other", "exclusive": False}, project, environ) == {
        "account": "other",
        "qos": "low",
    }


def test_a_profile_that_is_not_a_mapping_of_sbatch_options_is_refused(tmp_path: Path) -> None:
    profile(tmp_path / "slurm", "account: lab\n")
    with pytest.raises(HpcDdpError, match=r"expected one mapping 'sbatch:'.*\['account'\]"):
        job_options([], tmp_path, {"HOME": str(tmp_path)})
    profile(tmp_path / "slurm", "sbatch:\n  nodes: 4\n")
    with pytest.raises(HpcDdpError, match="--nodes is set from hpc-ddp's own options"):
        job_options([], tmp_path, {"HOME": str(tmp_path)})


def test_the_options_are_written_after_the_time_limit_each_a_shell_word() -> None:
    options = (("account", "lab"), ("exclusive", None), ("comment", "a b; c"))
    request = RenderRequest(arguments=("train.py",), sbatch_options=options)
    script = render_sbatch(template_path("srun").read_text(), request)
    lines = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    at = lines.index("#SBATCH --time=01:00:00")
    assert lines[at + 1 : at + 4] == [
        "#SBATCH --account=lab",
        "#SBATCH --exclusive",
        "#SBATCH --comment='a b; c'",
    ]


def test_a_sweep_keeps_its_options_for_its_later_arrays() -> None:
    job = RenderRequest(arguments=(), sbatch_options=(("account", "lab"), ("exclusive", None)))
    fields = json.loads(json.dumps(_job_fields(job)))
    assert job_from(fields) == job
    older = {key: value for key, value in fields.items() if key != "sbatch_options"}
    assert job_from(older).sbatch_options == (), "a record written before options were kept"


def test_without_sbatch_or_its_configuration_nothing_is_checked(tmp_path: Path) -> None:
    assert not slurm_config_here({"SLURM_CONF": str(tmp_path / "absent.conf")})
    check_with_sbatch({"acount": "x"}, {"PATH": str(tmp_path)})  # no sbatch: no refusal


@pytest.mark.slurm
def test_an_option_this_clusters_sbatch_does_not_know_is_refused_in_its_words(
    slurm: SlurmCluster,
) -> None:
    environ = slurm.environ()
    check_with_sbatch({"account": "lab", "qos": "normal", "exclusive": None}, environ)
    with pytest.raises(HpcDdpError, match="unrecognized option '--acount=lab'"):
        check_with_sbatch({"acount": "lab"}, environ)


@pytest.mark.slurm
def test_a_job_rendered_with_the_sites_account_runs_under_it(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    """The project's profile names the account (the test cluster's accounting has `lab`), the
    command line adds a comment; the job runs under both and trains."""
    work = prepare_workdir(tmp_path)
    profile(work / "slurm", "sbatch:\n  account: lab\n")
    rendered = slurm.run(
        [sys.executable, "-m", "hpc_ddp", "render", "--tasks-per-node", "2", "--slurm",
         "comment=rendered-with-a-profile", "-o", "job.sh", "--config", "configs/synthetic.yaml",
         f"run.output_dir={work / 'runs'}", "data.num_samples=512", "train.epochs=1"],
        work,
    )  # fmt: skip
    assert rendered.returncode == 0, rendered.stderr
    assert "#SBATCH --account=lab\n#SBATCH --comment=rendered-with-a-profile\n" in (
        (work / "job.sh").read_text()
    )
    job = slurm.sbatch(["job.sh"], work)
    assert slurm.job_field(job, "Account") == "lab"
    assert slurm.job_field(job, "Comment") == "rendered-with-a-profile"
    state = slurm.wait(job)
    assert state == "COMPLETED", (work / "logs" / f"hpc-ddp-{job}.out").read_text()[-3000:]
