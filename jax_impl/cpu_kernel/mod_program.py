"""score_mod and mask_mod compiled for the C++ kernel: row programs that ``mod_program.h`` runs
over each tile row, so that calls with mods keep the fused kernel (no dense path, no second
implementation).

A mod is traced once on scalars (``s`` float32, ``b``, ``h``, ``q_idx``, ``kv_idx`` int32, and
``mod_aux`` as its shapes): its jaxpr is a chain of elementwise operations and scalar reads of
``mod_aux`` (``slopes[h]``, ``table[bucket(kv_idx - q_idx), h]``). Each value is *uniform*
(it depends on b, h and q_idx only: one SIMD vector per row) or *varies along the row* (it
depends on the score or kv_idx: a register of the row's keys). A value that depends on q_idx and
kv_idx only through ``kv_idx - q_idx`` (``table[bucket(kv_idx - q_idx), h]``) is *diagonal*: the
kernel computes it once per tile over the tile's diagonals, in a tile program with the uniforms
of b and h only, and each row reads its slice (the same operations on the same values). The
programs (each a tile program and a row program):

- the forward's: S -> score_mod(S);
- the mask's: mask_mod -> bool;
- the backward's: score_mod(S), d score_mod / dS and the partial derivatives of every read of
  a floating ``mod_aux`` entry (JAX's own ``jax.grad`` of the mod with those reads as inputs,
  compiled like the mod), then one scatter-add per read of the cotangent times its partial:
  each backward item sums its own cotangent of ``mod_aux`` (no atomics), and the caller sums
  the items in a fixed order.

What cannot be compiled (an array-valued intermediate, a primitive or dtype the programs do not
have) is refused with the reason, and the call runs on the ``xla`` path.
"""
from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jax_core

from jax_impl import mods

HEADER = Path(__file__).with_name("mod_program.h")


def _enum(name: str) -> dict[str, int]:
    """The values of ``enum name`` in mod_program.h (names in order from 0): one definition."""
    text = re.sub(r"//[^\n]*", "", HEADER.read_text())
    body = re.search(rf"enum {name} : int32_t \{{(.*?)\}};", text, re.S).group(1)
    names = [part.split("=")[0].strip() for part in body.split(",") if part.strip()]
    values, next_value = {}, 0
    for part in (p for p in body.split(",") if p.strip()):
        key, _, value = part.partition("=")
        next_value = int(value) if value.strip() else next_value
        values[key.strip()] = next_value
        next_value += 1
    assert list(values) == names
    return values


OP = _enum("ModOp")
FIELD = _enum("ModHeader")
ROW_INPUT = _enum("ModInput")
UNIFORM_INPUT = _enum("ModUniformInput")
DIAGONAL_INPUT = _enum("ModDiagonalInput")
WIDTH = 7  # kModWidth
_HEADER_SIZE = FIELD["kModHeaderSize"]


class Unsupported(Exception):
    """A mod the C++ kernel's programs cannot run (the message says why)."""


@dataclasses.dataclass(frozen=True)
class _Reg:
    """A virtual register: ``cls`` what its value depends on ('c': b, h and constants only;
    'q': also q_idx; 'd': also kv_idx - q_idx; 'k': also kv_idx; 'r': anything, the score);
    ``kind`` 'f', 'i' or 'b' (float32, int32, bool as int32 0/1)."""
    serial: int
    cls: str
    kind: str

    @property
    def pool(self) -> str:
        """Its register file: 'u' uniform (one vector), 'd' diagonal (a tile's diagonals),
        'r' row (a row's keys)."""
        return {"c": "u", "q": "u", "d": "d"}.get(self.cls, "r")

    @property
    def tile(self) -> bool:
        """Whether it is the same for every row of a tile (it goes in the tile program)."""
        return self.cls in "cd"


def _join(classes) -> str:
    """The class of a value computed from values of these classes."""
    varying = set(classes) - {"c"}
    return varying.pop() if len(varying) == 1 else "c" if not varying else "r"


@dataclasses.dataclass(frozen=True)
class _Array:
    """A mod_aux entry (or a constant array the mod closes over) in the packed aux buffer."""
    offset: int
    shape: tuple
    kind: str
    entry: int | None  # its index in mod_aux; None: a constant


