"""`longrun data prepare`: text, jsonl and parquet inputs into token shards that hold exactly
what the tokenizer gives, byte-identical whatever the workers and however often it was killed;
every bad input ends with its sentence and exit code 2."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from longrun.data.errors import DataError
from longrun.data.prepare import prepare
from longrun.data.shards import FORMAT, ShardWriter, TokenShards, read_manifest, token_dtype, write_manifest
from longrun.data.tokenizers import load_tokenizer, train_bpe
from longrun.data.verification import MARK

STDLIB = Path(sysconfig.get_paths()["stdlib"])
CODE = sorted((STDLIB / "json").glob("*.py"))


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    train_bpe([str(p) for p in CODE], 300, str(out), progress=False)
    return out


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> tuple[list[str], list[str]]:
    """A directory of text files (and a binary file it must skip), a jsonl and a parquet file;
    the documents they hold, in reading order."""
    root = tmp_path_factory.mktemp("inputs")
    texts_dir = root / "texts"
    texts_dir.mkdir()
    for p in CODE:
        shutil.copy(p, texts_dir / p.name)
    (texts_dir / "image.bin").write_bytes(bytes(range(256)) * 8)
    (texts_dir / ".hidden.txt").write_text("hidden files are skipped")
    lines = [f"line {i}: " + "héllo <s> wörld " * (i % 7 + 1) for i in range(40)]
    with open(root / "docs.jsonl", "w") as f:
        for i, text in enumerate(lines):
            f.write(json.dumps({"id": i, "text": text}) + "\n")
        f.write("\n")  # blank lines are not documents
    rows = [f"row {i} " + "parquet text " * (i % 5 + 1) for i in range(30)]
    pq.write_table(pa.table({"id": list(range(30)), "text": rows}), root / "rows.parquet", row_group_size=8)
    docs = [p.read_text() for p in sorted(texts_dir.glob("*.py"))] + lines + rows
    return [str(texts_dir), str(root / "docs.jsonl"), str(root / "rows.parquet")], docs


def _files(d: Path) -> dict[str, bytes]:
    """The shards and the manifest (the verification mark records file times, which differ)."""
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.name != MARK}


def test_shards_hold_exactly_what_the_tokenizer_gives(tok_dir, inputs, tmp_path):
    paths, docs = inputs
    manifest = prepare(paths, str(tok_dir), str(tmp_path / "out"), workers=2, shard_documents=16,
                       progress=False)
    tok = load_tokenizer(str(tok_dir))
    expected = [tok.encode(d) for d in docs]
    assert manifest["complete"] and manifest["dtype"] == "uint16"
    assert manifest["documents"] == len(docs) == sum(s["documents"] for s in manifest["shards"])
    assert manifest["tokens"] == sum(map(len, expected)) == sum(s["tokens"] for s in manifest["shards"])
    assert len(manifest["shards"]) == -(-len(docs) // 16)
    assert manifest["skipped"] == {"binary_files": 1, "empty_documents": 0}
    assert manifest["tokenizer"]["sha256"] == tok.sha256
    shards = TokenShards(str(tmp_path / "out"))
    assert shards.lengths.tolist() == [len(e) for e in expected]
    for i in (0, len(CODE), len(docs) - 1):
        assert shards.read(i, 0, len(expected[i])).tolist() == expected[i]
    assert shards.read(3, 5, 9).tolist() == expected[3][5:9]
    assert tok.decode(shards.read(len(CODE), 0, int(shards.lengths[len(CODE)]))) == docs[len(CODE)]


def test_one_and_two_workers_and_token_sized_shards_give_identical_bytes(tok_dir, inputs, tmp_path):
    paths, _ = inputs
    for workers in (1, 2):
        prepare(paths, str(tok_dir), str(tmp_path / f"w{workers}"), workers=workers, shard_tokens=5000,
                progress=False)
    one, two = _files(tmp_path / "w1"), _files(tmp_path / "w2")
    assert one == two
    manifest = json.loads(one["manifest.json"])
    assert len(manifest["shards"]) > 3
    # Each shard closes with the document that reaches 5000 tokens, never later.
    assert all(s["tokens"] >= 5000 for s in manifest["shards"][:-1])


def _prepare_cmd(paths, tok_dir, out) -> list[str]:
    return [sys.executable, "-m", "longrun.cli", "data", "prepare", *paths, "--tokenizer", str(tok_dir),
            "--out", str(out), "--workers", "2", "--shard-documents", "1", "--no-progress"]


def test_sigkilled_prepare_rerun_is_byte_identical_to_an_uninterrupted_one(tok_dir, tmp_path):
    # 240 one-document shards, each fsynced: a run long enough to be caught in the middle.
    paths = [str(tmp_path / "many.jsonl")]
    with open(paths[0], "w") as f:
        for i in range(240):
            f.write(json.dumps({"text": f"document {i} " + CODE[i % len(CODE)].read_text()[:3000]}) + "\n")
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    prepare(paths, str(tok_dir), str(whole), workers=1, shard_documents=1, progress=False)

    proc = subprocess.Popen(_prepare_cmd(paths, tok_dir, killed), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        listed = 0
        while proc.poll() is None:  # poll the manifest: kill once some but not all shards are listed
            manifest = read_manifest(killed)  # replaced atomically: always whole
            listed = len(manifest["shards"]) if manifest else 0
            if listed >= 1:
                workers = psutil.Process(proc.pid).children(recursive=True)
                proc.send_signal(signal.SIGKILL)
                break
        assert proc.wait(timeout=30) == -signal.SIGKILL, proc.stderr.read().decode()
    finally:
        proc.kill()
        proc.wait()
    assert 1 <= listed < 240
    # The workers see their pipe close and exit on their own: no orphans.
    _, alive = psutil.wait_procs(workers, timeout=20)
    assert not alive
    manifest = read_manifest(killed)
    assert not manifest["complete"] and 1 <= len(manifest["shards"]) < 240

    rerun = subprocess.run(_prepare_cmd(paths, tok_dir, killed), capture_output=True, text=True, timeout=120)
    assert rerun.returncode == 0, rerun.stderr
    assert "resumed after" in rerun.stdout
    assert _files(killed) == _files(whole)


def test_a_corrupt_listed_shard_is_redone_on_resume(tok_dir, inputs, tmp_path):
    paths, _ = inputs
    out = tmp_path / "out"
    prepare(paths, str(tok_dir), str(out), workers=1, shard_documents=16, progress=False)
    good = _files(out)
    manifest = read_manifest(out)
    manifest["complete"] = False  # as if killed before the end, with shard 1 damaged on disk
    (out / "manifest.json").write_text(json.dumps(manifest))
    data = bytearray((out / "shard-00001.bin").read_bytes())
    data[10] ^= 0xFF
    (out / "shard-00001.bin").write_bytes(bytes(data))
    prepare(paths, str(tok_dir), str(out), workers=1, shard_documents=16, progress=False)
    assert _files(out) == good


def _bad_inputs(tmp_path: Path) -> dict[str, Path]:
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "blob.bin").write_bytes(b"\0\1\2" * 100)
    no_column = tmp_path / "no_column.parquet"
    pq.write_table(pa.table({"id": [1, 2], "content": ["a", "b"]}), no_column)
    no_text = tmp_path / "no_text.jsonl"
    no_text.write_text('{"text": "fine"}\n{"body": "oops", "id": 3}\n')
    return {"empty": empty, "no_column": no_column, "no_text": no_text}


@pytest.mark.parametrize(("which", "message"), [
    ("empty", "error: empty input: 1 file(s) hold no document (1 binary file(s) skipped)"),
    ("no_column", 'has no column "text" (it has: "id", "content"); set --text-column'),
    ("no_text", 'no_text.jsonl line 2 has no "text" field (it has: "body", "id")'),
])
def test_bad_inputs_end_with_their_sentence_and_exit_2(tok_dir, tmp_path, cli, which, message):
    bad = _bad_inputs(tmp_path)[which]
    code, _, err = cli("data", "prepare", bad, "--tokenizer", tok_dir, "--out", tmp_path / "out",
                    "--workers", "1")
    assert code == 2
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "out" / "manifest.json").exists() or which == "no_text"


def test_corrupt_and_truncated_shards_are_named_with_their_expected_sha256(tok_dir, inputs, tmp_path, cli):
    paths, _ = inputs
    out = tmp_path / "out"
    manifest = prepare(paths, str(tok_dir), str(out), workers=0, shard_documents=16, progress=False)
    entry = manifest["shards"][2]
    path = out / f"{entry['name']}.bin"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    TokenShards(str(out), verify="sizes")  # sizes are right: only the checksum can tell
    code, _, err = cli("data", "inspect", out, "--verify")
    assert code == 2 and "Traceback" not in err
    assert f"shard {path} is corrupt" in err and f"expected sha256 {entry['bin_sha256']}" in err
    path.write_bytes(bytes(data[:-3]))
    expected = f"{path} is truncated or corrupt.*expected sha256 {entry['bin_sha256']}"
    with pytest.raises(DataError, match=expected):
        TokenShards(str(out), verify="sizes")


def test_resume_refuses_another_tokenizer_other_inputs_or_options(tok_dir, inputs, tmp_path, cli):
    paths, _ = inputs
    out = tmp_path / "out"
    prepare(paths, str(tok_dir), str(out), workers=0, shard_documents=16, progress=False)
    before = _files(out)
    other_tok = tmp_path / "other_tok"
    train_bpe([str(p) for p in CODE[:2]], 280, str(other_tok), progress=False)
    args = ("--out", out, "--shard-documents")
    code, _, err = cli("data", "prepare", *paths, "--tokenizer", other_tok, *args, "16")
    assert code == 2 and "Traceback" not in err
    assert f"{out} was prepared with another tokenizer" in err
    assert load_tokenizer(str(tok_dir)).sha256 in err and load_tokenizer(str(other_tok)).sha256 in err
    code, _, err = cli("data", "prepare", *paths, "--tokenizer", tok_dir, *args, "8")
    assert code == 2 and "was prepared with --shard-documents 16, now 8" in err
    code, _, err = cli("data", "prepare", *paths[1:], "--tokenizer", tok_dir, *args, "16")
    assert code == 2 and "was prepared from other inputs" in err
    assert _files(out) == before  # nothing was touched


def test_the_byte_tokenizer_prepares_too(tmp_path):
    doc = tmp_path / "a.txt"
    doc.write_text("ünïcode bytes")
    manifest = prepare([str(doc)], "byte", str(tmp_path / "out"), workers=0, progress=False)
    assert manifest["dtype"] == "uint16" and manifest["tokenizer"]["kind"] == "byte"
    shards = TokenShards(str(tmp_path / "out"))
    assert shards.read(0, 0, int(shards.lengths[0])).tolist() == list(doc.read_bytes())


def test_a_vocabulary_past_65536_ids_is_stored_as_uint32(tmp_path):
    assert token_dtype(65536) == np.dtype("<u2") and token_dtype(65537) == np.dtype("<u4")
    writer = ShardWriter(tmp_path, 0, token_dtype(70000))
    docs = [np.array([1, 65535, 65536, 69999]), np.array([7])]
    writer.add(np.concatenate(docs), np.array([4, 1]))
    entry = writer.finish()
    write_manifest(tmp_path, {"format": FORMAT, "tokenizer": {"sha256": "x", "vocab_size": 70000},
                              "dtype": "uint32", "documents": 2, "tokens": 5, "shards": [entry],
                              "complete": True})
    shards = TokenShards(str(tmp_path))
    assert (tmp_path / "shard-00000.bin").stat().st_size == 5 * 4
    assert [shards.read(i, 0, len(d)).tolist() for i, d in enumerate(docs)] == [d.tolist() for d in docs]
    assert shards.read(0, 0, 1).dtype == np.int64


def test_an_output_inside_an_input_directory_is_not_read_back_as_input(tok_dir, tmp_path):
    from longrun.data.prepare import run_prepare

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for p in CODE:
        shutil.copy(p, corpus / p.name)
    out = corpus / "prepared"
    first = run_prepare([str(corpus)], str(tok_dir), str(out), workers=0, progress=False,
                        shard_documents=2)
    assert first.manifest["inputs"]["files"] == len(CODE)  # its own shards are not documents
    # Rerun: every shard is there and the inputs unchanged, so nothing is redone or refused.
    again = run_prepare([str(corpus)], str(tok_dir), str(out), workers=0, progress=False,
                        shard_documents=2)
    assert again.resumed_shards == len(first.manifest["shards"]) > 1 and again.documents == 0
