"""The package as users install it, in fresh venvs made here: plain `pip install .` (build isolation
on) builds against the venv's own torch; the other frontends work or say exactly what to type; the
sdist is the only source the builds see; the wheel holds the package and uninstalls cleanly.

Two compiles: every build runs in the same unpacked sdist, reusing the first one's objects, except
the editable install (setuptools builds editables in a temporary directory)."""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TORCH_SPEC, TORCH_VERSION = "torch==2.13.0", "2.13.0+cpu"  # the CPU build the package cache holds
OLDER_SETUPTOOLS = "setuptools==80.9.0"  # >= torch's floor (77.0.3), older than the index's newest
NO_TORCH = ("qca_lowmem builds against the torch installed in your environment and found none: "
            "install torch first, then run this install again")
ISOLATED = "cannot see: install with `pip install .`, or build without isolation: `python -m build --no-isolation`"
CHECK = """
import json, torch, qca_lowmem
from qca_lowmem import _build_info
from qca_lowmem.trainer import config
psi = torch.randn(2, 3, 4, 5, dtype=torch.complex64)
stock = torch.cat([psi.real, psi.imag], dim=-1).permute(0, 3, 1, 2)
print(json.dumps({"torch": torch.__version__, "built_against": _build_info.TORCH_VERSION,
                  "file": qca_lowmem.__file__, "pack_ok": torch.equal(qca_lowmem.qca_pack(psi), stock),
                  "configs": config.bundled_configs()}))
"""
CONFIGS = sorted(p.stem for p in (ROOT / "configs").glob("*.yaml"))


def _run(*args, cwd=None, ok=True):
    """Runs args[0] as from an activated venv when it is a venv's program (so that venv's ninja builds)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    bin_dir = Path(args[0]).parent
    if (bin_dir.parent / "pyvenv.cfg").exists():
        env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", VIRTUAL_ENV=str(bin_dir.parent))
    result = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    result.output = result.stdout + result.stderr
    if ok:
        assert result.returncode == 0, f"{' '.join(map(str, args))} failed:\n{result.output[-6000:]}"
    return result


def _venv(path):
    _run(sys.executable, "-m", "venv", path)
    return path / "bin" / "python"


def _installed(python, cwd):
    """What the venv's qca_lowmem says about itself, imported from outside any source tree."""
    return json.loads(_run(python, "-c", CHECK, cwd=cwd).stdout.splitlines()[-1])


def _files(root):
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("packaging")


@pytest.fixture(scope="module")
def torch_venv(work):
    """A user's venv: torch, an older setuptools than the build environment gets, and the tools
    the non-isolated builds need."""
    python = _venv(work / "venv")
    install = _run(python, "-m", "pip", "install", "-q", TORCH_SPEC, ok=False)
    if install.returncode != 0 and not os.environ.get("CI"):
        pytest.skip(f"cannot install {TORCH_SPEC} here (no package index?): {install.output.strip()[-300:]}")
    assert install.returncode == 0, install.output
    _run(python, "-m", "pip", "install", "-q", OLDER_SETUPTOOLS, "ninja", "build")
    return python


@pytest.fixture(scope="module")
def sdist(work, torch_venv):
    tree = work / "tree"
    shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "*.egg-info", "__pycache__", "*.so", "*.o", "_build_info.py", "runs", ".pytest_cache"))
    _run(torch_venv, "-m", "build", "--sdist", "--no-isolation", "--outdir", work / "dist", tree)
    (path,) = (work / "dist").glob("qca_lowmem-*.tar.gz")
    return path


@pytest.fixture(scope="module")
def source(work, sdist):
    """The unpacked sdist, where every build below runs (a name pip does not cache wheels under)."""
    with tarfile.open(sdist) as archive:
        archive.extractall(work / "unpacked", filter="data")
    (top,) = (work / "unpacked").iterdir()
    return top.rename(work / "src")


@pytest.fixture(scope="module")
def plain_install(work, torch_venv, source):
    result = _run(torch_venv, "-m", "pip", "install", "-v", ".", cwd=source)
    return result, _installed(torch_venv, work)