@dataclasses.dataclass(frozen=True)
class _Read:
    """A scalar read of a floating mod_aux entry: its flat index and its value."""
    array: _Array
    index: _Reg
    value: _Reg


_BINARY = {"add": ("kFAdd", "kIAdd"), "add_any": ("kFAdd", "kIAdd"), "sub": ("kFSub", "kISub"), "mul": ("kFMul", "kIMul"),
           "div": ("kFDiv", "kIDiv"), "rem": ("kFRem", "kIRem"), "max": ("kFMax", "kIMax"),
           "min": ("kFMin", "kIMin"), "pow": ("kFPow", None), "atan2": ("kFAtan2", None),
           "and": (None, "kIAnd"), "or": (None, "kIOr"), "xor": (None, "kIXor"),
           "shift_left": (None, "kIShl"), "shift_right_arithmetic": (None, "kIShrA"),
           "shift_right_logical": (None, "kIShrL"),
           "eq": ("kFEq", "kIEq"), "ne": ("kFNe", "kINe"), "lt": ("kFLt", "kILt"),
           "le": ("kFLe", "kILe"), "gt": ("kFGt", "kIGt"), "ge": ("kFGe", "kIGe")}
_COMPARE = {"eq", "ne", "lt", "le", "gt", "ge"}
_UNARY = {"neg": ("kFNeg", "kINeg"), "abs": ("kFAbs", "kIAbs"), "sign": ("kFSign", "kISign"),
          "floor": ("kFFloor", None), "ceil": ("kFCeil", None), "sqrt": ("kFSqrt", None),
          "rsqrt": ("kFRsqrt", None), "exp": ("kFExp", None), "exp2": ("kFExp2", None),
          "log": ("kFLog", None), "log1p": ("kFLog1p", None), "expm1": ("kFExpm1", None),
          "tanh": ("kFTanh", None), "logistic": ("kFLogistic", None), "sin": ("kFSin", None),
          "cos": ("kFCos", None), "not": (None, "kINot")}
_REDUCTIONS = {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "pvary"}
_SHAPE_ONLY = {"squeeze", "reshape", "broadcast_in_dim", "expand_dims", "copy", "copy_p"}


def _kind(dtype) -> str:
    dtype = np.dtype(dtype)
    if dtype == np.float32:
        return "f"
    if dtype == np.int32:
        return "i"
    if dtype == np.bool_:
        return "b"
    raise Unsupported(f"a {dtype} value (the C++ kernel's mod programs compute in float32, "
                      "int32 and bool)")


def _reads_float_aux(closed, float_arrays: set) -> bool:
    """Whether ``closed`` (with these invars' positions holding floating mod_aux) reads one."""
    jaxpr = closed.jaxpr
    floats = {id(jaxpr.invars[i]) for i in float_arrays}
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dynamic_slice" and id(eqn.invars[0]) in floats:
            return True
        sub = mods.sub_jaxpr(eqn)
        if sub is not None:
            inner = {i for i, v in enumerate(eqn.invars) if id(v) in floats}
            if inner and _reads_float_aux(sub, inner):
                return True
    return False


