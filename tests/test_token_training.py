"""Training from prepared token shards: a BPE tokenizer trained here, shards from `data prepare`,
loss falls, resume is bitwise, mixtures hold their weights and resume, bad inputs are named.

Single process, no Ray. Most corpora here are written straight in the shard format (numpy .bin
and .idx and a manifest with sha256s) so each test controls its documents exactly; the round
trip goes through `longrun.data.prepare`.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from longrun.config import ConfigError, config_from_dict, load_config
from longrun.data.byte_tokenizer import ByteTokenizer
from longrun.data.documents import DocumentSampler, build_corpus
from longrun.data.errors import DataError
from longrun.data.mixture import MixtureSampler, build_sampler
from longrun.data.prepare import prepare
from longrun.data.shards import TokenShards
from longrun.data.tokenizers import BPETokenizer, train_bpe
from longrun.trainer import Trainer

VOCAB = 512
CORPUS_BYTES = 300_000


# --- fixtures --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def texts(tmp_path_factory) -> Path:
    """A few hundred KB of the standard library's Python files, copied (a stable input)."""
    out = tmp_path_factory.mktemp("texts")
    total = 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        size = path.stat().st_size
        if size == 0 or size > 60_000:
            continue
        shutil.copyfile(path, out / path.name)
        total += size
        if total >= CORPUS_BYTES:
            break
    return out


@pytest.fixture(scope="module")
def tokenizer(texts, tmp_path_factory) -> BPETokenizer:
    return train_bpe([str(texts)], VOCAB, str(tmp_path_factory.mktemp("tok")), progress=False)


@pytest.fixture(scope="module")
def prepared(texts, tokenizer, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("prepared") / "shards"
    prepare([str(texts)], str(Path(tokenizer.path).parent), str(out), workers=0, progress=False,
            shard_tokens=40_000)  # several shards
    return out


def write_prepared(out: Path, docs: list[np.ndarray], *, sha: str, vocab_size: int = VOCAB,
                   bos: int = 0, eos: int = 1, pad: int = 2, docs_per_shard: int = 64) -> Path:
    """A prepared directory in the shard format: .bin tokens, .idx uint64 offsets, manifest."""
    out.mkdir(parents=True)
    dtype = np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")
    entries = []
    for i, first in enumerate(range(0, len(docs), docs_per_shard)):
        group = docs[first:first + docs_per_shard]
        name = f"shard-{i:05d}"
        tokens = np.concatenate(group).astype(dtype).tobytes()
        offsets = np.concatenate(([0], np.cumsum([len(d) for d in group]))).astype("<u8").tobytes()
        (out / f"{name}.bin").write_bytes(tokens)
        (out / f"{name}.idx").write_bytes(offsets)
        entries.append({"name": name, "documents": len(group), "tokens": sum(len(d) for d in group),
                        "bin_sha256": hashlib.sha256(tokens).hexdigest(),
                        "idx_sha256": hashlib.sha256(offsets).hexdigest()})
    manifest = {"format": "longrun-tokens/1",
                "tokenizer": {"sha256": sha, "vocab_size": vocab_size, "bos": bos, "eos": eos, "pad": pad,
                              "kind": "bpe"},
                "dtype": {2: "uint16", 4: "uint32"}[dtype.itemsize], "documents": len(docs),
                "tokens": sum(e["tokens"] for e in entries), "shards": entries, "complete": True}
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def random_docs(n: int, seed: int, low: int = 5, high: int = 40, vocab: int = VOCAB) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=int(rng.integers(low, high))) for _ in range(n)]


def job(data: dict, *, steps: int = 20, model: dict | None = None):
    return config_from_dict({
        "job": {"name": "bpe", "seed": 3},
        "model": {"dim": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 128} | (model or {}),
        "data": {"micro_batch_tokens": 512, "prefetch": 2} | data,
        "training": {"steps": steps, "lr": 6e-3, "warmup_steps": min(3, steps)},
    })


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def train_straight(cfg) -> tuple[list, dict[str, torch.Tensor]]:
    steps: list = []
    with Trainer(cfg, progress=False) as trainer:
        trainer.train(on_step=steps.append)
        return steps, weights(trainer)


