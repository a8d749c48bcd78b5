"""The identity of code that will run: what enable() compares before it replaces the users' code
(their train_episode, their engine's step, their noise injector's flips) by its own.

Not the source text (which `inspect` reads from the file on disk now, following `__wrapped__`):
the function object the instance resolves to, digested from its code object as the interpreter
runs it. The digest covers the bytecode and exception table, the constants (nested code objects
digested the same way), the names, arguments, flags, the default values, the closure's cells
and the module globals the code loads (a module by its name, a function by its own digest, a
simple value by its value, anything else by its type's name), so an edit imported and then
undone on disk, a global rebound, a default changed or a decorator's wrapper (functools.wraps
copies the name, not the code) all digest apart. Line numbers and file names are left out: a
comment or a blank line changes nothing that runs.

Bytecode changes between Python minor versions, so the digests of the versions followed are
recorded per `major.minor` (`FOLLOWED`); on a Python with none recorded nothing is recognised
and the users' own code runs. The static part of a digest is cached per code object (held, so
its id is not reused); the values (defaults, cells, globals) are read at every check.
"""

import dis
import hashlib
import inspect
import sys
import types
from typing import Dict, Optional, Tuple

PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"
_SIMPLE = (type(None), bool, int, float, complex, str, bytes)
_LOADS_GLOBAL = {"LOAD_GLOBAL", "LOAD_NAME"}

