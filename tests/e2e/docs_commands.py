"""Every `dtlaunch ...` command in README.md and docs/*.md, with what the text around it claims.

A command is found in a fenced code block (a line starting with `dtlaunch`, `$ dtlaunch` or `VAR=value
dtlaunch`, `\\` continuations joined) or in inline code (`` `dtlaunch ...` ``, also across a line break).
A `$ dtlaunch ...` line in a block is followed by the output the text shows (up to the next `$` line).

An HTML comment before a command says what the text cannot:

    <!-- docs-test: skip REASON -->              cannot run here, and why
    <!-- docs-test: exit=3 -->                   the exit code the prose implies
    <!-- docs-test: quotes 61.03,65.33 -->       numbers the prose quotes from this command's output
    <!-- docs-test: shows 1 1x4x1x2 1f1b -->     text the prose says the output shows (spaces collapsed)
    <!-- docs-test: file my_lm.py -->            before a code block: the block is that file, written
                                                 into the working directory before the next command
    <!-- docs-test: tiny ARGS... files=a,b -->   a training command: `dtlaunch train ARGS` stands in for
                                                 it (a real tiny run), which must write files a, b

Markers before one command add up; each applies to the next command in the same file. A
command written as a continuation (`dtlaunch plan ... KEY=VALUE`) stands for the previous command of
the same kind with those overrides added. Nothing here imports dtlaunch: extraction is plain text.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"<!--\s*docs-test:\s*(.*?)\s*-->", re.S)
INLINE = re.compile(r"`(dtlaunch [^`]+)`")
ENV_WORD = re.compile(r"[A-Z_][A-Z0-9_]*=\S*")
NUMBER = re.compile(r"\d[\d,]*\.\d+")


@dataclass
class DocCommand:
    file: str  # relative to the repository
    line: int
    text: str  # as written, without the leading `$ ` and trailing comment
    argv: list[str]  # after `dtlaunch`; [] when it cannot be split (an unbalanced quote)
    env: dict[str, str] = field(default_factory=dict)
    shown_output: list[str] = field(default_factory=list)
    markers: list[str] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)  # written into the working directory first
    in_block: bool = False

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}"

    def marker_value(self, key: str) -> str | None:
        """`key REST` or `key=REST` at the start of one of the markers."""
        for marker in self.markers:
            m = re.match(rf"{key}(?:=|\s+)(.*)$", marker, re.S)
            if m:
                return m.group(1).strip()
        return None

    def expected_exit(self) -> int:
        given = self.marker_value("exit")
        if given is not None:
            return int(given.split()[0])
        shown = "\n".join(self.shown_output)
        if "does not fit" in shown:
            return 3
        if "dtlaunch: error:" in shown:
            return 2
        return 0

    def quoted_numbers(self) -> list[str]:
        """Numbers the shown output lines quote (each line up to a `#` comment) and the marker's quotes."""
        nums = []
        for ln in self.shown_output:
            nums += NUMBER.findall(ln.split("#", 1)[0])
        given = self.marker_value("quotes")
        if given:
            nums += [n.strip() for n in given.split(",") if n.strip()]
        return nums


def doc_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def split_command(text: str) -> tuple[dict[str, str], list[str]]:
    try:
        words = shlex.split(text, comments=True)
    except ValueError:
        return {}, []
    env = {}
    while words and ENV_WORD.fullmatch(words[0]):
        k, v = words.pop(0).split("=", 1)
        env[k] = v
    if not words or words[0] != "dtlaunch":
        return env, []
    return env, words[1:]


def _strip_comment(text: str) -> str:
    """The command without a trailing shell comment (shlex drops it too; this keeps the written text)."""
    out, quote = [], None
    for i, ch in enumerate(text):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or text[i - 1].isspace()):
            break
        out.append(ch)
    return "".join(out).strip()


def extract(path: Path) -> list[DocCommand]:
    rel = str(path.relative_to(REPO))
    lines = path.read_text().splitlines()
    found: list[DocCommand] = []
    pending: list[str] = []
    files: dict[str, str] = {}

    def add(line_no: int, text: str, in_block: bool) -> DocCommand:
        nonlocal pending, files
        text = _strip_comment(text)
        env, argv = split_command(text)
        if in_block and "..." in argv[1:] and not argv[argv.index("...") - 1].startswith("-"):
            argv = _continue(found, argv)
        cmd = DocCommand(rel, line_no, text, argv, env, markers=pending, files=files, in_block=in_block)
        pending, files = [], {}
        found.append(cmd)
        return cmd

    i = 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("```"):
            lang = line.strip()[3:].strip()
            i += 1
            name = next((m.split(None, 1)[1] for m in pending if m.startswith("file ")), None)
            if name:
                pending = [m for m in pending if not m.startswith("file ")]
                end = i
                while end < len(lines) and not lines[end].lstrip().startswith("```"):
                    end += 1
                files[name] = "\n".join(lines[i:end]) + "\n"
                i = end + 1
                continue
            current: DocCommand | None = None
            while i < len(lines) and not lines[i].lstrip().startswith("```"):
                raw = lines[i].strip()
                start = i + 1
                shell_prompt = raw.startswith("$ ")
                body = raw[2:] if shell_prompt else raw
                words = body.split()
                while words and ENV_WORD.fullmatch(words[0]):
                    words.pop(0)
                if lang in ("", "bash", "sh", "console", "shell") and words[:1] == ["dtlaunch"]:
                    while body.endswith("\\") and i + 1 < len(lines):
                        i += 1
                        body = body[:-1].rstrip() + " " + lines[i].strip()
                    current = add(start, body, True)
                    if not shell_prompt:
                        current = None
                elif shell_prompt:
                    current = None
                elif current is not None and raw and raw != "...":
                    current.shown_output.append(raw)
                i += 1
            i += 1
            continue
        # A paragraph outside code: markers and inline commands in reading order (inline code may wrap).
        start = i
        para = []
        while i < len(lines) and lines[i].strip() and not lines[i].lstrip().startswith("```"):
            para.append(lines[i])
            i += 1
        if not para:
            i += 1
            continue
        text = "\n".join(para)
        for m in re.finditer(f"{MARKER.pattern}|{INLINE.pattern}", text, re.S):
            line_no = start + 1 + text[: m.start()].count("\n")
            if m.group(1) is not None:
                pending.append(m.group(1))
            else:
                add(line_no, " ".join(m.group(2).split()), False)
    return found


def _continue(found: list[DocCommand], argv: list[str]) -> list[str]:
    """`SUB A ... B` as the previous `SUB` command of the file with A and B added (a key given again
    replaces the previous value)."""
    previous = next((c for c in reversed(found) if c.argv[:1] == argv[:1] and "..." not in c.argv), None)
    if previous is None:
        return argv
    at = argv.index("...")
    before, after = argv[1:at], argv[at + 1 :]
    keys = {a.split("=", 1)[0] for a in before + after if "=" in a}
    kept = [a for a in previous.argv[1:] if a.split("=", 1)[0] not in keys and a != "--dry-run"]
    return [argv[0], *before, *kept, *after]


def all_commands() -> list[DocCommand]:
    return [c for f in doc_files() for c in extract(f)]
