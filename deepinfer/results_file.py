"""JSONL in and out for the command line, resumable: a run killed at any point loses no finished line.

Each input line is an object with an `id`, the prompt (`prompt` or `prompt_token_ids`), any SamplingParams
fields and at most one constraint (`json_schema`, `regex`, `grammar` or `choice`); a bare string is a prompt. A line
without an id gets its line number. A line that cannot be read (not UTF-8, not JSON, not an object, a field nobody
reads) becomes an error record of its own and the others run; only a repeated id stops the run, before anything is
written, since results are told apart by id. Each finished request is written as one line carrying the same id, then
flushed and fsynced before the next is written, so after a crash the file holds every finished line and at most one
torn line at the end, which `ResultsFile` cuts off when it reopens the file; the ids it holds are skipped, so a rerun
writes no duplicate. The file is locked (`fcntl.flock`) while a run writes it: a second run on it is refused.
"""

from __future__ import annotations

import difflib
import fcntl
import json
import os
from dataclasses import dataclass, fields
from typing import Any

from deepinfer.sampling_params import SamplingParams

SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingParams) if f.name != "structured_outputs")
# A line's constraint keys and the StructuredOutputsParams field each fills.
CONSTRAINT_FIELDS = {"json_schema": "json", "regex": "regex", "grammar": "grammar", "choice": "choice"}
LINE_FIELDS = ("id", "prompt", "prompt_token_ids", *SAMPLING_FIELDS, *CONSTRAINT_FIELDS)


@dataclass
class InputLine:
    id: Any
    prompt: str | dict[str, Any]
    sampling: dict[str, Any]  # the line's own SamplingParams fields
    error: str | None = None  # why the line cannot run (it is written as an error record)
    number: int | None = None  # its line number in the input file


def parse_line(raw: bytes, number: int) -> InputLine:
    """One input line; a line that cannot be read comes back with `error` set and its line number as id."""
    try:
        item = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        return InputLine(number, "", {}, f"line {number}: not UTF-8 text ({e.reason} at byte {e.start})", number)
    except json.JSONDecodeError as e:
        return InputLine(number, "", {}, f"line {number}: not JSON: {e}", number)
    except RecursionError:
        return InputLine(number, "", {}, f"line {number}: JSON nested too deeply to read", number)
    if isinstance(item, str):
        item = {"prompt": item}
    if not isinstance(item, dict):
        return InputLine(number, "", {}, f"line {number}: expected an object or a string, got "
                                         f"{type(item).__name__}", number)
    line_id = item.get("id", number)
    if not isinstance(line_id, (str, int)) or isinstance(line_id, bool):
        return InputLine(number, "", {}, f"line {number}: an id is a string or an integer, got {line_id!r:.80}",
                         number)
    prompt = {k: item[k] for k in ("prompt", "prompt_token_ids") if k in item}
    unknown = [k for k in item if k not in LINE_FIELDS]
    if unknown:
        close = difflib.get_close_matches(unknown[0], LINE_FIELDS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return InputLine(line_id, prompt, {}, f"line {number}: unknown field {unknown[0]!r}{hint}", number)
    sampling = {k: item[k] for k in SAMPLING_FIELDS if k in item}
    constraint = {CONSTRAINT_FIELDS[k]: item[k] for k in CONSTRAINT_FIELDS if k in item}
    if constraint:
        sampling["structured_outputs"] = constraint
    return InputLine(line_id, prompt, sampling, None, number)


def read_inputs(path: str) -> list[InputLine]:
    """The lines of a JSONL prompts file, unreadable ones with their error; SystemExit naming a repeated id."""
    lines: list[InputLine] = []
    seen: dict[Any, int] = {}
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            line = parse_line(raw, number)
            if line.id in seen:
                raise SystemExit(f"deepinfer: {path}:{number}: id {line.id!r} repeats line {seen[line.id]}")
            seen[line.id] = number
            lines.append(line)
    return lines


class ResultsFile:
    """An output JSONL file opened for appending; `done` holds the ids it already has."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.done: set[Any] = set()
        self.created = not os.path.exists(path)
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - held open (and locked) for the whole run
        try:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.close()
            raise SystemExit(f"deepinfer: {path} is being written by another run (it holds the file's lock); "
                             "wait for it to finish, or give another --output") from None
        self._read_done()

    def _read_done(self) -> None:
        """Collect the ids already written; cut off a torn last line (a run killed while writing it)."""
        with open(self.path, "rb") as f:
            data = f.read()
        keep = 0
        pieces = data.splitlines(keepends=True)
        for number, raw in enumerate(pieces, start=1):
            try:
                record = json.loads(raw) if raw.endswith(b"\n") else None
            except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
                record = None
            if isinstance(record, dict) and "id" in record:
                self.done.add(record["id"])
                keep += len(raw)
            elif number < len(pieces):
                self.close()
                raise SystemExit(f"deepinfer: {self.path}:{number}: not a result line; is it a results file?")
        if keep < len(data):
            os.truncate(self.path, keep)

    def write(self, record: dict[str, Any]) -> None:
        """Append one finished result and make it durable before returning."""
        self._file.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        self.done.add(record["id"])

    def close(self) -> None:
        """Release the file (and its lock)."""
        self._file.close()

    def abandon(self) -> None:
        """Close after a failed start: a file this run created and never wrote is removed, so none is left empty."""
        self.close()
        if self.created and os.path.getsize(self.path) == 0:
            os.unlink(self.path)