# Per Python version, per role: digest -> where the version followed was taken from (a function's
# digest, or for "modules" the classes of their model families, class_digest). Theirs from
# Jonakss/Atheria at 4df21e7 (2025-12, the same train_episode text as c780b4c / ee9d178 and the same
# noise.py as 6c95798, which the earlier source digests named); the stand-ins from qca_lowmem.examples,
# whose digests follow qca_lowmem.stock's code (tests/atheria/test_identity.py recomputes them).
# Each version's entry is what scripts/record_digests.py prints on it (3.11.7, 3.12.1, 3.13.0).
ATHERIA = "Jonakss/Atheria at 4df21e7, "
STAND_IN = "the bundled stand-in, qca_lowmem/examples/"
_STOCK = "qca_lowmem/stock.py NoiseInjector."
FOLLOWED: Dict[str, Dict[str, Dict[str, str]]] = {
    "3.11": {
        "QC_Trainer_v4.train_episode": {
            "cf6b56ed82e2fa931b36790d40a8c32fed4f59a9fbca7cfd9a9016de096dd82a": ATHERIA + "src/trainers/qc_trainer_v4.py",
            "85031a43c8a2e699beca417fc223cc31a4662c8b189ef74ae95a3ffc9561b4f8": STAND_IN + "qc_trainer_v4.py",
        },
        "QC_Trainer_v3.train_episode": {
            "4cedca95799d0d6c6b15768f22e09eb1c2b1bf4bfb2c6fade88f8181e8403dab": ATHERIA + "src/trainers/qc_trainer_v3.py",
            "815828dc1e6091695dbab76ee5d3fdcb9dc3c5f3f19cd925b1acd5787ebc7a53": STAND_IN + "qc_trainer_v3.py",
        },
        "CartesianEngine.evolve_step": {
            "ef41f322e2e9bebf5ba0d917dfec6de1b0322b0a19e11a61d37bb220c0e764f4": ATHERIA + "src/engines/qca_engine.py",
        },
        "CartesianEngine._evolve_logic": {
            "da644f45368b944e92bb59d5bdebe9829497df86bcdc9226add34c4593b17928": ATHERIA + "src/engines/qca_engine.py",
        },
        "QuantumNoiseInjector.apply_phase_flip": {
            "bd9f85aac5fd714b1f1d66aa47dda68d4e8e8fa7df0f08171f2a149d631bb5a6": ATHERIA + "src/physics/noise.py",
            "6953c0bc379656b0a007a43faf9ca51e0fc56177435229da0c246b93f363c3d0": _STOCK + "apply_phase_flip",
        },
        "QuantumNoiseInjector.apply_bit_flip": {
            "e46a1d6bb550a0c904ced4f11892c1963b374fdbcd4dbd8eba38bd5f1215a46a": ATHERIA + "src/physics/noise.py",
            "8c6b691af8d13b4cbe4b2fd15c6391f4af05143a697a9ad0e76692e34e7be687": _STOCK + "apply_bit_flip",
        },
        "Motor.evolve_step": {
            "5d7d81d9ee448de4ad65b210335a74ae6ff7766ef159f9ef7a47228df10b0d19": STAND_IN + "qc_trainer_v4.py Motor",
            "9064eea868f46ab51e5a494567322184c2afb1a66d70d1b97d3c60681956b55a": STAND_IN + "qc_trainer_v4.py MemoryMotor",
        },
        "modules": {
            "8dda7b686516b8d47eebe6378e39a510e68c11ea71fd6f9c6c83599dc7eab808":
                ATHERIA + "src/models/unet.py UNet",
            "b1360ca1f7f83a25c0acd8d1db9e42c5fd510784dc67686d00118dc5df6aa3c1":
                ATHERIA + "src/models/unet_unitary.py UNetUnitary, src/models/unet_unitary_rmsnorm.py UNetUnitaryRMSNorm",
            "a004ffb797ae6ac297108f2479ffbaef706f535c4315d6efdc050365383d27eb":
                ATHERIA + "src/models/rmsnorm.py RMSNorm2d",
            "8a151858f8fe7b3927978668997d378a73ff7b046724d10699c1428d163923d8":
                ATHERIA + "src/models/mlp.py MLP",
            "5f40f985bb0144e9929965864e7d36bbf2ade12553b9cdee2ab9cbf20c6e99d3":
                ATHERIA + "src/models/deep_qca.py DeepQCA",
            "b2daec4b3564e3883d2b068ac045d85708fa039495ab5671e7c4def2911d7de1":
                ATHERIA + "src/models/unet_convlstm.py UNetConvLSTM",
        },
    },
    "3.12": {
        "QC_Trainer_v4.train_episode": {
            "6225ca7741782292169806582df31d7fa317ef4a7bfa5304d2e49da5f6c6a9cf": ATHERIA + "src/trainers/qc_trainer_v4.py",
            "3afe69a00072e8cacd313d8777b9b05bf2a66327c73c30363c5cb86320ea5983": STAND_IN + "qc_trainer_v4.py",
        },
        "QC_Trainer_v3.train_episode": {
            "b461bcce04cccb00f64c4a4230a1686e97dc8dd03d29c9074a2e142f40e31d39": ATHERIA + "src/trainers/qc_trainer_v3.py",
            "0c9e7e9d5e2444684420f60c6314f6caac4e40304294273786fa731e6b359a95": STAND_IN + "qc_trainer_v3.py",
        },
        "CartesianEngine.evolve_step": {
            "0d079d6c74a15bde0eb65b31e6139422164c9e64c7b21d668d6354d43e1b5b3b": ATHERIA + "src/engines/qca_engine.py",
        },
        "CartesianEngine._evolve_logic": {
            "97c1a568550e0c3f8276cb2b2f3639b08c3c2134a6add36648b3e2b67675c7e0": ATHERIA + "src/engines/qca_engine.py",
        },
        "QuantumNoiseInjector.apply_phase_flip": {
            "49d0221d7175a33831aad2b8bf24ea7999ce0b2bb1c29beea00a9a9364819f41": ATHERIA + "src/physics/noise.py",
            "55921beb5a1b794bdd5ea9552084955995ec6158a14ffeb0993a914713c74750": _STOCK + "apply_phase_flip",
        },
        "QuantumNoiseInjector.apply_bit_flip": {
            "b52412e0afa744abb0c49a142488611e84f2a684d31638de6b30bec1d95446a0": ATHERIA + "src/physics/noise.py",
            "5d782c2aa9eee7790ec8a95503807703e6a233fe731eba14bddf4b8c711de0b8": _STOCK + "apply_bit_flip",
        },
        "Motor.evolve_step": {
            "a48137444056f42bb45a169f6690a6717bde31273cf0fdec2d2ad119e8e9ecbf": STAND_IN + "qc_trainer_v4.py Motor",
            "6eb159b7b9fd21e311d912675239ec6f810884e0a9ff0f5854d605e8d0fe1915": STAND_IN + "qc_trainer_v4.py MemoryMotor",
        },
        "modules": {
            "675ad5fcc4d360c071000ce6361fae048d76f72e2833b60c2d14611eb8af6731":
                ATHERIA + "src/models/unet.py UNet",
            "fc2244d0a24a6077e1af0240a831072f220892d1112638e2f016eaa57a354868":
                ATHERIA + "src/models/unet_unitary.py UNetUnitary, src/models/unet_unitary_rmsnorm.py UNetUnitaryRMSNorm",
            "9a2e551638a1038d83265181ffff97a6c82159539a82f86367b0e697fe574d18":
                ATHERIA + "src/models/rmsnorm.py RMSNorm2d",
            "d13fd026165f2e41090f17eb426439fc6897a4013a634ca150ff33e8de96bb35":
                ATHERIA + "src/models/mlp.py MLP",
            "d3475bfb2a6952988d2935fb1f6e2f1e2ff1e3cd9d095c5d80380f4bbc9a3c1c":
                ATHERIA + "src/models/deep_qca.py DeepQCA",
            "38e860468d7c8502b85c605424d6ff1cdd099f5d3fc1ce6fa6503217f79a0646":
                ATHERIA + "src/models/unet_convlstm.py UNetConvLSTM",
        },
    },
    "3.13": {
        "QC_Trainer_v4.train_episode": {
            "074f4e5c1eb86e58fb49a11bc8b6f0fbf1e3c556c64b4ef1f6d3b30aecf521d4": ATHERIA + "src/trainers/qc_trainer_v4.py",
            "7c24a7529d2150d8e9c0515706310a13965a772c0b1257a4d40523d1e48b4657": STAND_IN + "qc_trainer_v4.py",
        },
        "QC_Trainer_v3.train_episode": {
            "73265b533372875b1b6a0cf38f8826ed423f4ffac0d7a3165850de915d88d6ba": ATHERIA + "src/trainers/qc_trainer_v3.py",
            "02fe1771b1a2440b31b22dfc65bd9e78327cc9464aef774a0d2e7080a489ebea": STAND_IN + "qc_trainer_v3.py",
        },
        "CartesianEngine.evolve_step": {
            "d4402ca53eba22d75680de928f9bb8afc7235e59c23f19012dc539944f28ac0e": ATHERIA + "src/engines/qca_engine.py",
        },
        "CartesianEngine._evolve_logic": {
            "772eb46e17a2a38e6fea309394187de84eee0758b37d9f0c381b288bdd646389": ATHERIA + "src/engines/qca_engine.py",
        },
        "QuantumNoiseInjector.apply_phase_flip": {
            "24135f7134c9e83e70880ef5cb313aeb591a5cc494847e681ba54d1001caffce": ATHERIA + "src/physics/noise.py",
            "04d9a3f9154bc92edbb241b82df33509dca67491959a11f4d795aa57a118f38b": _STOCK + "apply_phase_flip",
        },
        "QuantumNoiseInjector.apply_bit_flip": {
            "f7ef8e5bd8b038567705e78feb0964330dfa743434c9bafab2edc86d87367784": ATHERIA + "src/physics/noise.py",
            "51beef01dfcd73c8a834c7a9bafe60c07c89f5298a5d074aec1728d1c7d0f646": _STOCK + "apply_bit_flip",
        },
        "Motor.evolve_step": {
            "e863f16ebe7992741da9be8bd8c9a368c3d2ecfe640ae217e102c2d1f528bd16": STAND_IN + "qc_trainer_v4.py Motor",
            "b17f3fa309b7b24ec2af742125919537178be101d6c0182a627d971b2f4332f1": STAND_IN + "qc_trainer_v4.py MemoryMotor",
        },
        "modules": {
            "e30ec2b2526a70730545d05af17032b3a1d143859b1bfd249ca35ac3a0c3b0d0":
                ATHERIA + "src/models/unet.py UNet",
            "c731a06bf411b1d2df401ea8b3b550446ea6b274afec5a2d5336973f337cd973":
                ATHERIA + "src/models/unet_unitary.py UNetUnitary, src/models/unet_unitary_rmsnorm.py UNetUnitaryRMSNorm",
            "2488a8eacec06049a0c7f0b2d1212b909a62d44b3952e1741a70c0e04615d4d9":
                ATHERIA + "src/models/rmsnorm.py RMSNorm2d",
            "d66a47826f494a28d03d0a3724650bfcac6b71bab6cfeaea552db6495fe29800":
                ATHERIA + "src/models/mlp.py MLP",
            "30348f0d530f15fa9d1f3c479fa058f3c4d80cea12588716c708a04509c500be":
                ATHERIA + "src/models/deep_qca.py DeepQCA",
            "97a2b0b8f3180f250f1b9d55eeb17021946ec96ceca7145321d0f4ece5341c71":
                ATHERIA + "src/models/unet_convlstm.py UNetConvLSTM",
        },
    },
}


