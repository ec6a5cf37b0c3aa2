"""The ``poolkeeper`` command: ``bench | compare | replay | report | lab``.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``;
this file only dispatches, so a subcommand's imports (matplotlib, rich, ...) load only when used.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional, Sequence

COMMANDS = {
    "bench": ("poolkeeper.bench.cli_bench", "run the benchmark matrix (workloads x pools) and print a table"),
    "compare": ("poolkeeper.bench.compare", "pivot benchmark rows into direct/size_class/cuda_async vs arena ratios"),
    "replay": ("poolkeeper.bench.replay", "replay a real allocation log (RMM CSV or PyTorch snapshot) against a pool"),
    "report": ("poolkeeper.report.memory_map", "render a pool snapshot (JSON) as a self-contained HTML memory map"),
    "lab": ("poolkeeper.report.lab_page", "serve or write the queue lab page (the pending-release analogy)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="poolkeeper", description="Device memory pools for Python inference runtimes.")
    parser.add_argument("--version", action="version", version=f"poolkeeper {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        try:
            importlib.import_module(module).add_arguments(p)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
            p.set_defaults(_missing=module)
        p.set_defaults(_module=module)
    return parser


def _version() -> str:
    from poolkeeper import __version__

    return __version__


def _tolerant_output() -> None:
    """Print what cannot be encoded escaped instead of failing: a file name that is not UTF-8
    reaches Python as lone surrogates (``"\\udcff"``), and in a UTF-8 locale printing it ("wrote
    ...", the replay's heading) raised ``UnicodeEncodeError`` after the work was done."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None and getattr(stream, "errors", None) == "strict":
            try:
                reconfigure(errors="backslashreplace")
            except (ValueError, OSError):  # a closed or exotic stream: leave it as it is
                pass


def main(argv: Optional[Sequence[str]] = None) -> int:
    _tolerant_output()
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    if getattr(args, "_missing", None):
        print(f"poolkeeper {args.command}: not available in this build ({args._missing} missing)", file=sys.stderr)
        return 2
    from poolkeeper.errors import PoolkeeperError

    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except PoolkeeperError as e:
        print(f"poolkeeper {args.command}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        # A path that is not there, not a directory, not writable, a full disk (/dev/full): the
        # message says which, and a traceback would say nothing more.
        print(f"poolkeeper {args.command}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # Ctrl-C: every output is written whole or not at all (poolkeeper._paths.write_output), so
        # there is nothing to clean up and a traceback would only hide that. 130 = 128 + SIGINT.
        print(f"poolkeeper {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
