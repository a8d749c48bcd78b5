"""The package's layers: each module imports only its own layer and those below, and no module
imports in a circle (function-level imports included: they are the usual way to hide a circle)."""

import ast
import importlib
import re
import sys
import tomllib
from pathlib import Path

import pytest

import qca_lowmem

PACKAGE = Path(qca_lowmem.__file__).parent
NAME = "qca_lowmem"

# Lowest first. The reference (`stock`), the byte units (`units`) and the native library sit
# under every layer; the switch for the users' trainers (`atheria/`) over the library; the package
# faces (`__init__`, `__main__`) over them all; `configs` holds data only; `examples/` (stand-ins
# of the users' trainers) is imported by no other layer.
LAYERS = ["base", "ops", "library", "atheria", "trainer", "face", "examples"]
LAYER_LIMIT_LINES = 400


def layer_of(module: str) -> str:
    parts = module.split(".")
    if module in (NAME, f"{NAME}.__main__"):
        return "face"
    if parts[1] in ("stock", "units", "_C", "_build_info", "_version", "_torch_private", "configs"):
        return "base"
    if parts[1] in ("ops", "atheria", "trainer", "examples"):
        return parts[1]
    return "library"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path):
    """(line, module) for every import of the package in the file, at any depth, resolved."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == NAME:
                    yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != NAME:
                continue
            for alias in node.names:  # `from pkg import module` names a module when one is there
                candidate = f"{target}.{alias.name}"
                yield node.lineno, candidate if known_module(candidate) else target


def known_module(name: str) -> bool:
    relative = Path(*name.split(".")[1:])
    return (PACKAGE / relative).with_suffix(".py").is_file() or (PACKAGE / relative / "__init__.py").is_file() \
        or name in (f"{NAME}._C", f"{NAME}.configs")  # built, or mapped from the repository's configs/


SOURCES = sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)
GRAPH = {module_name(p): sorted({m for _, m in imported_modules(p)} - {module_name(p)}) for p in SOURCES}


def test_the_layers_exist():
    names = set(GRAPH)
    assert {f"{NAME}.ops.qca_step", f"{NAME}.recompute.api", f"{NAME}.atheria.switch", f"{NAME}.trainer.train",
            f"{NAME}.stock"} <= names
    assert {layer_of(m) for m in names} == set(LAYERS)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_go_down_only(path):
    module = module_name(path)
    mine = LAYERS.index(layer_of(module))
    upward = [f"line {line}: {target} ({layer_of(target)})" for line, target in imported_modules(path)
              if LAYERS.index(layer_of(target)) > mine]
    assert not upward, f"{module} ({layer_of(module)}) imports a layer above it: {upward}"


def circles_in(graph):
    """Every import circle a depth-first walk of `graph` meets, as module lists."""
    state, circles = {}, []

    def visit(module, trail):
        state[module] = "open"
        for target in graph.get(module, []):
            if state.get(target) == "open":
                circles.append(trail[trail.index(target):] + [target])
            elif target not in state:
                visit(target, trail + [target])
        state[module] = "done"

    for module in graph:
        if module not in state:
            visit(module, [module])
    return circles


def test_no_import_circles():
    circles = circles_in(GRAPH)
    assert not circles, f"import circles: {[' -> '.join(c) for c in circles]}"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_modules_stay_small(path):
    lines = len(path.read_text().splitlines())
    assert lines <= LAYER_LIMIT_LINES, f"{path.relative_to(PACKAGE)} has {lines} lines: split it by concern"


def test_the_checker_sees_upward_imports_and_circles(tmp_path, monkeypatch):
    """The checks above fail on a tree that breaks them."""
    fake = tmp_path / NAME
    (fake / "ops").mkdir(parents=True)
    (fake / "trainer").mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "ops" / "__init__.py").write_text("")
    (fake / "trainer" / "__init__.py").write_text("")
    (fake / "ops" / "bad.py").write_text("def f():\n    from ..trainer import cli\n")
    (fake / "trainer" / "cli.py").write_text("from . import run\n")
    (fake / "trainer" / "run.py").write_text("from .cli import main\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    bad = fake / "ops" / "bad.py"
    assert [(line, layer_of(m)) for line, m in imported_modules(bad)] == [(2, "trainer")]
    graph = {module_name(p): sorted({m for _, m in imported_modules(p)}) for p in fake.rglob("*.py")}
    assert circles_in(graph) == [[f"{NAME}.trainer.cli", f"{NAME}.trainer.run", f"{NAME}.trainer.cli"]]


# The top level: the package faces, the model (blocks, pools, convs, U-Net, the stock reference), the precision
# switches and the scaler, the byte units, the build and the private torch APIs; the rest lives in
# the package folders (ops/, recompute/, atheria/, trainer/, examples/, configs).
TOP_LEVEL = {"__init__", "__main__", "_version", "_build_info", "_torch_private", "stock", "blocks", "pools", "convs", "unet",
             "amp", "precision", "units"}


def test_the_top_level_holds_the_face_and_the_model_only():
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert modules == TOP_LEVEL, (f"unexpected top-level modules {sorted(modules - TOP_LEVEL)}; "
                                  f"missing {sorted(TOP_LEVEL - modules)}")
    assert folders - {"configs"} == {"ops", "recompute", "atheria", "trainer", "examples"}  # configs/: installed data


def test_the_recompute_package_imports_only_ops_and_itself():
    """The core is self-contained: the model, enable() and the trainer build on it, never the
    other way round (below it only the private torch APIs and the byte units)."""
    for module, targets in GRAPH.items():
        if module.startswith(f"{NAME}.recompute"):
            outside = [t for t in targets if not t.startswith((f"{NAME}.recompute", f"{NAME}.ops", f"{NAME}._torch_private",
                                                               f"{NAME}.units"))]
            assert not outside, f"{module} imports {outside}"


def test_no_module_outside_ops_imports_a_private_ops_module():
    for path in SOURCES:
        module = module_name(path)
        if module.startswith(f"{NAME}.ops"):
            continue
        private = [f"line {line}: {target}" for line, target in imported_modules(path)
                   if target.startswith(f"{NAME}.ops.") and target.split(".")[2].startswith("_")]
        assert not private, f"{module} imports ops' private modules {private}: import the names from qca_lowmem.ops"


# String constants spelling a mode name that mean something else: a device or a checkpoint to
# resume ("auto"), an argument named step in messages. Counted, so a new mode literal fails.
OTHER_MEANINGS = {("trainer/cli.py", "auto"): 1, ("trainer/config.py", "auto"): 1, ("trainer/distributed.py", "auto"): 2,
                  ("trainer/run_checks.py", "auto"): 1, ("ops/noise.py", "step"): 3}


def test_only_the_policy_module_reads_mode_names():
    """Elsewhere a policy is asked (qca_lowmem.recompute.Policy), not its mode string compared."""
    found = {}
    for path in SOURCES:
        relative = str(path.relative_to(PACKAGE))
        if relative == "recompute/policy.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in ("step", "revolve", "auto"):
                found[(relative, node.value)] = found.get((relative, node.value), 0) + 1
    assert found == OTHER_MEANINGS


def test_every_package_folder_is_installed():
    """`pip install .` ships only the packages pyproject.toml lists: a new folder must be there."""
    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    listed = set(project["tool"]["setuptools"]["packages"])
    source = Path(__file__).parents[2] / "python" / NAME
    folders = {".".join((NAME, *p.relative_to(source).parts)) for p in source.rglob("*")
               if p.is_dir() and p.name != "__pycache__" and any(p.glob("*.py"))}
    assert folders <= listed, f"not installed: {sorted(folders - listed)}"


def face_listing_gaps(package: Path):
    """(modules without a line in the package docstring, lines naming no module): each module of a
    package is listed there as a line `- `name`: what it holds`."""
    listed = set(re.findall(r"^- `(\w+)`:", ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or "",
                            re.MULTILINE))
    modules = {p.stem for p in package.glob("*.py") if p.name != "__init__.py"}
    return sorted(modules - listed), sorted(listed - modules)


PACKAGE_FOLDERS = sorted(p.parent for p in PACKAGE.glob("*/__init__.py"))


@pytest.mark.parametrize("package", PACKAGE_FOLDERS, ids=lambda p: p.name)
def test_every_package_face_lists_its_modules(package):
    unlisted, stale = face_listing_gaps(package)
    assert not unlisted, f"{package.name}/__init__.py's docstring has no line for {unlisted}"
    assert not stale, f"{package.name}/__init__.py's docstring lists modules that do not exist: {stale}"


def test_the_face_check_sees_a_module_without_a_line(tmp_path):
    (tmp_path / "__init__.py").write_text('"""A package.\n\n- `kept`: what it holds.\n- `gone`: removed.\n"""\n')
    (tmp_path / "kept.py").write_text("")
    (tmp_path / "added.py").write_text("")
    assert face_listing_gaps(tmp_path) == (["added"], ["gone"])
    assert {p.name for p in PACKAGE_FOLDERS} >= {"recompute", "atheria", "ops"}


def test_the_version_is_the_projects():
    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    assert qca_lowmem.__version__ == project["version"]


def test_no_module_outside_the_switch_imports_its_private_modules():
    """atheria/ is reached through its package face (enable, disable, enable_from_config) and
    its config section's option names; its other modules are its own."""
    allowed = {f"{NAME}.atheria", f"{NAME}.atheria.config_section"}
    for path in SOURCES:
        module = module_name(path)
        if module.startswith(f"{NAME}.atheria"):
            continue
        private = [f"line {line}: {target}" for line, target in imported_modules(path)
                   if target.startswith(f"{NAME}.atheria") and target not in allowed]
        assert not private, f"{module} imports the switch's own modules {private}: import from qca_lowmem.atheria"