class _Static:
    """What a code object's digest needs that never changes: its own bytes and the globals it loads;
    and, for `reads`, the attributes it takes off those globals (`counters.calls += 1`, `cfg.STEP`)
    and the globals it binds without loading them (`global LAST; LAST = psi`)."""

    def __init__(self, code: types.CodeType):
        self.code = code  # held: the cache is keyed by id()
        self.digest, self.globals, self.global_attributes, self.stored = _static(code)


_STATIC: Dict[int, _Static] = {}
_ATTRIBUTE_OPS = {"LOAD_ATTR", "LOAD_METHOD", "STORE_ATTR", "DELETE_ATTR"}
_STACK_ONLY = {"COPY", "CACHE", "EXTENDED_ARG"}  # between a global and its attribute (`g.a += 1` copies g first)


def _static(code: types.CodeType) -> Tuple[str, Tuple[str, ...], Tuple[Tuple[str, str], ...], Tuple[str, ...]]:
    parts = [code.co_code, code.co_exceptiontable, repr((code.co_name, code.co_names, code.co_varnames,
                                                          code.co_freevars, code.co_cellvars, code.co_argcount,
                                                          code.co_posonlyargcount, code.co_kwonlyargcount,
                                                          code.co_flags)).encode()]
    instructions = [ins for ins in dis.get_instructions(code) if ins.opname not in _STACK_ONLY]
    loaded = {ins.argval for ins in instructions if ins.opname in _LOADS_GLOBAL}
    stored = {ins.argval for ins in instructions if ins.opname == "STORE_GLOBAL"}  # not a class body's STORE_NAME
    attributes = {(ins.argval, after.argval) for ins, after in zip(instructions, instructions[1:])
                  if ins.opname in _LOADS_GLOBAL and after.opname in _ATTRIBUTE_OPS}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            inner = static_of(const)
            parts.append(inner.digest.encode())
            loaded.update(inner.globals)
            attributes.update(inner.global_attributes)
            stored.update(inner.stored)
        else:
            parts.append(str(_value(const, frozenset())).encode())  # frozenset constants: sorted
    return (hashlib.sha256(b"\0".join(parts)).hexdigest(), tuple(sorted(loaded)), tuple(sorted(attributes)),
            tuple(sorted(stored - loaded)))