class _Builder:
    """Virtual-register code of one program stream, built from jaxprs."""

    def __init__(self, arrays: list[_Array], kv: _Reg, q: _Reg, diagonal: _Reg,
                 gradients: tuple = ()):
        self.kv, self.q, self.diagonal = kv, q, diagonal  # the inputs kv_idx, q_idx, kv - q
        self.gradients = gradients    # per mod_aux entry: whether its reads get a cotangent
        self.code: list[tuple] = []   # (op name, dst, a, b, c, imm0, imm1)
        self.serial = 0
        self.arrays = arrays          # mod_aux's, then the constant arrays the mods close over
        self.constant_data: list[np.ndarray] = []
        self.reads: list[_Read] = []
        self.consts: dict = {}        # the constants of the stream being built

    def stream(self):
        """Starts a program: its constants are its own (each program runs alone)."""
        self.consts = {}
        self.reads = []
        return len(self.code)

    def reg(self, cls: str, kind: str) -> _Reg:
        self.serial += 1
        return _Reg(self.serial, cls, kind)

    def emit(self, op: str, kind: str, *operands, imm=(0, 0), cls=None) -> _Reg:
        regs = [x for x in operands if x is not None]
        dst = self.reg(_join(r.cls for r in regs) if cls is None else cls, kind)
        self.code.append((op, dst, *(list(operands) + [None] * (3 - len(operands))), *imm))
        return dst

    def const(self, value, kind: str) -> _Reg:
        bits = int(np.array(value, {"f": np.float32, "i": np.int32, "b": np.int32}[kind])
                   .view(np.int32))
        key = (bits, kind)
        if key not in self.consts:
            self.consts[key] = self.emit("kConst", kind, imm=(bits, 0), cls="c")
        return self.consts[key]

    # -- values ------------------------------------------------------------------------------

    def scalar(self, env, var):
        if isinstance(var, jax_core.Literal):
            value = np.asarray(var.val)
            if value.size != 1:
                raise Unsupported(f"an array literal of shape {value.shape}")
            return self.const(value.reshape(()).item(), _kind(var.aval.dtype))
        value = env[id(var)]
        if isinstance(value, _Array):
            raise Unsupported(f"an operation on a whole mod_aux array of shape {value.shape} "
                              "(the programs read mod_aux one element at a time: index it first)")
        return value

    def run(self, closed, inputs: list) -> list:
        """Emits ``closed`` (a jaxpr of scalars) on ``inputs`` (a _Reg or _Array per invar)."""
        jaxpr = closed.jaxpr
        env = {}
        for var, const in zip(jaxpr.constvars, closed.consts):
            env[id(var)] = self.constant(const)
        for var, value in zip(jaxpr.invars, inputs):
            env[id(var)] = value
        for eqn in jaxpr.eqns:
            outs = self.equation(env, eqn)
            for var, value in zip(eqn.outvars, outs):
                env[id(var)] = value
        return [self.scalar(env, var) for var in jaxpr.outvars]

    def constant(self, value):
        value = np.asarray(value)
        if value.size == 1:
            return self.const(value.reshape(()).item(), _kind(value.dtype))
        kind = _kind(value.dtype)
        array = _Array(sum(int(np.prod(a.shape)) for a in self.arrays), value.shape, kind, None)
        self.arrays.append(array)
        self.constant_data.append(value)
        return array

    def equation(self, env, eqn) -> list:
        name = eqn.primitive.name
        sub = mods.sub_jaxpr(eqn)
        if sub is not None:
            return self.run(sub, [env[id(v)] if not isinstance(v, jax_core.Literal)
                                  else self.scalar(env, v) for v in eqn.invars][:len(sub.jaxpr.invars)])
        if not eqn.outvars or eqn.effects:
            raise Unsupported(f"{name} (an effect: the C++ kernel's programs cannot call back "
                              "into Python; jax.debug.print runs on implementation='xla')")
        for var in eqn.outvars:
            if int(np.prod(var.aval.shape)) != 1:
                raise Unsupported(f"{name} gives an array of shape {var.aval.shape} (a mod must "
                                  "work on one element at a time)")
        if name == "dynamic_slice":
            return [self.read(env, eqn)]
        if name == "slice" and isinstance(env.get(id(eqn.invars[0])), _Array):  # a[0]: a static read
            return [self.read(env, eqn, [self.const(i, "i") for i in eqn.params["start_indices"]])]
        args = [self.scalar(env, v) for v in eqn.invars]
        out_kind = _kind(eqn.outvars[0].aval.dtype)
        # A reduction of one element (jax.grad's inside shard_map sums a scalar cotangent over
        # no axes) is the element itself.
        if name in _SHAPE_ONLY or name in _REDUCTIONS or name == "reduce_precision" and (
                eqn.params.get("exponent_bits"), eqn.params.get("mantissa_bits")) == (8, 23):
            return [args[0]]
        if name == "convert_element_type":
            return [self.convert(args[0], out_kind)]
        if name == "bitcast_convert_type" and {args[0].kind, out_kind} <= {"f", "i"}:
            return [dataclasses.replace(args[0], kind=out_kind)]  # the same 32 bits
        if name == "sub" and {(a.serial, a.kind) for a in args} == {(self.kv.serial, "i"),
                                                                   (self.q.serial, "i")}:
            # kv_idx - q_idx: the diagonal input (q_idx - kv_idx its negation, as int32 wraps)
            return [self.diagonal if args[0].serial == self.kv.serial
                    else self.emit("kINeg", "i", self.diagonal)]
        if name in _BINARY:
            a, b = args
            op = _BINARY[name][0 if a.kind == "f" else 1]
            if op is None:
                raise Unsupported(f"{name} on {'float32' if a.kind == 'f' else 'integers'}")
            return [self.emit(op, "b" if name in _COMPARE else a.kind, a, b)]
        if name in _UNARY:
            (a,) = args
            if name == "not" and a.kind == "b":
                return [self.emit("kIXor", "b", a, self.const(1, "b"))]
            op = _UNARY[name][0 if a.kind == "f" else 1]
            if op is None:
                raise Unsupported(f"{name} on {'float32' if a.kind == 'f' else 'integers'}")
            return [self.emit(op, a.kind, a)]
        if name == "is_finite":
            return [self.emit("kFIsFinite", "b", args[0])]
        if name == "square":
            return [self.emit("kFMul" if args[0].kind == "f" else "kIMul", args[0].kind, args[0], args[0])]
        if name == "integer_pow":
            return [self.integer_pow(args[0], eqn.params["y"])]
        if name == "round":
            method = eqn.params.get("rounding_method")
            even = int(getattr(method, "value", method)) == int(lax.RoundingMethod.TO_NEAREST_EVEN)
            return [self.emit("kFRoundEven" if even else "kFRoundAway", "f", args[0])]
        if name == "select_n":
            return [self.select_n(args[0], args[1:])]
        if name == "clamp":
            low, x, high = args
            f = x.kind == "f"
            return [self.emit("kFMin" if f else "kIMin", x.kind,
                              self.emit("kFMax" if f else "kIMax", x.kind, x, low), high)]
        raise Unsupported(f"the primitive {name!r}")

    def convert(self, a: _Reg, kind: str) -> _Reg:
        if a.kind == kind:
            return a
        if (a.kind, kind) == ("b", "i"):  # 0/1 already
            return dataclasses.replace(a, kind="i")
        if kind == "b":
            zero = self.const(0.0 if a.kind == "f" else 0, a.kind)
            return self.emit("kFNe" if a.kind == "f" else "kINe", "b", a, zero)
        if kind == "f":
            return self.emit("kI2F", "f", a)
        return self.emit("kF2I", "i", a)  # float32 -> int32

    def integer_pow(self, a: _Reg, y: int) -> _Reg:
        mul = "kFMul" if a.kind == "f" else "kIMul"
        result, base, n = None, a, abs(y)
        while n:
            if n & 1:
                result = base if result is None else self.emit(mul, a.kind, result, base)
            n >>= 1
            if n:
                base = self.emit(mul, a.kind, base, base)
        if result is None:
            result = self.const(1.0 if a.kind == "f" else 1, a.kind)
        if y < 0:
            if a.kind != "f":
                raise Unsupported("a negative integer_pow of an integer")
            result = self.emit("kFDiv", "f", self.const(1.0, "f"), result)
        return result

    def select_n(self, which: _Reg, cases: list) -> _Reg:
        if len(cases) == 2:
            return self.emit("kSelect", cases[0].kind, which, cases[0], cases[1])
        out = cases[0]
        for k, case in enumerate(cases[1:], start=1):
            pick = self.emit("kIEq", "b", which, self.const(k, "i"))
            out = self.emit("kSelect", case.kind, pick, out, case)
        return out

    def read(self, env, eqn, starts=None) -> _Reg:
        """One element of a mod_aux array: a dynamic_slice's, or (``starts``, registers) a
        static slice's, its index clamped into the array."""
        array = env[id(eqn.invars[0])] if not isinstance(eqn.invars[0], jax_core.Literal) else None
        if not isinstance(array, _Array):
            raise Unsupported(f"{eqn.primitive.name} of a computed value")
        sizes = eqn.params.get("slice_sizes") or tuple(
            hi - lo for lo, hi in zip(eqn.params["start_indices"], eqn.params["limit_indices"]))
        if any(size != 1 for size in sizes):
            raise Unsupported(f"a slice of shape {tuple(sizes)} of mod_aux")
        if starts is None:
            starts = [self.scalar(env, var) for var in eqn.invars[1:]]
        flat = None
        stride = int(np.prod(array.shape))
        for dim, start in zip(array.shape, starts):
            stride //= dim
            index = self.convert(start, "i")
            index = self.emit("kIMin", "i", self.emit("kIMax", "i", index, self.const(0, "i")),
                              self.const(dim - 1, "i"))  # dynamic_slice's clamp
            if stride != 1:
                index = self.emit("kIMul", "i", index, self.const(stride, "i"))
            flat = index if flat is None else self.emit("kIAdd", "i", flat, index)
        if flat is None:
            flat = self.const(0, "i")
        size = int(np.prod(array.shape))
        value = self.emit("kGather", array.kind, flat, imm=(array.offset, size))
        if array.kind == "f" and array.entry is not None and self.gradients[array.entry]:
            self.reads.append(_Read(array, flat, value))
        return value


