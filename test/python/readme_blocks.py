"""Finds every fenced code block of a README and what it is for, from the HTML comment right
above it (invisible when the README is rendered):

    <!-- readme: run -->                 shell commands: run as written, from the root
    <!-- readme: run python -->          Python: run with the venv's interpreter, from the root
    <!-- readme: file PATH -->           must equal the file PATH, character for character
    <!-- readme: fragment PATH -->       every line must appear in the file PATH
    <!-- readme: skip: REASON -->        not run, for the reason given
    <!-- readme: text -->                not code (a listing)

A block with no such comment is an error: nothing a user may paste goes unchecked."""

import os
import re
import subprocess
from dataclasses import dataclass

_MARK = re.compile(r"<!--\s*readme:\s*(.*?)\s*-->\s*$")


@dataclass
class Block:
    line: int      # 1-based line of the opening fence
    kind: str      # run, run python, file, fragment, skip, text
    arg: str       # the path, or the reason
    code: str

    def where(self):
        return f"README line {self.line}"


def parse(text):
    """Blocks in order; raises ValueError for an unmarked block or an unknown marker."""
    lines = text.split("\n")
    blocks = []
    i = 0
    while i < len(lines):
        if lines[i].startswith("```"):
            start = i
            j = i + 1
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            if j == len(lines):
                raise ValueError(f"README line {start + 1}: code block never closed")
            code = "\n".join(lines[start + 1:j]) + "\n"
            k = start - 1
            while k >= 0 and not lines[k].strip():
                k -= 1
            m = _MARK.match(lines[k].strip()) if k >= 0 else None
            if not m:
                raise ValueError(f"README line {start + 1}: code block without a '<!-- readme: ... -->' "
                                 "marker (run, run python, file PATH, fragment PATH, skip: REASON, text)")
            blocks.append(_block(start + 1, m.group(1), code))
            i = j + 1
        else:
            i += 1
    return blocks


def _block(line, marker, code):
    for kind in ("run python", "run", "text"):
        if marker == kind:
            return Block(line, kind, "", code)
    for kind in ("file", "fragment"):
        if marker.startswith(kind + " "):
            return Block(line, kind, marker[len(kind) + 1:].strip(), code)
    if marker.startswith("skip:") and marker[5:].strip():
        return Block(line, "skip", marker[5:].strip(), code)
    raise ValueError(f"README line {line}: unknown marker '{marker}'")


def check_files(blocks, root):
    """Problems with `file` and `fragment` blocks (empty when all match)."""
    problems = []
    for b in blocks:
        if b.kind not in ("file", "fragment"):
            continue
        path = os.path.join(root, b.arg)
        if not os.path.exists(path):
            problems.append(f"{b.where()}: {b.arg} does not exist")
            continue
        with open(path) as f:
            content = f.read()
        if b.kind == "file" and content != b.code:
            problems.append(f"{b.where()}: differs from {b.arg} (show the file verbatim)")
        if b.kind == "fragment":
            missing = [ln for ln in b.code.splitlines() if ln.strip() and ln.strip() not in content]
            if missing:
                problems.append(f"{b.where()}: not in {b.arg}: {missing[0]!r}")
    return problems


def run(block, root, python, timeout=900):
    """Runs a `run` / `run python` block from ``root``; returns (exit status, output)."""
    env = dict(os.environ, PYTHONPATH="")  # as a user's shell: nothing on the path but the clone
    if block.kind == "run python":
        cmd = [python, "-c", block.code]  # as pasted into the interpreter: the root is on the path
    else:
        cmd = ["bash", "-e", "-o", "pipefail", "-c", block.code]
    try:
        p = subprocess.run(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=timeout)
        return p.returncode, p.stdout
    except subprocess.TimeoutExpired as e:
        return 124, (e.stdout or "") + f"\n[timed out after {timeout} s]"
