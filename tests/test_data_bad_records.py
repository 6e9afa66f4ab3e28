"""Bad records do not stop `data prepare` or `tokenizer train`: a lone surrogate escape and
invalid UTF-8 (in jsonl and in text files) become U+FFFD and are counted, naming the first file
and line; --strict refuses them naming file and line. `data prepare` locks its --out, and never
reads its own output back as input (walked into, matched by a glob, or named)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

import longrun.data.prepare as prepare_module
from longrun.data.errors import DataError
from longrun.data.out_lock import LOCK_FILE
from longrun.data.prepare import prepare, run_prepare
from longrun.data.shards import TokenShards, read_manifest
from longrun.data.sources import SNIFF_BYTES

REPLACED = "\ufffd".encode()
WAIT_S = 60  # a backstop: every wait below ends on an event


def tokens(out: Path) -> list[bytes]:
    """The documents of a byte-tokenised directory, as bytes."""
    shards = TokenShards(out)
    return [bytes(shards.read(i, 0, int(n)).tolist()) for i, n in enumerate(shards.lengths)]


@pytest.fixture
def bad(tmp_path) -> dict[str, Path]:
    """jsonl with a lone surrogate escape (line 2) and invalid UTF-8 (line 3); a text file whose
    invalid byte lies past the binary sniff, on its line 4."""
    jsonl = tmp_path / "scraped.jsonl"
    jsonl.write_bytes(b'{"text": "fine"}\n'
                      b'{"text": "half a pair \\ud800 here, a whole one \\ud83d\\ude00 there"}\n'
                      b'{"text": "latin-1 caf\xe9 and \xff\xfe twice, a real \xef\xbf\xbd kept"}\n')
    text = tmp_path / "notes.txt"
    text.write_bytes(b"a" * SNIFF_BYTES + b"\n\n\nline four \xc3(\n")
    return {"jsonl": jsonl, "text": text}


def test_lone_surrogates_and_invalid_utf8_are_replaced_and_counted(bad, tmp_path):
    manifest = prepare([str(bad["jsonl"]), str(bad["text"])], "byte", str(tmp_path / "out"), workers=0,
                       progress=False)
    docs = tokens(tmp_path / "out")
    assert docs[0] == b"fine"
    assert docs[1] == "half a pair \ufffd here, a whole one \U0001f600 there".encode()
    # One U+FFFD per invalid sequence (\xe9, then \xff and \xfe); the input's own U+FFFD stays.
    assert docs[2] == (b"latin-1 caf" + REPLACED + b" and " + REPLACED * 2 + b" twice, a real "
                       + REPLACED + b" kept")
    assert docs[3].endswith(b"line four " + REPLACED + b"(\n")
    assert manifest["replaced"] == {"characters": 5, "documents": 3, "first": f"{bad['jsonl']} line 2"}


def test_workers_see_clean_text_too(bad, tmp_path):
    # The crash was in the encoding worker; with workers, the replaced text is what they encode.
    prepare([str(bad["jsonl"])], "byte", str(tmp_path / "w1"), workers=1, progress=False)
    prepare([str(bad["jsonl"])], "byte", str(tmp_path / "w0"), workers=0, progress=False)
    assert tokens(tmp_path / "w1") == tokens(tmp_path / "w0")


def test_the_cli_reports_what_was_replaced(bad, tmp_path, cli):
    code, out, err = cli("data", "prepare", bad["jsonl"], "--tokenizer", "byte", "--out", tmp_path / "out",
                         "--workers", "0", "--no-progress")
    assert code == 0, err
    assert (f"replaced 4 invalid character(s) with U+FFFD in 2 document(s) (first: {bad['jsonl']} line 2)"
            in err)
    code, out, _ = cli("data", "inspect", tmp_path / "out")
    assert code == 0 and "replaced 4 invalid character(s)" in out


@pytest.mark.parametrize(("which", "content", "message"), [
    ("jsonl", b'{"text": "ok"}\n{"text": "x \\udc80 y"}\n', "line 2: a lone surrogate U+DC80"),
    ("jsonl", b'{"text": "ok"}\n\n{"text": "x \xff y"}\n', "line 3: invalid UTF-8 (byte 0xff)"),
    ("txt", b"b" * SNIFF_BYTES + b"\nsecond \x80\n", "line 2: invalid UTF-8 (byte 0x80)"),
])
def test_strict_refuses_naming_the_file_and_line(tmp_path, cli, which, content, message):
    path = tmp_path / f"input.{which}"
    path.write_bytes(content)
    code, _, err = cli("data", "prepare", path, "--tokenizer", "byte", "--out", tmp_path / "out",
                       "--workers", "0", "--no-progress", "--strict")
    assert code == 2 and "Traceback" not in err
    assert f"{path} {message}" in err and "leave out --strict" in err
    assert read_manifest(tmp_path / "out") is None or not read_manifest(tmp_path / "out")["complete"]


def test_tokenizer_train_applies_the_same_policy(bad, tmp_path, cli):
    code, _, err = cli("tokenizer", "train", bad["jsonl"], "--vocab-size", "270", "--out", tmp_path / "tok",
                       "--no-progress")
    assert code == 0, err
    assert (f"replaced 4 invalid character(s) with U+FFFD in 2 document(s) (first: {bad['jsonl']} line 2)"
            in err)
    code, _, err = cli("tokenizer", "train", bad["jsonl"], "--vocab-size", "270", "--out", tmp_path / "tok2",
                       "--no-progress", "--strict")
    assert code == 2 and f"{bad['jsonl']} line 2: a lone surrogate U+D800" in err
    assert not (tmp_path / "tok2" / "tokenizer.json").exists()


def test_a_second_prepare_on_the_same_out_is_refused_while_the_first_runs(tmp_path, monkeypatch):
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(8)))
    out = tmp_path / "out"
    holding, release = threading.Event(), threading.Event()
    calls = []
    real = prepare_module.iter_documents

    def first_run_pauses(*args, **kwargs):
        """The first run stops after its first document (it holds the lock by then) until let go."""
        calls.append(1)
        docs = real(*args, **kwargs)
        yield next(docs)
        if len(calls) == 1:
            holding.set()
            release.wait(WAIT_S)
        yield from docs

    monkeypatch.setattr(prepare_module, "iter_documents", first_run_pauses)
    result: list[object] = []

    def first() -> None:
        try:
            result.append(run_prepare([str(tmp_path / "docs.jsonl")], "byte", str(out), workers=0,
                                      progress=False))
        except BaseException as exc:  # handed to the test
            result.append(exc)
        finally:
            holding.set()

    thread = threading.Thread(target=first, daemon=True)
    thread.start()
    try:
        assert holding.wait(WAIT_S)
        with pytest.raises(DataError, match=r"another `longrun data prepare` \(pid \d+ on .+\) is writing"):
            run_prepare([str(tmp_path / "docs.jsonl")], "byte", str(out), workers=0, progress=False)
    finally:
        release.set()
        thread.join(WAIT_S)
    assert not thread.is_alive() and result[0].manifest["complete"], result
    assert not (out / LOCK_FILE).exists()  # a clean exit removes it
    again = run_prepare([str(tmp_path / "docs.jsonl")], "byte", str(out), workers=0, progress=False)
    assert again.documents == 0 and again.manifest["documents"] == 8


def test_an_output_inside_an_input_glob_is_not_read_back(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(4):
        (corpus / f"doc{i}.txt").write_text(f"document {i}\n")
    out = corpus / "prepared"
    glob = str(corpus / "**")  # matches out's files once they exist
    first = run_prepare([glob], "byte", str(out), workers=0, progress=False, shard_documents=1)
    assert first.manifest["inputs"]["files"] == 4
    # The rerun sees the same inputs: out's manifest and shards are not documents.
    again = run_prepare([glob], "byte", str(out), workers=0, progress=False, shard_documents=1)
    assert again.resumed_shards == 4 and again.documents == 0


def test_a_named_input_inside_the_output_is_refused(tmp_path):
    (tmp_path / "a.txt").write_text("text")
    out = tmp_path / "out"
    prepare([str(tmp_path / "a.txt")], "byte", str(out), workers=0, progress=False)
    with pytest.raises(DataError, match="is inside the output directory"):
        prepare([str(tmp_path / "a.txt"), str(out / "manifest.json")], "byte", str(out), workers=0,
                progress=False)