def _substituted(closed, float_positions: set, reads: list):
    """``closed`` as a function whose k-th read of a floating mod_aux entry (the positions
    ``float_positions`` of its invars) returns ``reads[k]`` instead (the read order of
    ``_Builder``): the mod with its reads as inputs, for ``jax.grad``."""
    counter = iter(range(len(reads) + 1))

    def evaluate(jaxpr, consts, args, floats):
        env = {}
        read = lambda v: v.val if isinstance(v, jax_core.Literal) else env[id(v)]
        for var, value in zip(jaxpr.constvars, consts):
            env[id(var)] = value
        for var, value in zip(jaxpr.invars, args):
            env[id(var)] = value
        float_ids = {id(jaxpr.invars[i]) for i in floats}
        for eqn in jaxpr.eqns:
            sub = mods.sub_jaxpr(eqn)
            inner = {i for i, v in enumerate(eqn.invars) if id(v) in float_ids}
            if eqn.primitive.name == "dynamic_slice" and id(eqn.invars[0]) in float_ids:
                outs = [jnp.reshape(reads[next(counter)], eqn.outvars[0].aval.shape)]
            elif sub is not None and inner and _reads_float_aux(sub, inner):
                outs = evaluate(sub.jaxpr, sub.consts, [read(v) for v in eqn.invars], inner)
            else:
                bind = eqn.primitive.get_bind_params(eqn.params)  # (subfuns, params) before jax 0.6
                subfuns, params = bind if isinstance(bind, tuple) else ((), bind)
                outs = eqn.primitive.bind(*subfuns, *[read(v) for v in eqn.invars], **params)
                outs = outs if eqn.primitive.multiple_results else [outs]
            for var, value in zip(eqn.outvars, outs):
                env[id(var)] = value
        return [read(v) for v in jaxpr.outvars]

    return lambda *args: evaluate(closed.jaxpr, closed.consts, args, float_positions)[0]


