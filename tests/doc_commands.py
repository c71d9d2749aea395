"""The shell commands of the docs, as argv lists: what tests/test_docs.py checks and the e2e suite runs."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

VLLM_SERVER = ["python3", "-m", "vllm.entrypoints.openai.api_server"]


def shell_commands(path: Path) -> list[tuple[str, list[str]]]:
    """(line as written, argv) of every command in the file's ```sh blocks."""
    out, block, pending = [], None, ""
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            block = line[3:].strip() if block is None else None
            continue
        if block != "sh":
            continue
        pending += line.rstrip("\\").strip() + " "
        if line.endswith("\\"):
            continue
        # Leading environment assignments (`VAR=value`, `VAR=$(command)`) belong to the shell, not the command.
        text = re.sub(r"^(\s*[A-Z_][A-Z0-9_]*=(\$\([^)]*\)|\S*)\s+)+", "", pending)
        argv = shlex.split(text, comments=True)
        if argv:
            out.append((pending.strip(), argv))
        pending = ""
    return out
