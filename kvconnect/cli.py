"""The `kvconnect` command: `bench <name>`, `demo`, `doctor` and `proxy` (each module loaded only when asked for)."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

# name -> module with `add_arguments(parser)` and `run(args) -> int`. Modules are imported lazily so
# that `kvconnect bench descriptors` does not pay for importing a transport library.
BENCHES: dict[str, str] = {
    "descriptors": "kvconnect.bench.descriptors",
    "handshake": "kvconnect.bench.handshake",
    "offload": "kvconnect.bench.offload",
    "transfer": "kvconnect.bench.transfer",
}
COMMANDS: dict[str, str] = {
    "demo": "kvconnect.demo",
    "doctor": "kvconnect.doctor",
    "proxy": "kvconnect.proxy.command",
}


def _add_commands(sub: argparse._SubParsersAction, table: dict[str, str]) -> None:
    for name, module in table.items():
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:  # a missing dependency inside the module is a real error
                raise
            continue
        p = sub.add_parser(name, help=(mod.__doc__ or "").strip().splitlines()[0])
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvconnect", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="measure kvconnect against a baseline run in the same process")
    _add_commands(bench.add_subparsers(dest="bench", required=True), BENCHES)
    _add_commands(sub, COMMANDS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `kvconnect` console script."""
    args = _build_parser().parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
