"""The conversion diffs in docs/converting.md (and the README's) stay as small as promised:
a changed line counts once whether it was replaced, added or removed."""

from __future__ import annotations

import re

import pytest

from tests.helpers import REPO

CONVERTING = (REPO / "docs" / "converting.md").read_text()


def diffs(text: str) -> list[str]:
    return re.findall(r"```diff\n(.*?)```", text, flags=re.DOTALL)


def changed_lines(diff: str) -> int:
    """Per run of adjacent +/- lines, the larger of its additions and removals."""
    total, plus, minus = 0, 0, 0
    for line in [*diff.splitlines(), " "]:
        if line.startswith("+"):
            plus += 1
        elif line.startswith("-"):
            minus += 1
        else:
            total += max(plus, minus)
            plus = minus = 0
    return total


def test_the_count_treats_a_replaced_line_as_one_change() -> None:
    assert changed_lines("-a\n+b\n c\n+d\n-e\n-f\n g") == 1 + 2
    assert changed_lines(" a\n b") == 0


@pytest.mark.parametrize(
    ("index", "most", "kept"),
    [
        (0, 10, ["sampler.set_epoch(epoch)", "loss.backward()", "optimizer.step()"]),
        (
            1,
            20,
            [
                "for micro_step in range(gradient_accumulation_steps):",
                "model.require_backward_grad_sync = (micro_step",
                "scaler.scale(loss).backward()",
                "lr = get_lr(iter_num)",
            ],
        ),
        (2, 10, ["def main(rank: int, world_size: int, epochs: int)", "sampler.set_epoch(epoch)"]),
        (
            3,
            15,
            [
                'with torch.device("meta"):',
                "fully_shard(layer, **fsdp_kwargs)",
                "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)",
            ],
        ),
        (
            4,
            60,
            [
                "model = models.__dict__[args.arch]()",
                "scheduler = StepLR(optimizer, step_size=30, gamma=0.1)",
                "validate(val_loader, model, criterion, args)",
                "train(train_loader, model, criterion, optimizer, epoch, device, args)",
            ],
        ),
        (
            5,
            50,
            [
                "optimizer = optim.Adadelta(model.parameters(), lr=args.lr)",
                "scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)",
                "loss = F.nll_loss(output, target)",
                "pred = output.argmax(dim=1, keepdim=True)",
            ],
        ),
    ],
    ids=["ddp-tutorial", "nanogpt", "mp-spawn", "fsdp2-example", "imagenet", "mnist"],
)
def test_each_shape_converts_in_few_lines_keeping_its_structure(
    index: int, most: int, kept: list[str]
) -> None:
    diff = diffs(CONVERTING)[index]
    assert 0 < changed_lines(diff) <= most, diff
    context = [line for line in diff.splitlines() if line.startswith(" ")]
    for text in kept:
        assert any(text in line for line in context), f"{text!r} is no longer as it was"


def test_the_table_of_sizes_counts_each_diff() -> None:
    rows = re.findall(r"^\| [^|]+ \| (\d+) \| [^|]+ \|$", CONVERTING, flags=re.MULTILINE)
    assert [int(count) for count in rows] == [changed_lines(diff) for diff in diffs(CONVERTING)]


def test_the_readme_script_diff_is_as_small() -> None:
    readme = diffs((REPO / "README.md").read_text())
    assert readme and changed_lines(readme[0]) <= 10


def prose(markdown: str) -> str:
    """``markdown`` without its fenced code blocks (``x[i](y)`` there is code, not a link)."""
    return re.sub(r"^```.*?^```", "", markdown, flags=re.DOTALL | re.MULTILINE)


def test_the_readme_is_a_newcomers_page_and_every_link_in_the_docs_leads_somewhere() -> None:
    readme = (REPO / "README.md").read_text().splitlines()
    assert len(readme) < 250
    first_command = next(i for i, line in enumerate(readme) if line.startswith("make "))
    assert first_command < 40, "the first command a user can type is on the first screen"
    assert any("make test" in line and "minutes" in line for line in readme)
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    broken = [
        (page.name, link)
        for page in pages
        for link in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", prose(page.read_text()))
        if not link.startswith(("http:", "https:")) and not (page.parent / link).exists()
    ]
    assert broken == []