def test_no_library_module_imports_the_examples():
    for module, targets in GRAPH.items():
        if not module.startswith(f"{NAME}.examples"):
            examples = [t for t in targets if t.startswith(f"{NAME}.examples")]
            assert not examples, f"{module} imports the stand-ins {examples}: examples/ is examples only"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_every_module_imports_by_its_dotted_name(path):
    """`import qca_lowmem.<package>.<module>` works and binds the module, for every module: no
    package attribute shadows a module of the same name."""
    module = module_name(path)
    if module == f"{NAME}.__main__":
        pytest.skip("__main__ runs the command when imported")
    imported = importlib.import_module(module)
    parent, _, leaf = module.rpartition(".")
    if parent:
        assert getattr(importlib.import_module(parent), leaf) is imported, \
            f"{parent}.{leaf} is not the module {module}: a name in {parent} shadows it"


# Op wrappers that run watched, with why (ops/watchers.py: a wrapper runs hidden from an episode's
# watch when it reads only its arguments and writes only what it returns).
WATCHED = {
    ("ops/groupnorm_elu.py", "groupnorm_elu"): "the library runs the op only inside a fused block, hidden with it",
    ("ops/scaler.py", "unscale_"): "writes its arguments in place",
    ("ops/scaler.py", "mul_"): "writes its arguments in place",
    ("ops/scaler.py", "update_scale_"): "writes its arguments in place",
    ("ops/scaler.py", "accumulate_"): "writes its arguments in place",
}
HIDING = {"call_unwatched", "call_layer_unwatched", "run_hidden"}


