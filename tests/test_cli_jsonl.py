"""The command line's JSONL mode: per-line fields, lines that fail alone, resuming after a torn line or a kill;
and `deepinfer bench`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deepinfer.cli import main
from tests.conftest import fixture_dir

MODEL = str(fixture_dir("v41-tiny-engram"))
ROOT = Path(__file__).parent.parent


def write_prompts(path: Path, count: int, max_tokens: int) -> list[str]:
    ids = [f"p{i}" for i in range(count)]
    path.write_text("".join(json.dumps({"id": i, "prompt_token_ids": [3 + k, 40 + k, 7], "max_tokens": max_tokens})
                            + "\n" for k, i in enumerate(ids)))
    return ids


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_rerun_replaces_a_torn_line_and_adds_only_what_is_missing(tmp_path: Path) -> None:
    source, full, resumed = tmp_path / "in.jsonl", tmp_path / "full.jsonl", tmp_path / "resumed.jsonl"
    ids = write_prompts(source, 6, max_tokens=4)
    args = ["generate", "--model", MODEL, "--input", str(source), "--no-progress", "--ignore-eos"]
    assert main([*args, "--output", str(full)]) == 0
    complete = {r["id"]: r for r in records(full)}
    assert sorted(complete) == sorted(ids) and all(len(r["outputs"][0]["token_ids"]) == 4 for r in complete.values())
    lines = full.read_text().splitlines(keepends=True)
    resumed.write_text("".join(lines[:3]) + lines[3][: len(lines[3]) // 2])  # killed while writing line 4
    assert main([*args, "--output", str(resumed)]) == 0
    again = records(resumed)
    assert resumed.read_text().startswith("".join(lines[:3]))  # finished lines are kept as they were
    assert sorted(r["id"] for r in again) == sorted(ids)  # every id once
    # Seeds come from the ids, so the resumed run completes each request as the uninterrupted one did.
    assert all(r["outputs"] == complete[r["id"]]["outputs"] and r["seed"] == complete[r["id"]]["seed"] for r in again)


def test_the_command_survives_a_kill_and_resumes_without_duplicates(tmp_path: Path) -> None:
    source, results = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    ids = write_prompts(source, 8, max_tokens=40)
    cmd = [sys.executable, "-m", "deepinfer", "generate", "--model", MODEL, "--input", str(source), "--output",
           str(results), "--no-progress", "--ignore-eos", "--max-num-seqs", "1"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (results.exists() and results.read_text().count("\n") >= 2) and time.monotonic() < deadline:
            assert proc.poll() is None, "the run ended before it could be killed"
            time.sleep(0.02)
        assert proc.poll() is None, "the run ended before it could be killed"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    written = results.read_text()
    assert 2 <= written.count("\n") < 8
    assert main(["generate", "--model", MODEL, "--input", str(source), "--output", str(results), "--no-progress",
                 "--ignore-eos"]) == 0
    assert sorted(r["id"] for r in records(results)) == sorted(ids)
    assert all(len(r["outputs"][0]["token_ids"]) == 40 for r in records(results))


def test_lines_bring_their_own_fields_and_a_bad_line_fails_alone(tmp_path: Path) -> None:
    source, results = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(json.dumps(x) for x in [
        {"id": "short", "prompt_token_ids": [5, 6], "max_tokens": 2, "temperature": 0},
        {"id": "bad", "prompt_token_ids": [5, 6], "temperature": -1},
        {"prompt_token_ids": [9], "n": 2},  # no id: its line number
    ]) + "\n")
    status = main(["generate", "--model", MODEL, "--input", str(source), "--output", str(results), "--no-progress",
                   "--max-tokens", "3", "--ignore-eos"])
    assert status == 1
    out = {r["id"]: r for r in records(results)}
    assert sorted(out, key=str) == [3, "bad", "short"]
    assert "temperature" in out["bad"]["error"] and out["bad"]["outputs"] == []
    assert [len(c["token_ids"]) for c in out["short"]["outputs"]] == [2]
    assert [len(c["token_ids"]) for c in out[3]["outputs"]] == [3, 3] and out[3]["error"] is None


def test_repeated_ids_are_refused(tmp_path: Path) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text('{"id": 1, "prompt": "a"}\n{"id": 1, "prompt": "b"}\n')
    with pytest.raises(SystemExit, match="id 1 repeats line 1"):
        main(["generate", "--model", MODEL, "--input", str(source), "--output", str(tmp_path / "out.jsonl")])


def test_bench_prints_one_row_per_configuration(capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "--model", MODEL, "--batch", "1", "3", "--input-len", "4", "--output-len", "3",
                 "--repeat", "1", "--async", "on", "off"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split()[:6] == ["batch", "async", "invariant", "in", "out", "tokens/s"]
    rows = [line.split() for line in lines[2:]]
    assert [(r[0], r[1]) for r in rows] == [("1", "on"), ("1", "off"), ("3", "on"), ("3", "off")]
    assert all(float(r[5]) > 0 and r[7] == "3" for r in rows)  # tokens/s, and 3 steps for 3 tokens


def test_logprobs_are_written_per_token_and_dspark_has_a_flag(tmp_path: Path) -> None:
    source, plain, drafted = tmp_path / "in.jsonl", tmp_path / "plain.jsonl", tmp_path / "drafted.jsonl"
    source.write_text(json.dumps({"id": "a", "prompt": "def fib(n):", "max_tokens": 6, "temperature": 0}) + "\n")
    args = ["generate", "--input", str(source), "--no-progress", "--logprobs", "2"]
    assert main([*args, "--output", str(plain)]) == 0
    assert main([*args, "--output", str(drafted), "--dspark", "3"]) == 0
    (record,) = records(plain)
    completion = record["outputs"][0]
    assert len(completion["logprobs"]) == len(completion["token_ids"]) == 6
    for token, step in zip(completion["token_ids"], completion["logprobs"]):
        assert step[0]["token_id"] == token and step[0]["rank"] == 1  # greedy: the sampled token, first
        assert len(step) == 2 and all(c["logprob"] <= 0 and isinstance(c["decoded_token"], str) for c in step)
    assert records(drafted)[0]["outputs"][0]["token_ids"] == completion["token_ids"]  # drafting keeps the tokens
    with pytest.raises(SystemExit, match="num_speculative_tokens must be an integer >= 1"):
        main(["generate", "x", "--dspark", "0"])
