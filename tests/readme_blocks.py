"""README.md's fenced code blocks, for the tests that run them (tests/test_readme.py, tests/test_serve_cli.py).

No pytest fixtures in here."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.S | re.M)
ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=.*")


@dataclass(frozen=True)
class Block:
    lang: str  # the fence's info string: bash, python, js, text
    text: str  # the block's lines, each ending in a newline
    line: int  # README line of the opening fence (1-based)

    def where(self) -> str:
        return f"README.md:{self.line} ({self.lang})"


def blocks(text: str | None = None) -> list[Block]:
    text = README.read_text() if text is None else text
    return [Block(m.group(1), m.group(2), text.count("\n", 0, m.start()) + 1) for m in FENCE.finditer(text)]


def python_client(text: str | None = None) -> str:
    """The README's Python client snippet: the one python block that makes a KVBridgeClient."""
    found = [b.text for b in blocks(text) if b.lang == "python" and "KVBridgeClient(" in b.text]
    assert len(found) == 1, f"README.md has {len(found)} python blocks with a KVBridgeClient, expected 1"
    return found[0]


def shell_commands(text: str) -> list[tuple[dict[str, str], list[str]]]:
    """A bash block's commands, one a line after backslash continuations are joined, comments dropped: (the
    VAR=value assignments before the command, its words). Quotes may not span lines here."""
    commands = []
    for line in text.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        env = {}
        while words and ASSIGNMENT.fullmatch(words[0]):
            name, _, value = words.pop(0).partition("=")
            env[name] = value
        if words:
            commands.append((env, words))
    return commands
