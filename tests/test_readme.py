"""The README's examples as written: its Python blocks run, and every `deepinfer` command line it shows parses."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from deepinfer.cli import build_parser

README = (Path(__file__).parent.parent / "README.md").read_text(encoding="utf-8")


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.DOTALL)


def test_the_python_blocks_run_as_written(capsys: pytest.CaptureFixture) -> None:
    python = blocks("python")
    assert python, "the README has no Python block"
    for i, source in enumerate(python):
        namespace: dict = {"__name__": f"readme_block_{i}"}
        exec(compile(source, f"README.md python block {i}", "exec"), namespace)  # noqa: S102 - the README's own code
    printed = capsys.readouterr().out
    assert "length" in printed or "stop" in printed  # the completions' finish reasons were printed
    logits = namespace["logits"]
    assert logits.dim() == 3 and logits.shape[0] == 1 and logits.shape[-1] == namespace["model"].config.vocab_size


def test_every_command_line_parses() -> None:
    commands = []
    for block in blocks("bash"):
        for line in block.splitlines():
            for part in line.split("&&"):
                words = shlex.split(part.split("  #")[0])
                if words[:1] == ["deepinfer"]:
                    commands.append(words[1:])
                elif words[:3] == ["python", "-m", "deepinfer"]:
                    commands.append(words[3:])
    assert len(commands) >= 6
    parser = build_parser()
    for argv in commands:
        parser.parse_args(argv)
