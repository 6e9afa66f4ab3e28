"""Tokenizers: a byte-level BPE trained offline on local text, loaded from a local file or
directory, identical to what Hugging Face's AutoTokenizer makes of the saved directory."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from longrun.cli import main
from longrun.data.tokenizers import (
    SPECIAL_TOKENS,
    BPETokenizer,
    TokenizerError,
    load_tokenizer,
    train_bpe,
)

STDLIB = Path(sysconfig.get_paths()["stdlib"])
# About 450 KB of real Python: enough for 512 merges-worth of vocabulary in a second or two.
CORPUS = sorted(str(p) for pkg in ("json", "email") for p in (STDLIB / pkg).glob("*.py"))
SAMPLES = [
    (STDLIB / "json" / "decoder.py").read_text(),
    "  two leading spaces, a tab\there, a newline\nand unicode: héllo, 日本語, emoji 🙂\n",
    "",
    "<s> is only text here </s>",
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[BPETokenizer, Path]:
    out = tmp_path_factory.mktemp("tok")
    return train_bpe(CORPUS, 512, str(out), progress=False), out


def test_trained_bpe_has_the_vocabulary_and_the_special_tokens_first(trained):
    tok, out = trained
    assert tok.vocab_size == 512
    assert (tok.BOS, tok.EOS, tok.PAD) == (0, 1, 2)
    assert sorted(p.name for p in out.iterdir()) == [
        "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    code = SAMPLES[0]
    # Merges were learned: real code takes far fewer tokens than bytes.
    assert len(tok.encode(code)) < 0.6 * len(code.encode())


@pytest.mark.parametrize("text", SAMPLES)
def test_encode_decode_round_trip(trained, text):
    tok, _ = trained
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.encode(text, bos=True, eos=True) == [tok.BOS, *ids, tok.EOS]
    assert tok.decode([tok.BOS, *ids, tok.EOS, tok.PAD]) == text  # special ids are not text
    assert tok.encode_batch([text, text]) == [ids, ids]


def test_hugging_face_reads_the_saved_directory_with_the_same_ids(trained):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok, out = trained
    for hf in (AutoTokenizer.from_pretrained(str(out)),
               PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"),
                                       split_special_tokens=True)):
        for text in SAMPLES:
            # With its defaults HF adds BOS, as every training document began with it.
            assert hf(text)["input_ids"] == tok.encode(text, bos=True)
            assert hf(text, add_special_tokens=False)["input_ids"] == tok.encode(text)
            assert hf.decode(tok.encode(text)) == text
    hf = AutoTokenizer.from_pretrained(str(out))
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (tok.BOS, tok.EOS, tok.PAD)


def test_load_from_the_directory_or_the_file_is_the_same_tokenizer(trained, tmp_path):
    tok, out = trained
    by_dir, by_file = load_tokenizer(str(out)), load_tokenizer(str(out / "tokenizer.json"))
    assert by_dir.sha256 == by_file.sha256 == tok.sha256
    assert by_dir.encode(SAMPLES[1]) == tok.encode(SAMPLES[1])
    # save() keeps the exact bytes, so the identity survives a copy.
    assert load_tokenizer(str(by_dir.save(tmp_path / "copy")[0])).sha256 == tok.sha256


def test_model_vocab_may_pad_the_tokenizer_but_not_cut_it(trained):
    tok, out = trained
    assert load_tokenizer(str(out), vocab_size=520).vocab_size == tok.vocab_size
    with pytest.raises(TokenizerError, match=r"model.vocab_size = 100 is smaller .* \(512 ids\)"):
        load_tokenizer(str(out), vocab_size=100)


def _plain_bpe(folder: Path, specials: list[str]) -> Path:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["some text " * 50], trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, show_progress=False))
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    return folder


def test_a_tokenizer_without_an_end_of_document_token_is_refused_naming_it(tmp_path):
    folder = _plain_bpe(tmp_path / "tok", ["<unk>"])
    with pytest.raises(TokenizerError, match="has no end-of-document token '</s>'"):
        load_tokenizer(str(folder))


def test_a_hugging_face_tokenizers_own_special_tokens_are_used(tmp_path):
    # GPT-2 style: one <|endoftext|> for BOS and EOS, no PAD, named in tokenizer_config.json.
    folder = _plain_bpe(tmp_path / "gpt2ish", ["<|endoftext|>"])
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|endoftext|>", "eos_token": {"content": "<|endoftext|>"}}))
    tok = load_tokenizer(str(folder))
    assert tok.BOS == tok.EOS == tok.PAD == 0
    # Llama-2 style: <s> and </s> but no <pad> and no config files: PAD falls back to EOS.
    tok = load_tokenizer(str(_plain_bpe(tmp_path / "llamaish", ["<unk>", "<s>", "</s>"])))
    assert (tok.BOS, tok.EOS, tok.PAD) == (1, 2, 2)


@pytest.mark.parametrize(("make", "message"), [
    (lambda d: d, "has no tokenizer.json"),
    (lambda d: d / "nothing-here", "no tokenizer at"),
    (lambda d: (d / "tokenizer.json").write_text("{not json") and d, "cannot load the tokenizer"),
])
def test_bad_tokenizer_paths_say_what_is_wrong(tmp_path, make, message):
    with pytest.raises(TokenizerError, match=message):
        load_tokenizer(str(make(tmp_path)))


def test_tokenizer_train_cli_trains_refuses_to_replace_and_says_why(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    out = tmp_path / "tok"
    assert main(["tokenizer", "train", *CORPUS[:3], "--vocab-size", "300", "--out", str(out),
                 "--no-progress"]) == 0
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert [config["bos_token"], config["eos_token"], config["pad_token"]] == list(SPECIAL_TOKENS)
    before = (out / "tokenizer.json").read_bytes()
    capsys.readouterr()
    assert main(["tokenizer", "train", *CORPUS[:3], "--vocab-size", "300", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "tokenizer.json exists" in err and "Traceback" not in err
    assert (out / "tokenizer.json").read_bytes() == before
    assert main(["tokenizer", "train", *CORPUS[:3], "--vocab-size", "100",
                 "--out", str(tmp_path / "t2")]) == 2
    assert "--vocab-size 100 is too small" in capsys.readouterr().err
