"""`python -m deepinfer ...` is the `deepinfer` command."""

from __future__ import annotations

from deepinfer.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
