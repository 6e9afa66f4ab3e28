"""`longrun data prepare` in a hostile file tree (issue 42, doors 9 and 10): links planted in a
shared output directory are never written through, a FIFO among the inputs is skipped with a
warning instead of blocking forever, and a document larger than the cap is refused naming its
file and line before it is read whole."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

PRECIOUS = "someone else's file\n"


def _prepare(*args, cwd: Path) -> subprocess.CompletedProcess:
    # A FIFO read by today's longrun blocks forever: the timeout turns that into a failure.
    return subprocess.run([sys.executable, "-m", "longrun.cli", "data", "prepare", *map(str, args),
                           "--tokenizer", "byte", "--no-progress"],
                          capture_output=True, text=True, cwd=cwd, timeout=120)


def _victim(tmp_path: Path, name: str) -> Path:
    victim = tmp_path / name
    victim.write_text(PRECIOUS)
    return victim


def _corpus(tmp_path: Path) -> Path:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(4):
        (corpus / f"doc{i}.txt").write_text(f"document {i} " * 50)
    return corpus


def test_links_planted_in_the_output_directory_are_never_written_through(tmp_path):
    corpus, out = _corpus(tmp_path), tmp_path / "out"
    out.mkdir()
    lock_target = _victim(tmp_path, "lock-victim")
    (out / ".prepare.lock").symlink_to(lock_target)
    refused = _prepare(corpus, "--out", out, cwd=tmp_path)
    assert refused.returncode == 2, refused.stderr
    assert f"{out / '.prepare.lock'} is a symbolic link or not a regular file; remove it" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert lock_target.read_text() == PRECIOUS and os.listdir(out) == [".prepare.lock"]

    # Without the lock link: a run that stops after its shards is resumed over planted temp files.
    (out / ".prepare.lock").unlink()
    done = _prepare(corpus, "--out", out, "--shard-documents", "1", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    last = manifest["shards"].pop()
    manifest.update(documents=manifest["documents"] - last["documents"], complete=False,
                    tokens=manifest["tokens"] - last["tokens"])
    (out / "manifest.json").write_text(json.dumps(manifest))
    victims = {}
    for suffix in (".bin", ".idx"):
        (out / f"{last['name']}{suffix}").unlink()
        victims[suffix] = _victim(tmp_path, f"victim{suffix}")
        (out / f"{last['name']}{suffix}.tmp").symlink_to(victims[suffix])
    (out / "verified.json").unlink()
    resumed = _prepare(corpus, "--out", out, "--shard-documents", "1", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert all(v.read_text() == PRECIOUS for v in victims.values())
    for suffix in (".bin", ".idx"):
        written = out / f"{last['name']}{suffix}"
        assert written.is_file() and not written.is_symlink()
    assert not [p for p in os.listdir(out) if p.endswith(".tmp")]


def test_a_fifo_is_skipped_and_an_oversized_document_refused(tmp_path):
    corpus = _corpus(tmp_path)
    os.mkfifo(corpus / "doc9.txt")  # a reader of it waits for a writer that never comes
    done = _prepare(corpus, "--out", tmp_path / "out", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "skipped 1 file(s) that are not regular files" in done.stderr
    assert str(corpus / "doc9.txt") in done.stderr
    assert "4 documents" in done.stdout and "1 special file(s)" in done.stdout

    named = _prepare(corpus / "doc9.txt", "--out", tmp_path / "out2", cwd=tmp_path)
    assert named.returncode == 2 and "is not a regular file (a FIFO, socket or device)" in named.stderr
    assert not (tmp_path / "out2").exists()

    big = tmp_path / "big.jsonl"
    with open(big, "w") as f:
        f.write("\n" + json.dumps({"text": "x" * (3 << 20)}) + "\n" + json.dumps({"text": "ok"}) + "\n")
    refused = _prepare(big, "--out", tmp_path / "out3", "--max-document-mb", "1", cwd=tmp_path)
    assert refused.returncode == 2, refused.stderr
    assert (f"{big} line 2 is larger than the 1 MiB one document may hold (--max-document-mb); "
            "split that record, or raise --max-document-mb") in refused.stderr
    assert "Traceback" not in refused.stderr and not (tmp_path / "out3").exists()
