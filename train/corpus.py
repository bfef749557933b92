"""The training corpus: the Python standard library's own .py sources, in a fixed order, with a held-out split.

`python -m train.corpus --out train/data` trains the tokenizer (train/bpe.py) on the training split and writes
token ids as numpy arrays: `train_ids.npy` / `heldout_ids.npy` (uint16, every document followed by `<|eos|>`),
`train_starts.npy` / `heldout_starts.npy` (int64 offsets where documents begin) and `manifest.json` (which files,
how many bytes and tokens). The order is the sorted relative path, so the same stdlib gives the same arrays.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sysconfig
from pathlib import Path

import numpy as np

MAX_FILE_BYTES = 256 * 1024  # larger .py files in the stdlib are data (pydoc's topics), not code
HELDOUT_EVERY = 50  # about 2% of the files, chosen by a hash of the path so adding a file moves no other


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[str]:
    """Relative paths (posix) of the stdlib's .py files, sorted; installed packages and non-UTF-8 files left out."""
    root = root or stdlib_root()
    out = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        if rel.split("/")[0] in ("site-packages", "dist-packages") or path.stat().st_size > MAX_FILE_BYTES:
            continue
        try:
            path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue
        out.append(rel)
    return sorted(out)


def is_heldout(rel: str) -> bool:
    return int(hashlib.sha256(rel.encode()).hexdigest(), 16) % HELDOUT_EVERY == 0


def documents(split: str, root: Path | None = None) -> list[tuple[str, str]]:
    """(relative path, text) of every file of `split` ("train" or "heldout"), in corpus order."""
    root = root or stdlib_root()
    want = split == "heldout"
    return [(rel, (root / rel).read_text(encoding="utf-8")) for rel in stdlib_files(root) if is_heldout(rel) == want]


def encode_documents(tokenizer, texts: list[str], eos_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of the documents, each followed by `eos_id` (uint16 [T]), and where each document starts."""
    encoded = tokenizer.encode_batch(texts, add_special_tokens=False)
    lengths = np.array([len(e.ids) + 1 for e in encoded], dtype=np.int64)
    ids = np.fromiter((t for e in encoded for t in [*e.ids, eos_id]), dtype=np.uint16, count=int(lengths.sum()))
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    return ids, starts


def main() -> None:
    from train.bpe import train_tokenizer

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="train/data", help="where the tokenizer and token arrays go")
    parser.add_argument("--vocab-size", type=int, default=8192)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train_docs, heldout_docs = documents("train"), documents("heldout")
    tokenizer = train_tokenizer([text for _, text in train_docs], args.vocab_size, out)
    eos = tokenizer.token_to_id("<|eos|>")
    manifest = {"stdlib": str(stdlib_root()), "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True)}
    for split, docs in (("train", train_docs), ("heldout", heldout_docs)):
        ids, starts = encode_documents(tokenizer, [text for _, text in docs], eos)
        np.save(out / f"{split}_ids.npy", ids)
        np.save(out / f"{split}_starts.npy", starts)
        manifest[split] = {"files": len(docs), "bytes": sum(len(t.encode()) for _, t in docs),
                           "tokens": int(ids.shape[0])}
        if split == "heldout":
            manifest[split]["paths"] = [rel for rel, _ in docs]
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    print({k: v for k, v in manifest.items() if k not in ("heldout",)}, "heldout:", manifest["heldout"]["tokens"])


if __name__ == "__main__":
    main()
