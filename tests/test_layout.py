"""The package's shape stays as the README describes it: no import circle (a function-level
import counts too), the runtime's rooms import only from the rooms before them, nothing in
the runtime reaches up into the launchers, the trainer, the views or the CLI, and no folder
grows past a dozen modules."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers import REPO

PACKAGE = REPO / "hpc_ddp"
#: The runtime's rooms in the order they may import each other ("" is the shared leaves).
ROOMS = ["", "place", "checkpoint", "tracking", "monitor", "preempt", "loop", "session"]


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts).removesuffix(".__init__")


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def imports_of(path: Path) -> set[str]:
    """Every hpc_ddp module ``path`` imports when it runs, at any level of the file (not the
    names it imports for type checking only)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            return
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hpc_ddp"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in MODULES else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("hpc_ddp"))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return {name for name in found if name in MODULES}


GRAPH = {name: imports_of(path) - {name} for name, path in MODULES.items()}


def room_of(name: str) -> str:
    parts = name.split(".")
    return parts[2] if len(parts) > 3 and parts[2] in ROOMS else ""


def test_no_module_imports_itself_back_through_others() -> None:
    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            current = todo.pop()
            for nxt in GRAPH[current]:
                if nxt == goal:
                    return True
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return False

    circles = sorted(name for name in GRAPH if reaches(name, name))
    assert circles == [], f"import circles through: {circles}"


def test_the_runtimes_rooms_import_only_from_the_rooms_before_them() -> None:
    wrong = []
    for name, imported in GRAPH.items():
        if not name.startswith("hpc_ddp.runtime"):
            continue
        for other in imported:
            if other == "hpc_ddp":
                continue
            if not other.startswith("hpc_ddp.runtime"):
                wrong.append(f"{name} -> {other} (outside the runtime)")
            elif ROOMS.index(room_of(other)) > ROOMS.index(room_of(name)):
                wrong.append(f"{name} -> {other} (a later room)")
    assert wrong == []


def test_no_folder_holds_more_than_a_dozen_modules() -> None:
    sizes = {
        str(folder.relative_to(REPO)): len([p for p in folder.glob("*.py") if p.stem != "__init__"])
        for folder in {path.parent for path in MODULES.values()}
    }
    assert max(sizes.values()) <= 12, sizes
    assert set(ROOMS[1:]) <= {Path(f).name for f in sizes}, "every room is a folder"


def test_the_built_in_trainer_uses_only_the_public_api_and_the_config_helpers() -> None:
    """The trainer is a client like any user's script: ``hpc_ddp``'s own names, the config
    helpers its sections are made with, and its own modules."""
    allowed = {"hpc_ddp", "hpc_ddp.runtime.config", "hpc_ddp.runtime.configfile"}
    wrong = sorted(
        f"{name} -> {other}"
        for name, imported in GRAPH.items()
        if name.startswith("hpc_ddp.trainer")
        for other in imported
        if other not in allowed and not other.startswith("hpc_ddp.trainer")
    )
    assert wrong == []


def test_the_launchers_know_no_trainer_and_nothing_below_the_cli_reaches_up() -> None:
    """The launchers run programs and callables: a config of the built-in trainer reaches
    them as a callable, and its settings as a value, from above (``hpc_ddp.cli``), never by
    their importing the trainer or the CLI."""
    above = ("hpc_ddp.trainer", "hpc_ddp.cli", "hpc_ddp.train")
    wrong = sorted(
        f"{name} -> {other}"
        for name, imported in GRAPH.items()
        if name.startswith(("hpc_ddp.launch", "hpc_ddp.sweep"))
        for other in imported
        if other.startswith(above)
    )
    assert wrong == []


def test_no_class_holds_more_than_about_150_lines_of_code() -> None:
    """Docstrings, comments and blank lines aside."""

    def code_lines(source: list[str], node: ast.ClassDef) -> int:
        lines = set(range(node.lineno, (node.end_lineno or node.lineno) + 1))
        for inner in ast.walk(node):
            if isinstance(inner, ast.Expr) and isinstance(inner.value, ast.Constant):
                lines -= set(range(inner.lineno, (inner.end_lineno or inner.lineno) + 1))
        return sum(
            1 for n in lines if source[n - 1].strip() and not source[n - 1].lstrip().startswith("#")
        )

    sizes = {}
    for name, path in MODULES.items():
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                sizes[f"{name}.{node.name}"] = code_lines(text.splitlines(), node)
    assert {name: size for name, size in sizes.items() if size > 150} == {}


def test_only_the_run_and_its_builder_hold_the_training_loop() -> None:
    """The rest of a run (its resume, finish, ending, summary) takes the loop's parts or
    values, so a change to the loop's shape stays in the loop, :class:`Run` and ``start``."""
    holders = sorted(
        name
        for name, imported in GRAPH.items()
        if "hpc_ddp.runtime.loop.steps" in imported and not name.startswith("hpc_ddp.runtime.loop")
    )
    assert holders == ["hpc_ddp.runtime.session.run", "hpc_ddp.runtime.session.start"]
