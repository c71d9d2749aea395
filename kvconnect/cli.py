"""The `kvconnect` command: demo, doctor, proxy and bench <name>; only the command asked for is imported.

A command module has `add_arguments(parser)` and `run(args) -> int`, and may have
`check_arguments(args)`, which raises UsageError for flags that are wrong together.

Exit codes: 0 success; 1 the command ran and found a failure (a byte differed, a request failed, a
backend cannot move bytes); 2 a bad command line (one line naming the flag); 3 a package or library
the command needs is missing (with the install hint); 4 the command crashed (a bug: traceback shown).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback
from dataclasses import dataclass
from typing import Any, Sequence

from kvconnect import __version__
from kvconnect.cliargs import UsageError

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_ENVIRONMENT, EXIT_ERROR = 0, 1, 2, 3, 4

# name -> (module with `add_arguments(parser)` and `run(args) -> int`, one-line help, extra that provides it)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "demo": ("kvconnect.demo", "P/D between two processes on loopback, every byte checked", "nixl"),
    "doctor": ("kvconnect.doctor", "what works on this host: backends, RDMA, CUDA, side-channel settings", ""),
    "proxy": ("kvconnect.proxy.command", "an OpenAI-compatible P/D router in front of vLLM instances", "proxy"),
}
BENCHES: dict[str, tuple[str, str, str]] = {
    "descriptors": ("kvconnect.bench.descriptors", "descriptor building beside a Python loop", ""),
    "handshake": ("kvconnect.bench.handshake", "side-channel round trips, with and without a secret", ""),
    "isolation": ("kvconnect.bench.isolation", "loads from a healthy producer beside a stopped one", "nixl"),
    "offload": ("kvconnect.bench.offload", "CPU-tier store and load beside memcpy", ""),
    "soak": ("kvconnect.bench.soak", "P/D and offload tiers under a seeded schedule of real faults", "nixl"),
    "transfer": ("kvconnect.bench.transfer", "P/D pull beside the raw backend and memcpy", "nixl"),
}


class _Parser(argparse.ArgumentParser):
    """argparse with our exit code for usage errors and one line of error text."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _table(entries: dict[str, tuple[str, str, str]], indent: int = 2) -> str:
    return "\n".join(f"{' ' * indent}{name:12s} {help_}" for name, (_, help_, _) in entries.items())


def _top_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="kvconnect", formatter_class=argparse.RawDescriptionHelpFormatter,
                description="Moves LLM KV-cache blocks between serving workers.",
                epilog=f"commands:\n{_table(COMMANDS)}\n  bench NAME   a benchmark against a baseline measured in the same "
                       f"run:\n{_table(BENCHES, 4)}\n\n"
                       "Run `kvconnect COMMAND -h` for a command's options.")
    p.add_argument("--version", action="version", version=f"kvconnect {__version__}")
    p.add_argument("command", choices=[*COMMANDS, "bench"], metavar="COMMAND", help="one of the commands below")
    p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return p


def _missing(exc: ModuleNotFoundError, extra: str) -> int:
    hint = f"pip install 'kvconnect[{extra}]'" if extra else "reinstall kvconnect"
    print(f"kvconnect: this command needs the Python package {exc.name!r}, which is not installed ({hint})",
          file=sys.stderr)
    return EXIT_ENVIRONMENT


@dataclass
class Parsed:
    """A command line resolved to its command: the module that runs it and its parsed arguments."""

    prog: str
    extra: str  # the extra that provides the command's dependencies
    module: Any = None
    args: argparse.Namespace | None = None


def _resolve(argv: Sequence[str] | None) -> tuple[Parsed, str, list[str]]:
    top = _top_parser()
    if not (sys.argv[1:] if argv is None else argv):  # a bare `kvconnect`: what it can do, not argparse's complaint
        top.print_help(sys.stderr)
        top.exit(EXIT_USAGE)
    args = top.parse_args(argv)
    rest, prog = list(args.rest), f"kvconnect {args.command}"
    entry = COMMANDS.get(args.command)
    if entry is None:  # bench NAME
        if not rest or rest[0] in ("-h", "--help"):
            print(f"usage: kvconnect bench NAME [options]\n\nbenchmarks:\n{_table(BENCHES)}")
            top.exit(EXIT_OK if rest else EXIT_USAGE)
        if rest[0] not in BENCHES:
            top.exit(EXIT_USAGE, f"kvconnect bench: error: unknown benchmark {rest[0]!r} "
                                 f"(choose from {', '.join(BENCHES)})\n")
        entry, prog, rest = BENCHES[rest[0]], f"{prog} {rest[0]}", rest[1:]
    module, help_, extra = entry
    return Parsed(prog, extra), module, [help_, *rest]


def parse(argv: Sequence[str] | None = None) -> Parsed:
    """Resolve and parse a command line without running it; SystemExit(2) when it is bad."""
    parsed, module, (help_, *rest) = _resolve(argv)
    parsed.module = importlib.import_module(module)
    parser = _Parser(prog=parsed.prog, description=help_)
    parsed.module.add_arguments(parser)
    parsed.args = parser.parse_args(rest)
    # Flags that only mean something together are judged here, so that a bad combination is a parse error too.
    check = getattr(parsed.module, "check_arguments", None)
    if check is not None:
        try:
            check(parsed.args)
        except UsageError as exc:
            parser.error(str(exc))
    return parsed


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `kvconnect` console script."""
    parsed = _resolve(argv)[0]  # usage errors of the command name exit here, with code 2
    try:
        parsed = parse(argv)
        return int(parsed.module.run(parsed.args) or EXIT_OK)
    except ModuleNotFoundError as exc:
        if (exc.name or "").startswith("kvconnect"):
            raise
        return _missing(exc, parsed.extra)
    except UsageError as exc:
        print(f"{parsed.prog}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except SystemExit:
        raise
    except Exception:  # a crash is a bug: show it, and say so in the exit code
        traceback.print_exc()
        return EXIT_ERROR

if __name__ == "__main__":
    sys.exit(main())