@pytest.fixture(scope="module")
def wheel(work, torch_venv, source, plain_install):  # after plain_install: reuses its objects
    _run(torch_venv, "-m", "pip", "wheel", "--no-deps", "-w", work / "wheelhouse", ".", cwd=source)
    (path,) = (work / "wheelhouse").glob("qca_lowmem-*.whl")
    return path


def test_plain_pip_install_builds_against_the_venvs_torch(plain_install, torch_venv):
    result, facts = plain_install
    assert "Installing build dependencies" in result.output and "Building wheel for qca-lowmem" in result.output
    assert facts["built_against"] == facts["torch"] == TORCH_VERSION
    assert Path(facts["file"]).is_relative_to(torch_venv.parents[1])
    assert facts["pack_ok"] and facts["configs"] == CONFIGS


def test_sdist_carries_what_a_build_needs_and_nothing_machine_specific(sdist):
    with tarfile.open(sdist) as archive:
        shipped = {m.name.split("/", 1)[1] for m in archive.getmembers() if m.isfile()}
    for folder in ("csrc", "include", "build_backend", "configs", "tests"):
        assert {f for f in shipped if f.startswith(folder + "/")} == {f"{folder}/{f}" for f in _files(ROOT / folder)}
    assert {"setup.py", "pyproject.toml", "README.md", "MANIFEST.in"} <= shipped
    assert {f for f in _files(ROOT / "python" / "qca_lowmem") if f.endswith(".py") and f != "_build_info.py"} == {
        f.removeprefix("python/qca_lowmem/") for f in shipped if f.startswith("python/qca_lowmem/")}
    assert not [f for f in shipped if f.endswith((".so", ".o", ".whl")) or f.startswith(("benchmarks/", "scripts/", ".ci/"))]


def test_isolated_build_keeps_the_build_environments_setuptools(wheel):
    with zipfile.ZipFile(wheel) as archive:
        (info,) = [n for n in archive.namelist() if n.endswith(".dist-info/WHEEL")]
        generator = archive.read(info).decode()
    assert "Generator: setuptools" in generator and OLDER_SETUPTOOLS.split("==")[1] not in generator, generator


