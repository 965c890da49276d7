"""What the package ships for a project of its own: the built-in trainer's configs and the
example scripts, found by name from any directory (a checkout's ``configs/`` and
``examples/`` are the same files)."""

from __future__ import annotations

from pathlib import Path

from hpc_ddp.runtime.errors import HpcDdpError

_PACKAGE = Path(__file__).resolve().parent.parent
CONFIG_DIR = _PACKAGE / "trainer" / "configs"
EXAMPLE_DIR = _PACKAGE / "examples"

#: Each example's name and its script (``hpc-ddp init --example NAME`` copies it).
EXAMPLES = {
    "lm": "lm/train.py",
    "digits_cnn": "digits_cnn/train.py",
    "tutorial": "tutorial/with_hpc_ddp.py",
}


def shipped_configs() -> list[str]:
    """The names of the built-in trainer's shipped configs (``digits``, ...)."""
    return sorted(path.stem for path in CONFIG_DIR.glob("*.yaml"))


def shipped_config_name(text: str) -> str | None:
    """The shipped config that ``text`` names: ``digits``, ``digits.yaml`` or the README's
    ``configs/digits.yaml``; None for any other path."""
    path = Path(text)
    if len(path.parts) > 2 or (len(path.parts) == 2 and path.parts[0] != "configs"):
        return None
    name = path.name.removesuffix(".yaml")
    return name if name in shipped_configs() else None


def find_config(text: str, cwd: Path) -> Path:
    """The built-in trainer's config file that ``text`` means, seen from ``cwd``: the file
    itself where it exists, else the shipped config it names."""
    path = Path(text) if Path(text).is_absolute() else cwd / text
    if path.is_file():
        return path
    name = shipped_config_name(text)
    if name is not None:
        return CONFIG_DIR / f"{name}.yaml"
    raise HpcDdpError(
        f"config file {text!r} does not exist (looked in {cwd})",
        f"pass a YAML config of the built-in trainer, or one it ships by name "
        f"({', '.join(shipped_configs())}, e.g. --config digits); hpc-ddp init --config digits "
        "copies one into ./configs/ to edit",
    )


def example_script(name: str) -> Path:
    """The shipped example script called ``name`` (see :data:`EXAMPLES`)."""
    if name not in EXAMPLES:
        raise HpcDdpError(
            f"no example called {name!r}", f"pick one of: {', '.join(sorted(EXAMPLES))}"
        )
    return EXAMPLE_DIR / EXAMPLES[name]
