"""Every test file runs: the suite's command (`pytest tests`, scripts/test.sh and CONTRIBUTING.md)
collects `test_*.py` files only, and imports each by its bare name (tests/ has no packages of
tests), so a test file named otherwise is silently skipped and two of the same name fail to
import. The folders are the ones CONTRIBUTING.md names, and what CI and the GPU checks name
under tests/ exists."""

import ast
import re
import subprocess
import tomllib
from collections import Counter
from pathlib import Path, PurePosixPath

ROOT = Path(__file__).resolve().parents[2]
TRACKED = subprocess.run(["git", "ls-files", "tests"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.split()
# Not test files: what the tests import (helpers, fixtures, the CUDA emulator) and pytest's own.
SUPPORT = ("tests/helpers.py", "tests/conftest.py", "tests/fixtures/", "tests/cuda_emu/")


def misplaced(paths, folders, read):
    """The problems of a tree of test files: a file with tests pytest would not collect, a test
    file outside the named folders, a name used twice."""
    problems = []
    files = [PurePosixPath(p) for p in paths if p.endswith(".py") and not p.startswith(SUPPORT)
             and not p.endswith("/conftest.py")]
    for path in files:
        tests = [node.name for node in ast.parse(read(path)).body
                 if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name.startswith(("test_", "Test"))]
        if not path.name.startswith("test_"):
            problems.append(f"{path}: not named test_*.py, so {tests or 'it'} never run")
        elif path.parent.name not in folders or path.parent.parent.name != "tests":
            problems.append(f"{path}: outside the test folders {sorted(folders)}")
    problems += [f"{name}: {count} test files of this name" for name, count in
                 Counter(p.name for p in files).items() if count > 1]
    return problems


def contributing_folders():
    text = (ROOT / "CONTRIBUTING.md").read_text()
    paragraph = text[text.index("The tests mirror the layers"):]
    paragraph = paragraph[:paragraph.index("\n\n")]
    return set(re.findall(r"`tests/(\w+)/`", paragraph)) - {"fixtures"}


def test_every_test_file_is_collected_under_a_unique_name():
    assert misplaced(TRACKED, contributing_folders(), lambda p: (ROOT / p).read_text()) == []


def test_the_command_collects_the_test_folder_with_pytests_file_names():
    pytest_options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert pytest_options["testpaths"] == ["tests"] and "python_files" not in pytest_options
    assert re.search(r"-m pytest .*\btests$", (ROOT / "scripts" / "test.sh").read_text(), re.M)


def test_the_folders_contributing_names_are_those_of_the_test_files():
    holding = {PurePosixPath(p).parent.name for p in TRACKED
               if PurePosixPath(p).name.startswith("test_") and not p.startswith(SUPPORT)}
    assert contributing_folders() == holding


def test_what_ci_and_the_gpu_checks_name_under_tests_exists():
    scripts = [ROOT / ".ci" / name for name in ("run", "cuda_build", "torch_floor")] + sorted((ROOT / "scripts").glob("*.sh"))
    missing = [f"{script.relative_to(ROOT)}: {name}" for script in scripts if script.exists()
               for name in re.findall(r"(?<![\w/])tests/[\w/*.-]*\w", script.read_text())
               if not list(ROOT.glob(name))]
    assert missing == []


def test_the_check_sees_a_skipped_file_a_stray_folder_and_a_name_twice():
    sources = {"tests/ops/check_noise.py": "def test_a():\n    pass\n", "tests/ops/test_x.py": "",
               "tests/stray/test_y.py": "", "tests/trainer/test_x.py": "", "tests/ops/conftest.py": ""}
    problems = misplaced(sources, {"ops", "trainer"}, lambda p: sources[str(p)])
    assert problems == ["tests/ops/check_noise.py: not named test_*.py, so ['test_a'] never run",
                        "tests/stray/test_y.py: outside the test folders ['ops', 'trainer']",
                        "test_x.py: 2 test files of this name"]


def test_the_gpu_commands_the_docs_give_name_phases_and_steps_gpu_checks_has():
    """A lent GPU runs a few commands of minutes: a phase or a step's TIMEOUT_ misspelt in a
    command the docs give would waste one."""
    script = (ROOT / "scripts" / "gpu_checks.sh").read_text()
    phases = set(re.findall(r"^    (\w+)\)", script, flags=re.M))
    steps = set(re.findall(r"\brun (\w+) ", script))
    docs = [ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
    commands = [(doc.name, m.group(1), m.group(2)) for doc in docs
                for m in re.finditer(r"((?:TIMEOUT_\w+=\d+ )*)bash scripts/gpu_checks\.sh((?: [\w+]+)+)",
                                     doc.read_text())]
    assert len(commands) >= 10 and {"overlap", "pipeline", "users", "test"} <= phases
    unknown = [f"{name}: {phase}" for name, _, named in commands for group in named.split()
               for phase in group.split("+") if phase not in phases]
    unknown += [f"{name}: {limit}" for name, limits, _ in commands for limit in re.findall(r"TIMEOUT_(\w+)=", limits)
                if limit not in steps]
    assert unknown == []
