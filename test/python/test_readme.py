"""Every code block of the README is checked: commands run as written from the clone's root
(README order), shown files equal the files, and nothing is left unmarked. A deliberately
broken copy shows each check can fail."""

import os

import pytest

import readme_blocks
from dist_harness import HERE

ROOT = os.path.dirname(os.path.dirname(HERE))
PYTHON = os.path.join(ROOT, ".venv", "bin", "python")


def readme():
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


def test_every_block_is_marked_and_shown_files_match():
    blocks = readme_blocks.parse(readme())
    assert len(blocks) >= 8
    assert readme_blocks.check_files(blocks, ROOT) == []
    kinds = {b.kind for b in blocks}
    assert {"run", "run python", "file"} <= kinds


def test_readme_commands_run_as_written_from_the_root():
    assert os.path.exists(PYTHON), "the venv is made by `make python` (make test does it)"
    ran = 0
    for block in readme_blocks.parse(readme()):
        if block.kind not in ("run", "run python"):
            continue
        code, out = readme_blocks.run(block, ROOT, PYTHON)
        assert code == 0, f"{block.where()} failed (exit {code}):\n{block.code}\n--- output ---\n{out[-4000:]}"
        if "make demo" in block.code:
            assert "parity with 1 process: OK" in out, out[-2000:]
            assert "plan      pp=" in out and "valid" in out
        if "quickstart.py" in block.code:
            assert "step 4: loss" in out, out[-2000:]
        ran += 1
    assert ran >= 6


def test_a_broken_readme_is_caught():
    text = readme()
    # A command that no longer exists fails when run.
    broken = text.replace("build/bin/monarch-plan show gpt3.plan.json", "build/bin/monarch-plan shwo gpt3.plan.json")
    assert broken != text
    block = next(b for b in readme_blocks.parse(broken) if "shwo" in b.code)
    code, out = readme_blocks.run(block, ROOT, PYTHON, timeout=120)
    assert code != 0
    # A shown file that drifted from the file.
    drifted = text.replace("for step in range(5):", "for step in range(6):")
    assert any("differs from examples/python/quickstart.py" in p
               for p in readme_blocks.check_files(readme_blocks.parse(drifted), ROOT))
    # A block nobody marked.
    with pytest.raises(ValueError, match="without a '<!-- readme: ... -->' marker"):
        readme_blocks.parse(text + "\n```sh\nrm -rf build\n```\n")
