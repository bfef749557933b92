"""The `deepinfer` command: arguments to SamplingParams, printed and JSONL results, the exit status."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer.cli import main
from tests.conftest import fixture_dir, oracle

FIXTURE = "v41-smooth"


def test_jsonl_in_and_out(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    data = oracle(FIXTURE)
    prompt, greedy = data["input_ids"][0].tolist(), data["greedy_tokens"][0].tolist()
    source = tmp_path / "prompts.jsonl"
    source.write_text(json.dumps({"prompt_token_ids": prompt}) + "\n\n" + json.dumps({"prompt_token_ids": []}) + "\n")
    results = tmp_path / "results.jsonl"
    status = main(["generate", "--model", str(fixture_dir(FIXTURE)), "--input", str(source), "--output", str(results),
                   "--temperature", "0", "--max-tokens", "16", "--no-progress"])
    assert status == 1  # the empty prompt failed
    records = [json.loads(line) for line in results.read_text().splitlines()]
    lines = {r["id"]: r for r in records}  # written as requests finish; a line without an id is its line number
    assert len(records) == 2 and set(lines) == {1, 3}
    assert lines[1]["outputs"][0]["token_ids"] == greedy and lines[1]["error"] is None
    assert lines[3]["error"] and lines[3]["outputs"][0]["finish_reason"] == "error"
    assert "tokens/s" in capsys.readouterr().err


def test_prints_each_completion(capsys: pytest.CaptureFixture) -> None:
    status = main(["generate", "--model", str(fixture_dir(FIXTURE)), "hello", "--no-progress", "--n", "2"])
    out = capsys.readouterr().out
    assert status == 1 and "Prompt: 'hello'" in out and "Error: " in out  # the V4 ids exceed a 512 vocabulary


def test_bad_sampling_flags_exit_with_the_message(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit, match="top_p must be in"):
        main(["generate", "x", "--top-p", "1.5"])
    with pytest.raises(SystemExit, match="give prompts"):
        main(["generate"])


def test_default_model_from_the_command_line() -> None:
    cmd = [sys.executable, "-m", "deepinfer", "generate", "def fib(n):", "--max-tokens", "3", "--temperature", "0",
           "--ignore-eos", "--no-progress"]
    root = Path(__file__).parent.parent
    run = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300, cwd=root)
    assert run.returncode == 0, run.stderr
    assert "random" not in run.stderr.lower() and "3 tokens generated" in run.stderr
    # The first run says which model it is, and no cache layout at the default log level.
    assert "model: the embedded default, a tiny DeepSeek-V4.1-Flash of 11.2M parameters" in run.stderr
    assert "trained on the Python standard library's sources" in run.stderr and "caches:" not in run.stderr
    assert "Prompt: 'def fib(n):'" in run.stdout and "(3 tokens, length)" in run.stdout
    # The embedded model is trained on Python: greedy, it continues a def as its training record says.
    record = json.loads((root / "deepinfer/checkpoints/v41-tiny-stdlib/train_record.json").read_text())
    assert record["shipped"]["greedy_samples"]["def fib(n):"].startswith("\n    return")
    assert "Completion: '\\n    return" in run.stdout, run.stdout