def test_wheel_holds_the_package_and_its_build_facts(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        build_info = archive.read("qca_lowmem/_build_info.py").decode()
        entry_points = archive.read("qca_lowmem-0.1.0.dist-info/entry_points.txt").decode()
    assert all(n.startswith(("qca_lowmem/", "qca_lowmem-0.1.0.dist-info/")) for n in names), names
    modules = {f"qca_lowmem/{f}" for f in _files(ROOT / "python" / "qca_lowmem") if f.endswith(".py")}
    assert modules | {"qca_lowmem/_build_info.py"} | {f"qca_lowmem/configs/{c}.yaml" for c in CONFIGS} <= names
    assert [n for n in names if n.startswith("qca_lowmem/_C.") and n.endswith(".so")]
    assert f"TORCH_VERSION = {TORCH_VERSION!r}" in build_info
    assert "qca-lowmem = qca_lowmem.trainer.cli:entry" in entry_points


def test_wheel_installs_imports_and_uninstalls_without_leftovers(work, torch_venv, wheel):
    _run(torch_venv, "-m", "pip", "uninstall", "-y", "qca-lowmem")  # whatever an earlier test installed
    site = Path(_run(torch_venv, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))").stdout.strip())
    before = _files(torch_venv.parents[1])
    _run(torch_venv, "-m", "pip", "install", "--no-deps", wheel)
    facts = _installed(torch_venv, work)
    assert facts["pack_ok"] and facts["configs"] == CONFIGS
    assert re.search(rf"built against +torch {re.escape(TORCH_VERSION)}", _run(torch_venv.parent / "qca-lowmem", "doctor").stdout)
    _run(torch_venv, "-m", "pip", "uninstall", "-y", "qca-lowmem")
    assert _files(torch_venv.parents[1]) == before
    assert not [p.name for p in site.iterdir() if p.name.startswith("qca_lowmem")]


def test_no_build_isolation_still_works(work, torch_venv, source, plain_install):
    _run(torch_venv, "-m", "pip", "install", "--no-build-isolation", "--force-reinstall", "--no-deps", ".", cwd=source)
    facts = _installed(torch_venv, work)
    assert facts["built_against"] == facts["torch"] and facts["pack_ok"] and facts["configs"] == CONFIGS


def test_editable_install(work, torch_venv, source, plain_install):
    _run(torch_venv, "-m", "pip", "install", "-e", ".", cwd=source)
    facts = _installed(torch_venv, work)
    assert Path(facts["file"]).is_relative_to(source / "python")
    assert facts["built_against"] == facts["torch"] and facts["pack_ok"] and facts["configs"] == CONFIGS


def test_python_m_build_says_to_turn_isolation_off_and_works_without_it(work, torch_venv, source, plain_install):
    isolated = _run(torch_venv, "-m", "build", "--wheel", "--outdir", work / "build_isolated", ".", cwd=source, ok=False)
    assert isolated.returncode != 0 and ISOLATED in isolated.output, isolated.output
    assert "Traceback" not in isolated.output and "No module named 'torch'" not in isolated.output
    _run(torch_venv, "-m", "build", "--wheel", "--no-isolation", "--outdir", work / "build_plain", ".", cwd=source)
    assert list((work / "build_plain").glob("qca_lowmem-*.whl"))


UV = shutil.which("uv", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")


@pytest.mark.skipif(UV is None, reason="uv is not installed (scripts/test.sh installs it)")
def test_uv_says_to_turn_isolation_off(work, torch_venv, source):
    result = _run(UV, "build", "--wheel", "--python", torch_venv, "--out-dir", work / "uv", ".", cwd=source, ok=False)
    assert result.returncode != 0 and ISOLATED in result.output, result.output
    assert "Traceback" not in result.output


@pytest.fixture(scope="module")
def bare_venv(work, torch_venv):  # torch_venv: skips where no index serves the build requirements
    return _venv(work / "bare")


def _assert_one_clear_line(result, line):
    assert result.returncode != 0
    assert line in result.output, result.output
    assert "Traceback" not in result.output and "ModuleNotFoundError" not in result.output, result.output


def test_no_torch_gives_one_clear_line(source, bare_venv):
    _assert_one_clear_line(_run(bare_venv, "-m", "pip", "install", ".", cwd=source, ok=False), NO_TORCH)


def test_older_torch_than_declared_is_refused_before_building(work, source, bare_venv):
    """pip would build against it, then replace it with the index's newest torch."""
    old_torch = work / "old_torch"
    (old_torch / "torch").mkdir(parents=True)
    (old_torch / "torch" / "__init__.py").write_text("__version__ = '2.5.1'\n")
    (old_torch / "torch-2.5.1.dist-info").mkdir()
    (old_torch / "torch-2.5.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.5.1\n")
    link = Path(_run(bare_venv, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))").stdout.strip()) / "old.pth"
    link.write_text(f"{old_torch}\n")
    try:
        result = _run(bare_venv, "-m", "pip", "install", ".", cwd=source, ok=False)
    finally:
        link.unlink()
    _assert_one_clear_line(result, "qca_lowmem needs torch >= 2.11 and found torch 2.5.1")


OLDER_PYTHONS = sorted(Path(sys.base_prefix).parent.glob("3.10*/bin/python3"))  # pyenv's layout


@pytest.mark.skipif(not OLDER_PYTHONS, reason="no Python 3.10 next to this one")
def test_older_python_than_declared_is_refused_before_building(work, source, torch_venv):
    python = work / "py310" / "bin" / "python"
    _run(OLDER_PYTHONS[-1], "-m", "venv", python.parents[1])
    result = _run(python, "-m", "pip", "install", ".", cwd=source, ok=False)
    _assert_one_clear_line(result, "qca_lowmem needs Python >= 3.11 and this is Python 3.10")


def test_backend_floors_are_the_declared_ones():
    spec = importlib.util.spec_from_file_location("qca_lowmem_build", ROOT / "build_backend" / "qca_lowmem_build.py")
    backend = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(backend)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["requires-python"] == ">=" + ".".join(map(str, backend.PYTHON_FLOOR))
    assert "torch>=" + ".".join(map(str, backend.TORCH_FLOOR)) in project["dependencies"]
