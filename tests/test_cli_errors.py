"""The JSONL job and the command line's ordinary mistakes: every bad line an error record of its own, one writer per
output file, no empty file on a failed start, one-line errors and a failing exit status."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deepinfer.cli import main
from deepinfer.results_file import ResultsFile, read_inputs
from tests.conftest import fixture_dir

MODEL = str(fixture_dir("v41-tiny-engram"))
ROOT = Path(__file__).parent.parent


def records(path: Path) -> dict:
    return {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}


def test_every_bad_line_becomes_an_error_record_and_the_others_run(tmp_path: Path) -> None:
    source, results = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    good = json.dumps({"id": "good", "prompt_token_ids": [5, 6], "max_tokens": 2})
    source.write_bytes(b"\n".join([
        json.dumps({"id": "typo", "prompt_token_ids": [5], "temprature": 0}).encode(),
        b"\xff\xfe not utf-8",
        b"{not json",
        b"[" * 100_000 + b"]" * 100_000,
        b"[1, 2]",
        json.dumps({"id": [1], "prompt": "x"}).encode(),
        good.encode(),
    ]) + b"\n")
    status = main(["generate", "--model", MODEL, "--input", str(source), "--output", str(results), "--no-progress",
                   "--ignore-eos"])
    assert status == 1
    out = records(results)
    assert out["good"]["error"] is None and len(out["good"]["outputs"][0]["token_ids"]) == 2
    expected = {"typo": "unknown field 'temprature' (did you mean 'temperature'?)", 2: "line 2: not UTF-8 text",
                3: "line 3: not JSON", 4: "line 4: JSON nested too deeply", 5: "expected an object or a string",
                6: "an id is a string or an integer"}
    for line_id, needle in expected.items():
        assert needle in out[line_id]["error"] and out[line_id]["outputs"] == [], out[line_id]
    assert sorted(out, key=str) == sorted(["good", *expected], key=str)


def test_a_second_writer_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    first = ResultsFile(str(path))
    try:
        with pytest.raises(SystemExit, match="being written by another run"):
            ResultsFile(str(path))
    finally:
        first.close()
    ResultsFile(str(path)).close()  # released: a later run may write it


def test_input_and_output_must_differ(tmp_path: Path) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text('{"prompt": "a"}\n')
    with pytest.raises(SystemExit, match="--input and --output are the same file"):
        main(["generate", "--input", str(source), "--output", str(tmp_path / "." / "in.jsonl")])
    assert source.read_text() == '{"prompt": "a"}\n'


def test_a_failed_start_leaves_no_output_file(tmp_path: Path) -> None:
    results = tmp_path / "out.jsonl"
    with pytest.raises(SystemExit, match="--input .*missing.jsonl: no such file"):
        main(["generate", "--input", str(tmp_path / "missing.jsonl"), "--output", str(results)])
    assert not results.exists()
    source = tmp_path / "in.jsonl"
    source.write_text('{"prompt": "a"}\n')
    with pytest.raises(SystemExit, match="model '.*no-model': no such directory"):
        main(["generate", "--model", str(tmp_path / "no-model"), "--input", str(source), "--output", str(results)])
    assert not results.exists()


def test_repeated_ids_stop_the_run_before_anything_is_written(tmp_path: Path) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text('{"id": 1, "prompt": "a"}\n{"id": 1, "prompt": "b"}\n')
    with pytest.raises(SystemExit, match="id 1 repeats line 1"):
        read_inputs(str(source))


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deepinfer", *args], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, check=False)


@pytest.mark.parametrize("args,message", [
    (["generate", "x", "--model", "/nonexistent/model"], "model '/nonexistent/model': no such directory"),
    (["generate", "x", "--input", "/nonexistent/in.jsonl"], "--input /nonexistent/in.jsonl: no such file"),
    (["generate", "x", "--target", "sm90"], "runs on an NVIDIA Hopper GPU, and torch sees no CUDA GPU"),
    (["generate", "x", "--max-num-seqs", "0"], "max_num_seqs must be an integer >= 1"),
    (["generate", "x", "--speculative-config", "{nope"], "--speculative-config is not JSON"),
])
def test_ordinary_mistakes_are_one_line_and_a_failing_status(args: list[str], message: str) -> None:
    if "sm90" in args and torch.cuda.is_available():
        pytest.skip("needs a machine without a GPU")
    run = _cli(*args)
    assert run.returncode == 1 and message in run.stderr, run.stderr
    assert "Traceback" not in run.stderr
    lines = [line for line in run.stderr.splitlines() if not line.startswith("deepinfer: INFO")]
    assert len(lines) == 1, run.stderr