def static_of(code: types.CodeType) -> _Static:
    found = _STATIC.get(id(code))
    if found is None or found.code is not code:
        found = _STATIC[id(code)] = _Static(code)
    return found


def _value(value, seen) -> Optional[str]:
    """A value's part of a digest; None where it cannot be told apart from a changed one."""
    if isinstance(value, _SIMPLE):
        return f"{type(value).__qualname__}:{value!r}"
    if isinstance(value, (tuple, frozenset)):
        inner = [_value(v, seen) for v in value]
        if None in inner:
            return None
        return f"{type(value).__qualname__}({','.join(sorted(inner) if isinstance(value, frozenset) else inner)})"
    if isinstance(value, types.ModuleType):
        return f"module:{value.__name__}"
    if isinstance(value, types.FunctionType):
        return _digest(value, seen)
    if isinstance(value, (type, types.BuiltinFunctionType)):
        return f"{type(value).__qualname__}:{getattr(value, '__module__', '')}.{value.__qualname__}"
    return f"instance:{type(value).__module__}.{type(value).__qualname__}"


_EMPTY, _MISSING = object(), object()  # an empty closure cell; a global found nowhere
_DIGESTS: Dict[int, tuple] = {}  # id(function) -> (function, what its digest read, the digests of functions among it, digest)


def _inputs(function, static: _Static) -> tuple:
    """Every object the digest of `function` reads, in order."""
    cells = []
    for cell in function.__closure__ or ():
        try:
            cells.append(cell.cell_contents)
        except ValueError:
            cells.append(_EMPTY)
    namespace, builtins = function.__globals__, function.__builtins__
    loaded = [namespace[name] if name in namespace else
              builtins.get(name, _MISSING) if isinstance(builtins, dict) else getattr(builtins, name, _MISSING)
              for name in static.globals]
    kwdefaults = tuple(sorted((function.__kwdefaults__ or {}).items()))
    return (function.__code__, function.__defaults__, kwdefaults, *(v for _, v in kwdefaults), *cells, *loaded)