@dataclasses.dataclass(frozen=True)
class Programs:
    """A call's compiled mods: the int32 words the kernels take, and how mod_aux is packed."""
    words: np.ndarray            # header + instructions
    arrays: tuple                # _Array per mod_aux entry, then the mod's constant arrays
    constants: tuple             # numpy arrays of the constant _Arrays
    aux_floats: int
    scatters: bool               # the backward sums a cotangent of mod_aux
    gradients: tuple = ()        # per mod_aux entry: whether its reads get a cotangent

    def aux(self, mod_aux) -> jax.Array:
        """mod_aux (and the constants) packed as one float32 buffer (ints by their bits)."""
        parts = [*mod_aux, *self.constants]
        flat = []
        for array, x in zip(self.arrays, parts):
            x = jnp.asarray(x)
            x = (x.astype(jnp.float32) if array.kind == "f"
                 else lax.bitcast_convert_type(x.astype(jnp.int32), jnp.float32))
            flat.append(x.reshape(-1))
        return jnp.concatenate(flat) if flat else jnp.zeros((1,), jnp.float32)

    def cotangents(self, d_aux, mod_aux) -> tuple:
        """The per-entry cotangents of mod_aux from the summed ``d_aux`` [aux floats] (None
        where an entry gets none: ``gradients``)."""
        out = []
        for array, x, wanted in zip(self.arrays, mod_aux, self.gradients):
            size = int(np.prod(array.shape))
            out.append(d_aux[array.offset:array.offset + size].reshape(array.shape)
                       if wanted else None)
        return tuple(out)


