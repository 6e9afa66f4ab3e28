"""`longrun checkpoint list|inspect|export`: read a checkpoint root, change nothing under it."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.table import Table
from rich_argparse import RichHelpFormatter

from longrun.cli.common import console, out, print_json, shown, size, when
from longrun.config import load_config


def add_parsers(sub) -> None:
    ckpt = sub.add_parser("checkpoint", formatter_class=RichHelpFormatter,
                          help="list, inspect, verify or export the checkpoints of a job",
                          description="Read a checkpoint root (any fsspec URL: a path, s3://..., "
                          "memory://...); nothing under it is changed.")
    ckpt.set_defaults(errors=checkpoint_errors)
    ckpt_sub = ckpt.add_subparsers(dest="checkpoint_command", metavar="ACTION", required=True)

    def action(name: str, func, summary: str, description: str) -> argparse.ArgumentParser:
        p = ckpt_sub.add_parser(name, formatter_class=RichHelpFormatter, help=summary,
                                description=description)
        p.add_argument("dir", nargs="?", metavar="DIR",
                       help="the checkpoint root (step-NNNNNNNN/ directories and `latest`)")
        p.add_argument("--config", type=Path, metavar="JOB.yaml",
                       help="take the root from a job config (its checkpoint.dir) instead of DIR")
        p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a value of --config, e.g. --set job.output_dir=/data/runs")
        p.set_defaults(func=func, parser=p)
        return p

    ls = action("list", cmd_checkpoint_list, "the committed steps, and saves in progress",
                "List the committed checkpoints (step, time, size, shards, layout; the one `latest` "
                "names is marked) and the step-N.tmp directories of saves in progress or abandoned. "
                "Exit 2 if there are none.")
    ls.add_argument("--json", action="store_true", help="print JSON instead of a table")

    inspect = action("inspect", cmd_checkpoint_inspect,
                     "one checkpoint: manifest, model config, parameter count; --verify its shards",
                     "Show a committed checkpoint: its manifest, the model config it was trained "
                     "with and the parameter count of its weights. --verify re-hashes every shard "
                     "against the manifest's checksum (exit 1 if any is corrupt or missing).")
    inspect.add_argument("--step", type=int, help="the step (default: the newest committed)")
    inspect.add_argument("--verify", action="store_true", help="re-check every shard's checksum")
    inspect.add_argument("--json", action="store_true", help="print JSON instead of tables")

    export = action("export", cmd_checkpoint_export,
                    "write the model weights to one file (safetensors or torch), or a Hugging "
                    "Face model directory (hf)",
                    "Write the model state_dict of a committed checkpoint to one file that loads "
                    "without longrun: safetensors (model config and step in its metadata) or a "
                    "torch.save file; or, with --format hf, a directory that transformers' "
                    "AutoModelForCausalLM.from_pretrained loads as a LlamaForCausalLM (config.json, "
                    "model.safetensors, and the tokenizer's files). The shard's checksum is "
                    "verified first.")
    export.add_argument("--out", required=True, metavar="FILE",
                        help="the file to write (a path or fsspec URL); .safetensors or .pt; "
                        "with --format hf a local directory")
    export.add_argument("--step", type=int, help="the step (default: the newest committed)")
    export.add_argument("--format", choices=("safetensors", "torch", "hf"),
                        help="default: from the extension of --out")
    export.add_argument("--tokenizer", metavar="PATH",
                        help="--format hf: the job's tokenizer (tokenizer.json or its directory, "
                        "or 'byte'), whose files and special token ids go with the model; default: "
                        "the one the checkpoint records (the job's data.tokenizer)")
    export.add_argument("--force", action="store_true", help="replace --out if it exists")


def _checkpoint_root(args) -> str:
    if (args.dir is None) == (args.config is None):
        args.parser.error("give the checkpoint root as DIR, or a job config with --config (not both)")
    if args.config is None:
        if args.overrides:
            args.parser.error("--set applies to --config")
        return args.dir
    return load_config(args.config, args.overrides).checkpoint_dir


def cmd_checkpoint_list(args) -> int:
    from longrun.checkpoint.catalog import list_checkpoints

    listing = list_checkpoints(_checkpoint_root(args))
    if args.json:
        print_json(listing.to_json())
    else:
        table = Table(title=f"checkpoints in {shown(listing.root)}")
        for col in ("step", "created", "size", "shards", "world/dp", "latest"):
            table.add_column(col, justify="right" if col in ("step", "size", "shards") else "left")
        for e in listing.steps:
            if e.error:
                table.add_row(str(e.step), f"[red]unreadable manifest[/]: {shown(e.error)}", "", "", "", "")
                continue
            table.add_row(str(e.step), when(e.created_unix), size(e.total_bytes), str(e.shards),
                          f"{e.world_size}/{e.dp_size}", "[green]<- latest[/]" if e.latest else "")
        if listing.steps:
            out.print(table)
        for p in listing.pending:
            out.print(f"[yellow]in progress or abandoned[/]: {shown(p.path)} ({p.files} files, "
                      f"{size(p.total_bytes)}; not a checkpoint until committed)", highlight=False)
        if listing.latest_problem:
            out.print(f"[yellow]note[/]: {shown(listing.latest_problem)}", highlight=False)
    if not listing.steps:
        console.print(f"[red]error[/]: no committed checkpoint under {shown(listing.root)} "
                      f"(only {len(listing.pending)} save(s) in progress or abandoned)", highlight=False)
        return 2
    return 0


def _key_values(rows, title: str | None = None) -> Table:
    table = Table(title=title, show_header=False, box=None, title_justify="left", padding=(0, 2, 0, 2))
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    for key, value in rows:  # a manifest's keys and values: text, not markup
        table.add_row(shown(key), shown(value))
    return table


def cmd_checkpoint_inspect(args) -> int:
    from longrun.checkpoint.catalog import inspect_checkpoint

    result = inspect_checkpoint(_checkpoint_root(args), args.step, verify=args.verify)
    failed = bool(result.corrupt) or result.weights_error is not None
    if args.json:
        print_json(result.to_json())
        return 1 if failed else 0
    m = result.manifest
    out.print(f"[bold]{shown(result.path)}[/]" + (" [green](latest)[/]" if result.latest else ""),
              highlight=False)
    out.print(_key_values([
        ("step", str(m.step)),
        ("created", when(m.created_unix)),
        ("layout", f"{m.world_size} rank(s), replica groups of {m.dp_size}"
                   + (": " + " x ".join(f"{k} {v}" for k, v in m.layout.items()) if m.layout else "")),
        ("fingerprint", m.config_fingerprint),
        ("format", str(m.format)),
        ("files", f"{len(m.files)}, {size(sum(f.bytes for f in m.files.values()))}: "
                  + ", ".join(sorted(m.files))),
    ]))
    out.print(_key_values([(k, json.dumps(v)) for k, v in m.model.items()], title="model"))
    if m.identity is not None:  # what a resume must not change unsaid (config/identity.py)
        out.print(_key_values([(k, json.dumps(v)) for k, v in m.identity.items()], title="trained with"))
    _print_weights(result)
    if result.checks is not None:
        _print_checks(result)
    return 1 if failed else 0


def _print_weights(result) -> None:
    w = result.weights
    if w is None:
        out.print(f"[red]weights unreadable[/]: {shown(result.weights_error)}", highlight=False)
        return
    dtypes = shown(", ".join(sorted(w.dtypes)))
    tied = f"; tied: {shown(' = '.join(w.tied))}" if w.tied else ""
    out.print(f"[bold]parameters[/]: {w.parameters:,} ({w.tensors} tensors, {dtypes}, "
              f"{size(w.bytes)}{tied})", highlight=False)


def _print_checks(result) -> None:
    table = Table(title="verify")
    for col in ("file", "bytes", "status", "detail"):
        table.add_column(col, justify="right" if col == "bytes" else "left")
    for c in result.checks:
        status = f"[green]{c.status}[/]" if c.status == "OK" else f"[red]{c.status}[/]"
        table.add_row(shown(c.name), f"{c.bytes:,}", status, shown(c.detail))
    out.print(table)
    if result.corrupt:
        out.print(f"[red]CORRUPT[/]: {len(result.corrupt)} of {len(result.checks)} shards do not "
                  f"match the manifest: {shown(', '.join(result.corrupt))}", highlight=False)
    else:
        out.print(f"[green]all {len(result.checks)} shards OK[/]")


def cmd_checkpoint_export(args) -> int:
    from longrun.interop.export import export_weights

    root = _checkpoint_root(args)
    tokenizer = args.tokenizer
    if tokenizer is not None and args.format != "hf":
        args.parser.error("--tokenizer goes with --format hf")
    with console.status(f"exporting the model weights of {root} to {args.out}"):
        result = export_weights(root, args.out, step=args.step, fmt=args.format,
                                overwrite=args.force, tokenizer=tokenizer)
    out.print(f"[green]wrote[/] {shown(result.out)} ({result.format}, {size(result.bytes)}): "
              f"{result.parameters:,} parameters in {result.tensors} tensors from {shown(result.source)}",
              highlight=False)
    return 0


def checkpoint_errors(exc: Exception) -> int | None:
    """Exit 2 for a wrong request (no such directory or step, bad --out), 1 for a checkpoint
    that cannot be read (corrupt shard, bad manifest, a link or FIFO in a file's place); None
    for anything else."""
    from longrun.checkpoint import CorruptShardError, ManifestError
    from longrun.checkpoint.catalog import CheckpointNotFound
    from longrun.interop.export import ExportError
    from longrun.safe_files import UnsafePath

    if isinstance(exc, CheckpointNotFound | ExportError):
        console.print(f"[red]error[/]: {shown(exc, newlines=True)}", highlight=False)
        return 2
    if isinstance(exc, CorruptShardError | ManifestError | UnsafePath):  # UnsafePath: `latest`
        console.print(f"[red]error[/]: {shown(exc, newlines=True)}", highlight=False)
        return 1
    return None