def _digest(function, seen) -> Optional[str]:
    if not isinstance(function, types.FunctionType) or hasattr(function, "__wrapped__"):
        return None
    if id(function) in seen:
        return "recursive"
    seen = seen | {id(function)}
    static = static_of(function.__code__)
    inputs = _inputs(function, static)
    inner = tuple(_digest(v, seen) for v in inputs if isinstance(v, types.FunctionType))
    cached = _DIGESTS.get(id(function))
    # The same objects read as last time (held there, so their ids are theirs): the same digest.
    if cached is not None and cached[0] is function and len(cached[1]) == len(inputs) and cached[2] == inner \
            and all(a is b for a, b in zip(cached[1], inputs)):
        return cached[3]
    parts = [static.digest, _value(function.__defaults__ or (), seen), _value(inputs[2], seen)]
    parts += ["empty" if cell is _EMPTY else _value(cell, seen)
              for cell in inputs[3 + len(inputs[2]):len(inputs) - len(static.globals)]]
    parts += [f"{name}={'missing' if value is _MISSING else _value(value, seen)}"
              for name, value in zip(static.globals, inputs[len(inputs) - len(static.globals):])]
    found = None if None in parts else hashlib.sha256("\n".join(parts).encode()).hexdigest()
    _DIGESTS[id(function)] = (function, inputs, inner, found)
    return found


def digest(function) -> Optional[str]:
    """The digest of the code `function` runs; None for anything but a plain Python function
    (a wrapper with `__wrapped__`, a builtin, a callable object) or one reading what cannot be digested."""
    return _digest(function, frozenset())


def resolved(instance, name: str, installed=None):
    """The plain function `instance.name` runs, looked up on its class through the MRO, or None
    where the instance holds its own attribute of that name (other than `installed`, what
    enable() put there) or the class's is not a plain function."""
    own = vars(instance).get(name, installed) if hasattr(instance, "__dict__") else installed
    if own is not installed:
        return None
    try:
        found = inspect.getattr_static(type(instance), name)
    except AttributeError:
        return None
    return found if isinstance(found, types.FunctionType) else None


def followed(role: str, function) -> Optional[str]:
    """Where the version of `role` that `function` runs was taken from, or None if it is none
    recorded for this Python."""
    known = FOLLOWED.get(PYTHON, {}).get(role)
    if not known:
        return None
    return known.get(digest(function))


# What a class defines that never runs in a call of its instances (construction, class machinery,
# names that describe it); the rest of its own namespace is its code as a call can run it.
NOT_CALLED = frozenset({"__init__", "__new__", "__init_subclass__", "__class_getitem__", "__module__", "__qualname__",
                        "__doc__", "__dict__", "__weakref__", "__firstlineno__", "__static_attributes__",
                        "__annotations__", "__annotate__", "__orig_bases__", "__parameters__", "__slots__"})


def functions_of(value) -> Optional[list]:
    """The plain functions a class attribute runs when called or read (a method; a static or class
    method's; a property's accessors), [] for a value that runs nothing, None for a callable of
    another kind (a callable object, a builtin set on the class)."""
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    if isinstance(value, property):
        return [f for f in (value.fget, value.fset, value.fdel) if f is not None]
    if isinstance(value, types.FunctionType):
        return [value]
    return [] if not callable(value) or isinstance(value, type) else None


def class_digest(owner: type) -> Optional[str]:
    """The digest of what `owner` itself defines that a call of its instances can run: each of its
    functions (a static or class method's, a property's accessors) as `digest` takes it, and its
    plain class values; None where any of it cannot be digested. Its bases are not included: each
    class of a module's MRO is followed on its own."""
    parts = []
    for name, value in sorted(vars(owner).items()):
        if name in NOT_CALLED:
            continue
        functions = functions_of(value)
        inner = [_value(f, frozenset()) for f in functions] if functions else [_value(value, frozenset())]
        if None in inner:
            return None
        parts.append(f"{name}={type(value).__name__}({','.join(inner)})")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def followed_class(owner: type) -> Optional[str]:
    """Where the version of the users' class `owner` was taken from (its own code, `class_digest`),
    or None if it is none recorded for this Python."""
    known = FOLLOWED.get(PYTHON, {}).get("modules")
    return known.get(class_digest(owner)) if known else None


def not_recorded() -> Optional[str]:
    """Why nothing can be recognised on this Python, or None."""
    if PYTHON in FOLLOWED:
        return None
    return (f"no digest of the code qca_lowmem follows is recorded for Python {PYTHON} (bytecode differs between "
            f"versions; recorded: {', '.join(sorted(FOLLOWED))})")