def _scalars(*kinds):
    return [jax.ShapeDtypeStruct((), {"f": jnp.float32, "i": jnp.int32}[k]) for k in kinds]


class _Allocator:
    """Physical registers for a stream of virtual ones, each pool's from ``first[pool]``; each
    freed after its last use unless kept (or ``keep_all``: a tile program's, which the rows
    read)."""

    def __init__(self, first: dict, keep_all: bool = False):
        self.free = {pool: [] for pool in first}
        self.next = dict(first)
        self.top = dict(first)
        self.keep_all = keep_all
        self.where: dict[int, tuple[str, int]] = {}

    def assign(self, stream: list, pinned: dict, keep: set):
        last = {}
        for position, (_, dst, *operands) in enumerate(stream):
            for r in operands[:3]:
                if isinstance(r, _Reg):
                    last[r.serial] = position
        for position, (_, dst, *operands) in enumerate(stream):
            if dst is not None and dst.serial not in self.where and dst.serial not in pinned:
                pool = self.free[dst.pool]
                self.where[dst.serial] = (dst.pool, pool.pop() if pool else self._grow(dst.pool))
            for r in {r.serial: r for r in operands[:3] if isinstance(r, _Reg)}.values():
                # (a register of an earlier stream, a tile program's, is not this one's to free)
                if (last.get(r.serial) == position and r.serial in self.where
                        and r.serial not in keep and not self.keep_all):
                    pool, slot = self.where[r.serial]
                    self.free[pool].append(slot)

    def _grow(self, pool: str) -> int:
        slot = self.next[pool]
        self.next[pool] += 1
        self.top[pool] = max(self.top[pool], self.next[pool])
        return slot


def _single(shape) -> bool:
    return int(np.prod(shape)) == 1


def _reading_singles(mod, aux_avals, takes_score: bool):
    """``mod`` taking its one-element mod_aux entries as [1] arrays, each read by a
    dynamic_slice and reshaped to its own shape."""
    singles = [i for i, (shape, _) in enumerate(aux_avals) if _single(shape)]
    if not singles:
        return mod

    def reading(*args):
        lead = 5 if takes_score else 4
        aux = list(args[lead:])
        for i in singles:
            aux[i] = lax.dynamic_slice(aux[i], (jnp.int32(0),), (1,)).reshape(aux_avals[i][0])
        return mod(*args[:lead], *aux)
    return reading