def assert_resume_is_bitwise(cfg, at: int, expected: dict[str, torch.Tensor] | None = None) -> None:
    """Stopped after `at` steps and resumed from its state_dict, the job ends with the weights
    of an uninterrupted run (`expected`, trained here unless given)."""
    if expected is None:
        expected = train_straight(cfg)[1]
    with Trainer(cfg, progress=False) as first:
        first.train(steps=at)
        state = first.state_dict()
    with Trainer(cfg, progress=False) as second:
        second.load_state_dict(state)
        second.train()
        assert second.step == cfg.training.steps
        resumed = weights(second)
    assert expected.keys() == resumed.keys()
    for name in expected:
        assert torch.equal(expected[name], resumed[name]), name


# --- the round trip: text -> tokenizer -> prepare -> training ---------------------------------


def test_prepared_shards_hold_the_tokenised_files(texts, tokenizer, prepared):
    shards = TokenShards(str(prepared))
    files = sorted(texts.iterdir())
    assert shards.num_documents == len(files) and len(shards.manifest["shards"]) > 1
    for doc in (0, len(files) // 2, len(files) - 1):
        ids = shards.read(doc, 0, int(shards.lengths[doc]))
        assert tokenizer.decode(ids) == files[doc].read_text()


@pytest.fixture(scope="module")
def bpe_job(tokenizer, prepared):
    """Twenty steps from the prepared shards: the config, each step's metrics, the weights."""
    cfg = job({"source": "tokens", "path": str(prepared), "tokenizer": str(Path(tokenizer.path).parent)})
    return (cfg, *train_straight(cfg))


def test_training_from_shards_follows_the_tokenizer_and_the_loss_falls(tokenizer, bpe_job):
    cfg, steps, _ = bpe_job
    assert cfg.model.vocab_size == tokenizer.vocab_size == VOCAB  # followed the tokenizer
    with Trainer(cfg, progress=False) as trainer:
        assert isinstance(trainer.tokenizer, BPETokenizer)
        assert trainer.model.tok_embeddings.weight.shape[0] == VOCAB
        # Chunks open with the tokenizer's BOS and the whole documents end with its EOS.
        corpus = trainer.corpus
        assert corpus[0][0] == tokenizer.BOS
        assert corpus[len(corpus) - 1][-1] == tokenizer.EOS
    assert len(steps) == 20
    first, last = steps[0].loss, sum(m.loss for m in steps[-5:]) / 5
    assert first == pytest.approx(math.log(VOCAB), abs=0.5)  # untrained: uniform over the vocabulary
    # Twenty steps learn mostly which tokens are common: about 0.8 nats below uniform.
    assert last < first - 0.5, [round(m.loss, 3) for m in steps]


def test_training_from_shards_resumes_bitwise(bpe_job):
    cfg, _, expected = bpe_job
    assert_resume_is_bitwise(cfg, at=10, expected=expected)


def test_shards_of_a_bpe_tokenizer_train_without_naming_it(tokenizer, prepared):
    """The manifest records the tokenizer's size and special ids: enough to train on."""
    cfg = job({"source": "tokens", "path": str(prepared)}, steps=2)
    assert cfg.model.vocab_size == VOCAB
    with Trainer(cfg, progress=False) as trainer:
        assert trainer.corpus[0][0] == tokenizer.BOS
        trainer.train()


def test_shards_of_a_bpe_tokenizer_are_refused_under_the_byte_tokenizer(prepared, tmp_path):
    # Named explicitly, 'byte' is a tokenizer like any other: its ids are not these shards'.
    with pytest.raises(ConfigError, match=r"than the byte tokenizer \(data.tokenizer: byte\)"):
        job({"source": "tokens", "path": str(prepared), "tokenizer": "byte"})
    later = tmp_path / "later"  # and when the shards appear only after validation
    cfg = job({"source": "tokens", "path": str(later), "tokenizer": "byte"})
    write_prepared(later, random_docs(8, seed=4), sha="ab" * 32)
    with pytest.raises(DataError, match="prepared with another tokenizer"):
        build_corpus(cfg.data, cfg.model, ByteTokenizer(cfg.model.vocab_size), cfg.job.seed)


def test_paths_under_home_mean_the_same_everywhere(tokenizer, prepared, monkeypatch):
    monkeypatch.setenv("HOME", str(prepared.parent))
    tok_dir = Path(tokenizer.path).parent
    cfg = job({"source": "tokens", "path": f"~/{prepared.name}", "tokenizer": str(tok_dir)})
    assert cfg.data.path == str(prepared)
    with Trainer(cfg, progress=False) as trainer:  # the corpus opens at the expanded path
        assert len(trainer.corpus) > 0


# --- documents and chunks ------------------------------------------------------------------------


def test_a_document_longer_than_max_seq_len_is_split(tokenizer, tmp_path):
    docs = [np.arange(3, 13), np.arange(3, 303) % 500 + 3, np.arange(7, 133)]  # 10, 300, 126 tokens
    path = write_prepared(tmp_path / "long", docs, sha=tokenizer.sha256, docs_per_shard=2)
    cfg = job({"source": "tokens", "path": str(path), "tokenizer": tokenizer.path})
    corpus = build_corpus(cfg.data, cfg.model, tokenizer, cfg.job.seed)
    bos, eos = tokenizer.BOS, tokenizer.EOS
    # 10 + 2 fits; 300 + 2 = 128 + 128 + 46; 126 + 2 = 128 exactly.
    assert corpus.chunk_lengths.tolist() == [12, 128, 128, 46, 128]
    assert corpus[0].tolist() == [bos, *docs[0].tolist(), eos]
    long = [corpus[i] for i in (1, 2, 3)]
    assert long[0][0] == bos and long[2][-1] == eos
    assert bos not in long[1].tolist() + long[2].tolist() and eos not in long[0].tolist() + long[1].tolist()
    assert np.concatenate(long).tolist() == [bos, *docs[1].tolist(), eos]
    assert corpus[4].tolist() == [bos, *docs[2].tolist(), eos]


# --- mixtures --------------------------------------------------------------------------------------


@pytest.fixture
def two_datasets(tokenizer, tmp_path) -> tuple[Path, Path]:
    small = write_prepared(tmp_path / "small", random_docs(40, seed=1), sha=tokenizer.sha256)
    large = write_prepared(tmp_path / "large", random_docs(300, seed=2), sha=tokenizer.sha256)
    return small, large


def mixture(small: Path, large: Path, tokenizer, weights=(0.7, 0.3), **extra):
    return job({"source": "tokens", "tokenizer": tokenizer.path,
                "mix": [{"path": str(small), "weight": weights[0]},
                        {"path": str(large), "weight": weights[1]}]} | extra)


def test_mixture_proportions_follow_the_weights_and_each_dataset_its_own_permutation(
        tokenizer, two_datasets):
    cfg = mixture(*two_datasets, tokenizer)
    corpus = build_corpus(cfg.data, cfg.model, tokenizer, cfg.job.seed)
    assert corpus.part_sizes.tolist() == [40, 300]
    sampler = build_sampler(cfg.data, corpus, seed=cfg.job.seed)
    assert isinstance(sampler, MixtureSampler)
    draws = np.array([next(sampler) for _ in range(10_000)])
    from_small = draws < 40
    assert abs(from_small.mean() - 0.7) < 0.02
    assert abs((~from_small).mean() - 0.3) < 0.02
    # Over any window, not only on average: every 100 draws hold 70 +- 1 from the first dataset.
    assert all(abs(w.sum() - 70) <= 1 for w in from_small.reshape(-1, 100))
    # Each dataset goes through all of its documents once per epoch, in a seeded order.
    small_draws, large_draws = draws[from_small], draws[~from_small] - 40
    assert sorted(small_draws[:40].tolist()) == list(range(40))
    assert sorted(large_draws[:300].tolist()) == list(range(300))
    assert small_draws[:40].tolist() != list(range(40))
    assert small_draws[:40].tolist() != small_draws[40:80].tolist()  # a new permutation per epoch


def test_a_mixture_sampler_resumed_from_its_state_continues_identically(tokenizer, two_datasets):
    cfg = mixture(*two_datasets, tokenizer)
    corpus = build_corpus(cfg.data, cfg.model, tokenizer, cfg.job.seed)
    sampler = build_sampler(cfg.data, corpus, seed=cfg.job.seed)
    for _ in range(4321):
        next(sampler)
    state = sampler.state_dict()
    onward = [next(sampler) for _ in range(2000)]
    fresh = build_sampler(cfg.data, corpus, seed=cfg.job.seed)
    fresh.load_state_dict(state)
    assert [next(fresh) for _ in range(2000)] == onward
    # One mixture order for the whole job: its position names no rank, and one written by an
    # earlier longrun, one share per data-parallel rank, is refused.
    assert "dp_size" not in state and all("dp_size" not in part for part in state["parts"])
    per_rank = state | {"dp_rank": 1, "dp_size": 2}
    with pytest.raises(DataError, match="earlier longrun with per-rank data positions"):
        build_sampler(cfg.data, corpus, seed=cfg.job.seed).load_state_dict(per_rank)


def test_a_mixture_resumes_with_its_own_weights_only(tokenizer, two_datasets):
    cfg = mixture(*two_datasets, tokenizer)
    corpus = build_corpus(cfg.data, cfg.model, tokenizer, cfg.job.seed)
    state = build_sampler(cfg.data, corpus, seed=cfg.job.seed).state_dict()
    other = mixture(*two_datasets, tokenizer, weights=(0.5, 0.5))
    with pytest.raises(DataError, match=r"weights \[0\.7, 0\.3"):
        build_sampler(other.data, corpus, seed=cfg.job.seed).load_state_dict(state)
    with pytest.raises(DataError, match="mixture of 2 datasets"):
        DocumentSampler(len(corpus), seed=cfg.job.seed).load_state_dict(state)


def test_training_on_a_mixture_resumes_bitwise(tokenizer, two_datasets):
    cfg = mixture(*two_datasets, tokenizer, micro_batch_tokens=256)
    cfg.training.steps = 6
    cfg.training.warmup_steps = 2
    with Trainer(cfg, progress=False) as trainer:
        trainer.train(steps=2)
        assert trainer.state_dict()["data"]["drawn"][0] > 0
    assert_resume_is_bitwise(cfg, at=3)


# --- bad inputs: each names its problem --------------------------------------------------------


@pytest.mark.parametrize("weight", [0, -0.5])
def test_a_mixture_weight_must_be_positive(tokenizer, two_datasets, weight):
    small, large = two_datasets
    with pytest.raises(ConfigError) as err:
        mixture(small, large, tokenizer, weights=(weight, 1.0))
    message = str(err.value)
    assert "data.mix[0]" in message and str(small) in message and "positive" in message


def test_vocab_size_smaller_than_the_tokenizers_is_refused_naming_both(tokenizer, prepared):
    with pytest.raises(ConfigError) as err:
        job({"source": "tokens", "path": str(prepared), "tokenizer": tokenizer.path},
            model={"vocab_size": 300})
    message = str(err.value)
    assert "model.vocab_size" in message and "300" in message and str(VOCAB) in message
    # Larger is padding: kept.
    cfg = job({"source": "tokens", "path": str(prepared), "tokenizer": tokenizer.path},
              model={"vocab_size": 576})
    assert cfg.model.vocab_size == 576


def test_vocab_size_is_checked_against_the_shards_when_the_corpus_opens(tokenizer, tmp_path):
    # Validated before the directory exists (it may be prepared later, or elsewhere).
    path = tmp_path / "later"
    cfg = job({"source": "tokens", "path": str(path)}, model={"vocab_size": 300})
    write_prepared(path, random_docs(8, seed=4), sha=tokenizer.sha256)
    with pytest.raises(DataError, match=r"model.vocab_size = 300 is smaller .* \(512 ids\)"):
        build_corpus(cfg.data, cfg.model, ByteTokenizer(300), cfg.job.seed)


def test_shards_made_with_another_tokenizer_are_refused_naming_both(tokenizer, tmp_path):
    other = write_prepared(tmp_path / "other", random_docs(8, seed=5), sha="ab" * 32)
    with pytest.raises(ConfigError) as err:
        job({"source": "tokens", "path": str(other), "tokenizer": tokenizer.path})
    message = str(err.value)
    assert "data.tokenizer" in message and str(other) in message and tokenizer.path in message
    # The same check when the corpus opens (the shards appeared after validation).
    later = tmp_path / "later"
    cfg = job({"source": "tokens", "path": str(later), "tokenizer": tokenizer.path})
    write_prepared(later, random_docs(8, seed=5), sha="cd" * 32)
    with pytest.raises(DataError) as opened:
        build_corpus(cfg.data, cfg.model, tokenizer, cfg.job.seed)
    assert str(later) in str(opened.value) and tokenizer.path in str(opened.value)


def test_a_mixture_of_shards_from_two_tokenizers_is_refused(tmp_path):
    first = write_prepared(tmp_path / "a", random_docs(8, seed=6), sha="ab" * 32)
    second = write_prepared(tmp_path / "b", random_docs(8, seed=7), sha="cd" * 32)
    with pytest.raises(ConfigError, match="a mixture needs one tokenizer") as err:
        job({"source": "tokens",
             "mix": [{"path": str(first), "weight": 1}, {"path": str(second), "weight": 1}]})
    assert "data.mix[1].path" in str(err.value)


@pytest.mark.parametrize(("data", "needle"), [
    ({"source": "tokens"}, "needs data.path"),
    ({"source": "tokens", "path": "x", "mix": [{"path": "y", "weight": 1}]}, "not both"),
    ({"source": "text", "mix": [{"path": "y", "weight": 1}]}, "needs source 'tokens'"),
    ({"source": "tokens", "mix": []}, "data.mix is empty"),
    ({"source": "tokens", "path": "x", "tokenizer": "/no/such/tokenizer"}, "no tokenizer at"),
])
def test_bad_data_sections_are_named(data, needle):
    with pytest.raises(ConfigError, match=needle):
        job(data)


def test_the_text_source_with_a_bpe_tokenizer_says_to_prepare(tokenizer, texts):
    with pytest.raises(ConfigError, match="longrun data prepare"):
        job({"source": "text", "path": str(texts), "tokenizer": tokenizer.path})
    cfg = job({"source": "text", "path": str(texts)})  # the check at corpus time, too
    with pytest.raises(DataError, match="longrun data prepare"):
        build_corpus(cfg.data, cfg.model, tokenizer, cfg.job.seed)


def test_a_corrupted_shard_is_named_before_its_tokens_are_trained_on(tokenizer, tmp_path):
    path = write_prepared(tmp_path / "bad", random_docs(8, seed=8), sha=tokenizer.sha256)
    blob = bytearray((path / "shard-00000.bin").read_bytes())
    blob[3] ^= 0xFF
    (path / "shard-00000.bin").write_bytes(bytes(blob))
    cfg = job({"source": "tokens", "path": str(path), "tokenizer": tokenizer.path})
    # Opening hashes nothing (start-up must not grow with the data set); the shard, vouched for
    # by no verification mark, is hashed when the data thread first reads from it.
    with Trainer(cfg, progress=False) as trainer:
        with pytest.raises(DataError, match=r"shard-00000\.bin is corrupt"):
            trainer.train()
        assert trainer.step == 0


def test_the_bpe_example_trains_on_prepared_shards(repo_root, tokenizer, prepared, tmp_path):
    cfg = load_config(repo_root / "examples" / "bpe.yaml", [
        f"data.path={prepared}", f"data.tokenizer={tokenizer.path}", f"job.output_dir={tmp_path}",
        "training.steps=2", "training.warmup_steps=1"])
    assert cfg.data.source == "tokens" and cfg.model.vocab_size == VOCAB
    with Trainer(cfg, progress=False) as trainer:
        assert trainer.train().loss > 0
