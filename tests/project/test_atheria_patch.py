"""The README's patch to the users' `src/pipelines/pipeline_train.py` applies with `git apply` to
their file at the commit the README names.

CI has no copy of their repository, and we keep none of their code beyond the patch's context
lines: tests/fixtures/atheria_pipeline_train.json holds the SHA-256 of each line of their file.
Every line the patch expects (context and removed) must hash to their line at that number, and
`git apply` itself must accept the patch on a stand-in file: their hashed lines where the patch
reads, placeholders elsewhere. Where their checkout is at hand (ATHERIA_CHECKOUT=/path/to/Atheria),
the record is checked against their file and the patch applied to a copy of it.
"""

import hashlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from helpers import benchmark_module

ROOT = Path(__file__).resolve().parents[2]
RECORD = json.loads((ROOT / "tests" / "fixtures" / "atheria_pipeline_train.json").read_text())
HUNK = re.compile(r"^@@ -(\d+),(\d+) \+(\d+),(\d+) @@")
needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def readme_patch() -> str:
    return benchmark_module("common").readme_patch(RECORD["path"])


def hunks(patch: str):
    """(old start, [(tag, text)]) per hunk; tag ' ' context (a blank line too), '-' removed, '+' added."""
    found = []
    for line in patch.splitlines()[2:]:
        header = HUNK.match(line)
        if header:
            found.append((int(header.group(1)), int(header.group(2)), int(header.group(4)), []))
        else:
            found[-1][3].append((line[:1] or " ", line[1:]))
    for start, old_count, new_count, body in found:
        assert sum(tag != "+" for tag, _ in body) == old_count and sum(tag != "-" for tag, _ in body) == new_count
    return [(start, body) for start, _, _, body in found]


def line_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def test_the_readme_names_the_commit_the_patch_was_made_for():
    readme = (ROOT / "README.md").read_text()
    assert f"Jonakss/Atheria` at `{RECORD['commit'][:7]}`" in readme


def test_the_patch_reads_their_lines_where_they_are():
    for start, body in hunks(readme_patch()):
        expected = [text for tag, text in body if tag != "+"]
        recorded = RECORD["line_sha256"][start - 1:start - 1 + len(expected)]
        assert [line_hash(text) for text in expected] == recorded, f"the hunk at line {start}"


ENABLE = "        qca_lowmem.enable_from_config(trainer, exp_cfg)"
# V4 builds a new model on the CPU whatever the device (their engine keeps it where it was made);
# the pipeline's own `model_operator` names it for every engine, None where there is none.
TO_DEVICE = ["        if model_operator is not None:", "            model_operator.to(device)"]


def test_the_patch_adds_the_import_one_call_per_trainer_branch_and_the_v4_model_to_the_device():
    added = [(body, i) for _, body in hunks(readme_patch()) for i, (tag, _) in enumerate(body) if tag == "+"]
    assert [body[i][1] for body, i in added] == ["import qca_lowmem", *TO_DEVICE, ENABLE, ENABLE]
    added = [(body, i) for body, i in added if body[i][1] == ENABLE]
    for body, i in added:  # in the block of the line it comes before: their trainer's loop
        assert body[i + 1][1].startswith("        trainer.run_training_loop()") or \
            body[i + 1][1].startswith("        _run_v4_training_loop(trainer, exp_cfg)")


def apply(patch: str, root: Path, *flags):
    (root / "change.patch").write_text(patch)
    return subprocess.run(["git", "apply", *flags, "change.patch"], cwd=root, capture_output=True, text=True)


@needs_git
def test_git_applies_the_patch_where_their_lines_are(tmp_path):
    """git's own reading of the patch (headers, counts, blank context lines) on a stand-in for their
    file: the patch's own expected lines at their numbers (their hashes checked above), the rest
    placeholders that match nothing."""
    lines = [f"# their line {n}" for n in range(1, len(RECORD["line_sha256"]) + 1)]
    for start, body in hunks(readme_patch()):
        for offset, text in enumerate(text for tag, text in body if tag != "+"):
            lines[start - 1 + offset] = text
    target = tmp_path / RECORD["path"]
    target.parent.mkdir(parents=True)
    target.write_text("\n".join(lines) + "\n")
    done = apply(readme_patch(), tmp_path)
    assert done.returncode == 0, done.stderr
    assert target.read_text().count("qca_lowmem.enable_from_config(trainer, exp_cfg)") == 2
    broken = readme_patch().replace(" import torch\n", " import torch  \n", 1)  # a line theirs does not have
    assert apply(broken, tmp_path, "--check").returncode != 0


CHECKOUT = os.environ.get("ATHERIA_CHECKOUT")


@needs_git
@pytest.mark.skipif(not CHECKOUT, reason="their checkout is not at hand (set ATHERIA_CHECKOUT)")
def test_the_patch_applies_to_their_file(tmp_path):
    theirs = Path(CHECKOUT) / RECORD["path"]
    data = theirs.read_bytes()
    assert hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() == RECORD["blob"], "not their file at the commit"
    assert [line_hash(line) for line in data.decode().splitlines()] == RECORD["line_sha256"]
    target = tmp_path / RECORD["path"]
    target.parent.mkdir(parents=True)
    shutil.copyfile(theirs, target)
    done = apply(readme_patch(), tmp_path)
    assert done.returncode == 0, done.stderr
    patched = target.read_text()
    compile(patched, str(target), "exec")
    # the V4 model moved after their pipeline names it, on the device it sets at the top
    v4 = patched.index("trainer = QC_Trainer_v4(**trainer_kwargs)")
    assert patched.index("device = global_cfg.get_device()") < v4 < patched.index("model_operator = getattr(", v4) \
        < patched.index(TO_DEVICE[1].strip(), v4) < patched.index("_run_v4_training_loop(trainer, exp_cfg)", v4)