@functools.lru_cache(maxsize=256)
def _compile(score_mod, mask_mod, aux_avals: tuple, gradients: tuple) -> Programs:
    arrays = []
    offset = 0
    for entry, (shape, dtype) in enumerate(aux_avals):
        arrays.append(_Array(offset, shape, _kind(dtype), entry))
        offset += int(np.prod(shape))
    # A one-element entry (a 0-d temperature, say) arrives as [1] and is read with a
    # dynamic_slice, so that its uses are reads like every other (and differentiable).
    aux_structs = [jax.ShapeDtypeStruct((1,) if _single(shape) else shape, dtype)
                   for shape, dtype in aux_avals]
    score_mod, mask_mod = (None if mod is None else _reading_singles(mod, aux_avals, takes_score)
                           for mod, takes_score in ((score_mod, True), (mask_mod, False)))
    inputs = {"s": _Reg(-1, "r", "f"), "kv": _Reg(-2, "k", "i"), "b": _Reg(-3, "c", "i"),
              "h": _Reg(-4, "c", "i"), "q": _Reg(-5, "q", "i"), "d": _Reg(-6, "d", "i")}
    fixed = {-1: ("r", ROW_INPUT["kRowScore"]), -2: ("r", ROW_INPUT["kRowKey"]),
             -3: ("u", UNIFORM_INPUT["kUniformBatch"]), -4: ("u", UNIFORM_INPUT["kUniformHead"]),
             -5: ("u", UNIFORM_INPUT["kUniformQuery"]), -6: ("d", DIAGONAL_INPUT["kDiagonal"])}
    builder = _Builder(arrays, inputs["kv"], inputs["q"], inputs["d"], gradients)
    index_inputs = [inputs["b"], inputs["h"], inputs["q"], inputs["kv"]]
    streams = {}
    outputs = {}
    if score_mod is not None:
        closed = jax.make_jaxpr(score_mod)(*_scalars("f", "i", "i", "i", "i"), *aux_structs)
        as_float = lambda value: value if value.kind == "f" else builder.convert(value, "f")
        start = builder.stream()
        (value,) = builder.run(closed, [inputs["s"], *index_inputs, *arrays])
        outputs["score"] = as_float(value)
        streams["score"] = (start, len(builder.code))
        # The backward: the mod again (its reads), then jax.grad with the reads as inputs, then
        # a scatter-add of the cotangent times each read's partial.
        start = builder.stream()
        (value,) = builder.run(closed, [inputs["s"], *index_inputs, *arrays])
        outputs["grad"] = as_float(value)
        reads = list(builder.reads)
        floats = {5 + a.entry for a in arrays[:len(aux_avals)] if a.kind == "f" and gradients[a.entry]}

        def gradient(s, read_values, b, h, q, kv, *aux):
            mod = lambda s, r: jnp.asarray(_substituted(closed, floats, r)(s, b, h, q, kv, *aux),
                                           jnp.float32)
            return jax.grad(mod, argnums=(0, 1))(s, read_values)

        grad_closed = jax.make_jaxpr(gradient)(
            *_scalars("f"), [jax.ShapeDtypeStruct((), jnp.float32) for _ in reads],
            *_scalars("i", "i", "i", "i"), *aux_structs)
        slope, *partials = builder.run(grad_closed, [inputs["s"], *[r.value for r in reads],
                                                     *index_inputs, *arrays])
        outputs["slope"] = slope
        grad_end = len(builder.code)
        for read, partial in zip(reads, partials):
            builder.code.append(("kScatterAdd", None, read.index, partial, None,
                                 read.array.offset, int(np.prod(read.array.shape))))
        streams["grad"] = (start, grad_end)
        streams["scatter"] = (grad_end, len(builder.code))
    if mask_mod is not None:
        closed = jax.make_jaxpr(mask_mod)(*_scalars("i", "i", "i", "i"), *aux_structs)
        start = builder.stream()
        (value,) = builder.run(closed, [*index_inputs, *arrays])
        if value.kind != "b":
            raise Unsupported("mask_mod must return a bool")
        streams["mask"] = (start, len(builder.code))
        outputs["mask"] = value
    return dataclasses.replace(_assemble(builder, streams, outputs, fixed, arrays, aux_avals),
                               gradients=gradients)


