"""JSONL in and out for the command line, resumable: a run killed at any point loses no finished line.

Each input line is an object with an `id`, the prompt (`prompt` or `prompt_token_ids`), any SamplingParams
fields and at most one constraint (`json_schema`, `regex`, `grammar` or `choice`); a bare string is a prompt. A line without an id gets its line number. Each finished request is written as
one line carrying the same id, then flushed and fsynced before the next is written, so after a crash the file
holds every finished line and at most one torn line at the end, which `ResultsFile` cuts off when it reopens the
file; the ids it holds are skipped, so a rerun writes no duplicate.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from typing import Any

from deepinfer.sampling_params import SamplingParams

SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingParams) if f.name != "structured_outputs")
# A line's constraint keys and the StructuredOutputsParams field each fills.
CONSTRAINT_FIELDS = {"json_schema": "json", "regex": "regex", "grammar": "grammar", "choice": "choice"}


@dataclass
class InputLine:
    id: Any
    prompt: str | dict[str, Any]
    sampling: dict[str, Any]  # the line's own SamplingParams fields


def read_inputs(path: str) -> list[InputLine]:
    """The lines of a JSONL prompts file; raises SystemExit naming the line on malformed input or a repeated id."""
    lines: list[InputLine] = []
    seen: dict[Any, int] = {}
    with open(path, encoding="utf-8") as f:
        for number, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                item = json.loads(text)
            except json.JSONDecodeError as e:
                raise SystemExit(f"deepinfer: {path}:{number}: not JSON: {e}") from None
            if isinstance(item, str):
                item = {"prompt": item}
            if not isinstance(item, dict):
                raise SystemExit(f"deepinfer: {path}:{number}: expected an object or a string")
            line_id = item.get("id", number)
            if not isinstance(line_id, (str, int)) or isinstance(line_id, bool):
                raise SystemExit(f"deepinfer: {path}:{number}: an id is a string or an integer, got {line_id!r}")
            if line_id in seen:
                raise SystemExit(f"deepinfer: {path}:{number}: id {line_id!r} repeats line {seen[line_id]}")
            seen[line_id] = number
            prompt = {k: item[k] for k in ("prompt", "prompt_token_ids") if k in item}
            sampling = {k: item[k] for k in SAMPLING_FIELDS if k in item}
            constraint = {CONSTRAINT_FIELDS[k]: item[k] for k in CONSTRAINT_FIELDS if k in item}
            if constraint:
                sampling["structured_outputs"] = constraint
            lines.append(InputLine(line_id, prompt, sampling))
    return lines


class ResultsFile:
    """An output JSONL file opened for appending; `done` holds the ids it already has."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.done: set[Any] = set()
        keep = 0
        if os.path.exists(path):
            with open(path, "rb") as f:
                data = f.read()
            pieces = data.splitlines(keepends=True)
            for number, raw in enumerate(pieces, start=1):
                try:
                    record = json.loads(raw) if raw.endswith(b"\n") else None
                except (json.JSONDecodeError, UnicodeDecodeError):
                    record = None
                if isinstance(record, dict) and "id" in record:
                    self.done.add(record["id"])
                    keep += len(raw)
                elif number < len(pieces):
                    raise SystemExit(f"deepinfer: {path}:{number}: not a result line; is it a results file?")
            if keep < len(data):  # the last line was torn by a run killed while writing it
                with open(path, "r+b") as f:
                    f.truncate(keep)
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - held open for the whole run

    def write(self, record: dict[str, Any]) -> None:
        """Append one finished result and make it durable before returning."""
        self._file.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        self.done.add(record["id"])

    def close(self) -> None:
        self._file.close()
