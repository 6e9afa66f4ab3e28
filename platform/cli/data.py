"""`longrun data prepare|inspect` and `longrun tokenizer train`: real data in, torch-free.

    longrun tokenizer train corpus/ --vocab-size 8192 --out runs/tok
    longrun data prepare corpus/ web.jsonl books.parquet --tokenizer runs/tok --out data/mix1
    longrun data inspect data/mix1 --verify

Bad text in a record (invalid UTF-8, a lone surrogate escape) is replaced with U+FFFD and
counted in the summary, naming the first file and line; --strict refuses it instead.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.table import Table
from rich_argparse import RichHelpFormatter

from longrun.cli.common import console, out, print_json, shown, size


def add_parsers(sub) -> None:
    data = sub.add_parser("data", formatter_class=RichHelpFormatter,
                          help="tokenise text, jsonl or parquet into token shards; inspect them",
                          description="Prepare training data once, before training: documents are "
                          "tokenised in worker processes into memory-mapped token shards that a job "
                          "reads with data.source: tokens.")
    data.set_defaults(errors=data_errors)
    data_sub = data.add_subparsers(dest="data_command", metavar="ACTION", required=True)

    prepare = data_sub.add_parser(
        "prepare", formatter_class=RichHelpFormatter, help="tokenise inputs into token shards",
        description="Tokenise directories of text files, .jsonl and .parquet files into DIR "
        "(shard-NNNNN.bin/.idx and manifest.json). Interrupted? Rerun the same command: finished "
        "shards are verified and kept, the rest is done again; the result is byte-identical.")
    prepare.add_argument("inputs", nargs="+", metavar="INPUT",
                         help="a directory (walked recursively), a text/.jsonl/.parquet file, or a glob")
    prepare.add_argument("--tokenizer", required=True, metavar="DIR|byte",
                         help="a tokenizer.json, a directory holding one, or 'byte'")
    prepare.add_argument("--out", required=True, metavar="DIR", help="the directory of the shards")
    prepare.add_argument("--workers", type=int, default=2, metavar="N",
                         help="tokenising processes (default 2; 0: in this process)")
    _reading_args(prepare)
    prepare.add_argument("--shard-documents", type=int, metavar="N",
                         help="close a shard after N documents (default: by tokens only)")
    prepare.add_argument("--shard-tokens", type=int, metavar="N",
                         help="close a shard once it holds N tokens (default 134217728)")
    prepare.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    prepare.set_defaults(func=cmd_data_prepare)

    inspect = data_sub.add_parser(
        "inspect", formatter_class=RichHelpFormatter, help="what a prepared directory holds",
        description="Show a prepared directory's tokenizer, documents, tokens and shards; --verify "
        "re-hashes every shard against the manifest (sizes are always checked) and records the "
        "directory as verified, so that training jobs opening it hash nothing.")
    inspect.add_argument("dir", metavar="DIR")
    inspect.add_argument("--verify", action="store_true",
                         help="check every shard's sha256 and record the directory as verified")
    inspect.add_argument("--json", action="store_true", help="print the manifest as JSON")
    inspect.set_defaults(func=cmd_data_inspect)

    tokenizer = sub.add_parser("tokenizer", formatter_class=RichHelpFormatter,
                               help="train a byte-level BPE tokenizer on local text",
                               description="Tokenizers for `data prepare` and data.tokenizer, made "
                               "offline; nothing is downloaded.")
    tokenizer.set_defaults(errors=data_errors)
    tok_sub = tokenizer.add_subparsers(dest="tokenizer_command", metavar="ACTION", required=True)
    train = tok_sub.add_parser(
        "train", formatter_class=RichHelpFormatter, help="train a byte-level BPE",
        description="Train a byte-level BPE (special tokens <s> </s> <pad> first) on the inputs, "
        "read like `data prepare` reads them, and save it in the Hugging Face layout.")
    train.add_argument("inputs", nargs="+", metavar="INPUT")
    train.add_argument("--vocab-size", type=int, required=True, metavar="N")
    train.add_argument("--out", required=True, metavar="DIR")
    _reading_args(train)
    train.add_argument("--force", action="store_true", help="replace a tokenizer already in DIR")
    train.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    train.set_defaults(func=cmd_tokenizer_train)


def _reading_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--text-column", default="text", metavar="C",
                   help="the jsonl field / parquet column with the text (default: text)")
    p.add_argument("--glob", dest="patterns", action="append", metavar="PATTERN",
                   help="file names to read inside directories, e.g. '*.py' (repeatable; default: all)")
    p.add_argument("--strict", action="store_true",
                   help="refuse invalid UTF-8 and lone surrogate escapes, naming the file and line "
                   "(default: replace each with U+FFFD and count them)")
    p.add_argument("--max-document-mb", type=float, default=256.0, metavar="MB",
                   help="the largest document read (a text file, a jsonl line); a larger one is "
                   "refused naming its file and line, never read whole (default: 256)")


def cmd_data_prepare(args) -> int:
    from longrun.data.prepare import DEFAULT_SHARD_TOKENS, run_prepare

    run = run_prepare(args.inputs, args.tokenizer, args.out, workers=args.workers,
                      shard_tokens=args.shard_tokens or DEFAULT_SHARD_TOKENS,
                      shard_documents=args.shard_documents, progress=args.progress,
                      text_column=args.text_column, patterns=args.patterns or ("*",),
                      strict=args.strict, max_document_bytes=_document_bytes(args))
    m = run.manifest
    _warn_special(run.stats)
    for name in run.redone_shards:
        console.print(f"[yellow]redone[/]: {shown(name)} failed its checksum", highlight=False)
    rate = run.tokens / run.seconds if run.seconds else 0.0
    done = (f"{run.documents:,} documents, {run.tokens:,} tokens in {run.seconds:.1f} s "
            f"({rate:,.0f} tokens/s)") if run.tokens else "nothing to do: already complete"
    out.print(f"[green]prepared[/] {shown(args.out)}: {m['documents']:,} documents, {m['tokens']:,} "
              f"tokens in {len(m['shards'])} shard(s) ({m['dtype']}); this run: {done}"
              + (f"; resumed after {run.resumed_shards} finished shard(s)" if run.resumed_shards else "")
              + _skipped(m), highlight=False)
    _warn_replaced(_replaced(m))
    return 0


def _document_bytes(args) -> int:
    return int(args.max_document_mb * (1 << 20))


def _warn_special(stats) -> None:
    if summary := stats.special_summary():
        console.print(f"[yellow]warning[/]: {shown(summary)}", highlight=False)


def _replaced(manifest: dict) -> str:
    from longrun.data.sources import SourceStats

    r = manifest.get("replaced") or {}
    return SourceStats(replaced_characters=r.get("characters", 0), replaced_documents=r.get("documents", 0),
                       first_replaced=r.get("first")).summary()


def _warn_replaced(summary: str) -> None:
    if summary:
        console.print(f"[yellow]warning[/]: {shown(summary)}; --strict refuses such input instead",
                      highlight=False)


def _skipped(manifest: dict) -> str:
    skipped = manifest.get("skipped") or {}
    parts = [f"{n} {what}" for what, n in (("binary file(s)", skipped.get("binary_files", 0)),
                                           ("empty document(s)", skipped.get("empty_documents", 0)),
                                           ("special file(s)", skipped.get("special_files", 0))) if n]
    return f"; skipped {', '.join(parts)}" if parts else ""


def cmd_data_inspect(args) -> int:
    from longrun.data.shards import TokenShards
    from longrun.data.verification import MARK, write_mark

    shards = TokenShards(args.dir, verify="all" if args.verify else "sizes")
    if args.verify:
        try:
            write_mark(args.dir, shards.manifest_sha256, shards.stamps, by="data inspect --verify")
        except OSError as exc:  # a read-only copy: verified all the same, jobs will hash as they read
            console.print(f"[yellow]warning[/]: could not record {shown(args.dir)} as verified "
                          f"({shown(exc)}); training jobs will hash each shard when they first read it",
                          highlight=False)
    m = shards.manifest
    if args.json:
        print_json(m)
        return 0
    t = m["tokenizer"]
    lengths = shards.lengths
    replaced = _replaced(m)
    out.print(f"[bold]{shown(args.dir)}[/]: {m['documents']:,} documents, {m['tokens']:,} tokens "
              f"({shown(m['dtype'])}); tokenizer {shown(t['kind'])}, {t['vocab_size']:,} ids, "
              f"sha256 {shown(t['sha256'])}; "
              f"document length mean {lengths.mean():,.0f}, max {lengths.max():,}"
              + _skipped(m) + (f"; {shown(replaced)}" if replaced else ""), highlight=False)
    table = Table()
    for col in ("shard", "documents", "tokens", "bytes", "bin sha256"):
        table.add_column(col, justify="right" if col in ("documents", "tokens", "bytes") else "left")
    item = 2 if m["dtype"] == "uint16" else 4
    for e in m["shards"]:
        table.add_row(shown(e["name"]), f"{e['documents']:,}", f"{e['tokens']:,}", size(e["tokens"] * item),
                      shown(e["bin_sha256"][:16]))
    out.print(table)
    if args.verify:
        out.print(f"[green]all {len(m['shards'])} shards match their sha256[/]; recorded in "
                  f"{shown(str(Path(args.dir) / MARK))}")
    return 0


def cmd_tokenizer_train(args) -> int:
    from longrun.data.sources import SourceStats
    from longrun.data.tokenizers import train_bpe

    stats = SourceStats()
    tok = train_bpe(args.inputs, args.vocab_size, args.out, progress=args.progress,
                    patterns=args.patterns or ("*",), text_column=args.text_column, overwrite=args.force,
                    strict=args.strict, stats=stats, max_document_bytes=_document_bytes(args))
    _warn_special(stats)
    _warn_replaced(stats.summary())
    out.print(f"[green]trained[/] a byte-level BPE of {tok.vocab_size:,} ids -> {shown(args.out)} "
              f"(sha256 {tok.sha256}); use it with --tokenizer {shown(args.out)} or data.tokenizer",
              highlight=False)
    return 0


def data_errors(exc: Exception) -> int | None:
    """Exit 2 with the sentence for bad input (DataError, TokenizerError); None for anything else."""
    from longrun.data.errors import DataError

    if isinstance(exc, DataError):
        console.print(f"[red]error[/]: {shown(exc, newlines=True)}", highlight=False)
        return 2
    return None