def _assemble(builder, streams, outputs, fixed, arrays, aux_avals) -> Programs:
    """The streams split into tile programs (the instructions of tile-invariant values, in
    order: they read nothing else) and row programs, registers for them and the words. Tile
    programs keep their registers (the rows read them); the mask's tile program runs beside
    the others', the forward's and the backward's programs may share registers, and the
    mask's row program stays apart from the backward's, which it runs between."""
    code = builder.code
    out_regs = {r.serial for r in outputs.values()}
    # Dead code out (jax.grad's jaxpr recomputes the mod's values it does not use): what the
    # programs' results and the scatter-adds read, back from them.
    used = set()
    for names, results in ((["score"], ["score"]), (["grad", "scatter"], ["grad", "slope"]),
                           (["mask"], ["mask"])):
        live = {outputs[r].serial for r in results if r in outputs}
        for i in reversed([i for name in names if name in streams for i in range(*streams[name])]):
            op, dst, *operands = code[i]
            if op == "kScatterAdd" or dst.serial in live:
                used.add(i)
                live.update(r.serial for r in operands[:3] if isinstance(r, _Reg))
    parts = {}
    for name, (start, end) in streams.items():
        ins = [code[i] for i in range(start, end) if i in used]
        tile = name != "scatter"
        parts[name + "_tile"] = [x for x in ins if tile and x[1] is not None and x[1].tile]
        parts[name] = [x for x in ins if not (tile and x[1] is not None and x[1].tile)]
    where: dict[int, tuple[str, int]] = {}
    top = {"r": ROW_INPUT["kModInputRows"], "d": DIAGONAL_INPUT["kModInputDiagonals"],
           "u": UNIFORM_INPUT["kModInputUniforms"]}
    base = dict(top)

    def allocate(names, first, keep_all=False):
        stream = [x for name in names for x in parts.get(name, ())]
        alloc = _Allocator(first, keep_all)
        alloc.assign(stream, fixed, out_regs)
        where.update(alloc.where)
        for pool in top:
            top[pool] = max(top[pool], alloc.top[pool])
        return alloc.top

    tiles = allocate(["mask_tile"], base, keep_all=True)
    score_top = allocate(["score"], allocate(["score_tile"], tiles, keep_all=True))
    grad_top = allocate(["grad", "scatter"], allocate(["grad_tile"], tiles, keep_all=True))
    allocate(["mask"], {pool: max(score_top[pool], grad_top[pool]) for pool in top})
    where.update(fixed)
    rows, diagonals, uniforms = top["r"], top["d"], top["u"]
    offsets = {"r": 0, "d": rows, "u": rows + diagonals}
    physical = lambda r: -1 if r is None else (lambda pool, slot: offsets[pool] + slot)(*where[r.serial])
    header = np.zeros(_HEADER_SIZE, np.int32)
    header[FIELD["kRowRegisters"]], header[FIELD["kDiagonalRegisters"]] = rows, diagonals
    header[FIELD["kUniformRegisters"]] = uniforms
    words = [header]
    position = 0
    for name, field in (("score_tile", "kScoreTile"), ("score", "kScore"), ("mask_tile", "kMaskTile"),
                        ("mask", "kMask"), ("grad_tile", "kGradTile"), ("grad", "kGrad"),
                        ("scatter", "kScatter")):
        ins = parts.get(name, [])
        header[FIELD[field + "Start"]], header[FIELD[field + "Count"]] = position, len(ins)
        position += len(ins)
        for op, dst, a, b, c, imm0, imm1 in ins:
            dst_id = 0 if op == "kScatterAdd" else physical(dst)
            words.append(np.array([OP[op], dst_id, physical(a), physical(b), physical(c), imm0,
                                   imm1], np.int32))
    for name, field in (("score", "kScoreOut"), ("mask", "kMaskOut"), ("grad", "kGradOut"),
                        ("slope", "kGradSlope")):
        header[FIELD[field]] = physical(outputs[name]) if name in outputs else 0
    aux_floats = sum(int(np.prod(a.shape)) for a in arrays)
    header[FIELD["kAuxFloats"]] = aux_floats
    return Programs(np.concatenate(words), tuple(arrays), tuple(builder.constant_data), aux_floats,
                    bool(parts.get("scatter")))


def compile_mods(cfg, mod_aux) -> Programs:
    """The programs of ``cfg``'s score_mod and mask_mod for mod_aux of these shapes and dtypes
    (arrays or ShapeDtypeStructs); raises Unsupported with the reason."""
    avals = tuple((tuple(np.shape(x)), np.dtype(x.dtype)) for x in mod_aux)
    gradients = mods.gradient_entries(cfg, mod_aux)
    try:
        return _compile(cfg.score_mod, cfg.mask_mod, avals, gradients)
    except Unsupported:
        raise
    except Exception as error:  # a mod that does not trace on scalars
        raise Unsupported(f"tracing it on scalar indices failed ({type(error).__name__}: {error})") from error


def unsupported(cfg, mod_aux) -> str | None:
    """Why the C++ kernel cannot run these mods (the call then runs on xla), or None."""
    if not cfg.has_mods:
        return None
    try:
        compile_mods(cfg, mod_aux)
    except Unsupported as error:
        return f"its mods cannot run in the C++ kernel: {error}"
    return None