def op_wrappers(tree: ast.Module):
    """(name, whether it runs hidden) for each public function of an op module that calls the
    native library (`torch.ops.qca_lowmem`, bound to a module name) or a custom op defined there."""
    ops = set()
    for node in tree.body:
        value = ast.unparse(node.value) if isinstance(node, ast.Assign) else ""
        if "torch.ops.qca_lowmem" in value or "torch.library.custom_op" in value:
            ops |= {target.id for target in node.targets if isinstance(target, ast.Name)}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
            if names & ops:
                yield node.name, bool(names & HIDING)


OP_MODULES = sorted(p for p in (PACKAGE / "ops").glob("*.py") if not p.name.startswith("_") and p.name != "watchers.py")


def test_every_op_wrapper_runs_hidden_from_the_watch_or_is_listed_as_watched():
    found, wrong = set(), []
    for path in OP_MODULES:
        relative = str(path.relative_to(PACKAGE))
        for name, hidden in op_wrappers(ast.parse(path.read_text())):
            found.add((relative, name))
            if hidden == ((relative, name) in WATCHED):
                wrong.append(f"{relative}: {name} " + ("is listed as watched but runs hidden" if hidden else
                             "runs watched: hide it (ops/watchers.py) or list it in WATCHED with why"))
    assert not wrong, wrong
    assert set(WATCHED) <= found, f"listed but no op wrapper: {sorted(set(WATCHED) - found)}"
    assert {("ops/noise.py", "phase_flip"), ("ops/qca_step.py", "qca_update"), ("ops/conv_block.py", "conv_block_forward")} \
        <= found  # the check finds the wrappers


def test_the_wrapper_check_sees_a_wrapper_that_runs_watched():
    source = ("import torch\n_lib = torch.ops.qca_lowmem\n"
              "def hidden(x):\n    return call_unwatched(_lib.qca_pack, (x,))\n"
              "def watched(x):\n    return _lib.qca_pack(x)\n"
              "def helper(x):\n    return x\n")
    assert list(op_wrappers(ast.parse(source))) == [("hidden", True), ("watched", False)]
