"""Run cpu_quant.c's NEON path (aarch64) under qemu-aarch64 and check its numbers against this host's build.

    .venv/bin/python scripts/check_neon.py [--keep DIR] [--target T] [--cpu CPU] [--sysroot DIR]

Needs zig (the `ziglang` package importable: `pip install ziglang`, or PYTHONPATH naming a directory
that holds it; else `zig` on PATH) and qemu-aarch64 (Debian's qemu-user). What it does:

1. Builds stage_node/kernels/cpu_quant.c with scripts/neon_harness.c (a driver that replays a list of
   calls on buffers read from a file) by `zig cc -target aarch64-linux-musl` with the flags
   cpu_native.compile_flags gives aarch64 (-O3 -ffp-contract=off), as a static executable: musl because
   there is no aarch64 glibc sysroot here for a dynamic one (`--target aarch64-linux-gnu --sysroot DIR`
   would build that one and pass DIR to qemu's -L; not tried here). zig has no OpenMP runtime for the target: the build is
   without -fopenmp, one thread (threads split output features and (row, head) pairs only, never a sum,
   so they do not change the numbers). zig's default CPU for the target is generic ARMv8.0-A, and qemu
   runs it as a Cortex-A53 (`--cpu`): an instruction newer than ARMv8.0 (dotprod, fp16) would stop it. The
   harness must report lp_isa() == 1 (NEON).
2. Replays the same calls through the host's own build (cpu_native.build(), loaded by ctypes), and
   the harness built by the host's compiler as well (its buffers must equal the ctypes run's bit for
   bit: the harness is checked too).
3. Checks, for lp_int4_mm / lp_int8_mm on random packed matrices (pack_int4 / pack_int8) of shapes
   that are and are not multiples of the tiles (4 features, 2 rows, 32 inputs), 1, 2, 3 and 8 rows,
   strided rows: both builds within tests/unit/test_cpu_kernels.py's bound() of the float64 product
   of the dequantized weights; the NEON product against the host's (reported); and on the NEON build
   a row's bits equal among 1, 2, 3 or 8 rows. For lp_layers on small random layer sets (int4, int8
   and mixed layers; biases, q/k norms, windows, a layer without RoPE; SiLU and GELU; a head of 10 for
   the scalar loops): one sequence's prompt then decode rows, the prompt in two chunks, and the same
   sequence beside a second one; every output row and the final KV pools within 1e-4 of the host's
   (max |difference| over max |host value|, per buffer; the builds differ only in float summation
   order), and on the NEON build a row's bits equal in all three schedules.

Prints each check and PASS / FAIL; exits 1 on any failure, 2 when a tool is missing. The speed of the
NEON path is not measured (emulation says nothing about it).
"""
from __future__ import annotations

import argparse
import ctypes
import importlib.util
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.unit.test_cpu_kernels.bound

from logicpipe.stage_node.kernels import cpu_native
from logicpipe.stage_node.model.rope import RopeTables
from tests.unit.test_cpu_kernels import bound

HARNESS = ROOT / "scripts" / "neon_harness.c"
LAYER_TOL = 1e-4
LAYER_WORDS = 25  # lp_layer: 4 mats of 4 words, 7 pointers, rope, window
POINTER_WORDS = (0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 18, 19, 20, 21, 22)
assert ctypes.sizeof(cpu_native.Layer) == 8 * LAYER_WORDS


def zig_command() -> list[str] | None:
    if importlib.util.find_spec("ziglang") is not None:
        return [sys.executable, "-m", "ziglang"]
    zig = shutil.which("zig")
    return [zig] if zig else None


class Program:
    """Buffers (raw bytes) and the calls to replay on them (neon_harness.c's format)."""

    def __init__(self):
        self.bufs: list[bytes] = []
        self.calls: list[tuple[int, list[int], list[int]]] = []

    def buf(self, t: torch.Tensor | bytes) -> int:
        if isinstance(t, torch.Tensor):
            t = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        self.bufs.append(bytes(t))
        return len(self.bufs) - 1

    def call(self, op: int, a: list[int], b: list[int]) -> None:
        self.calls.append((op, a + [0] * (6 - len(a)), b + [0] * (12 - len(b))))

    def serialize(self) -> bytes:
        out = [struct.pack("<q", len(self.bufs))]
        for b in self.bufs:
            out += [struct.pack("<q", len(b)), b]
        out.append(struct.pack("<q", len(self.calls)))
        for op, a, b in self.calls:
            out.append(struct.pack("<19q", op, *a, *b))
        return b"".join(out)


def read_bufs(data: bytes) -> list[bytes]:
    (n,), at, out = struct.unpack_from("<q", data), 8, []
    for _ in range(n):
        (size,) = struct.unpack_from("<q", data, at)
        out.append(data[at + 8: at + 8 + size])
        at += 8 + size
    return out


def run_ctypes(prog: Program, lib: ctypes.CDLL) -> list[bytes]:
    """The calls through a library loaded by cpu_native (the host's build)."""
    bufs = [ctypes.create_string_buffer(b, len(b) or 1) for b in prog.bufs]
    addr = [ctypes.addressof(b) for b in bufs]
    for op, a, b in prog.calls:
        if op in (1, 2):
            fn = lib.lp_int4_mm if op == 1 else lib.lp_int8_mm
            rc = fn(addr[b[0]], a[3], a[0], a[1], addr[b[1]], addr[b[2]], a[2], addr[b[3]], a[4], a[5])
        else:
            words = (ctypes.c_uint64 * (a[0] * LAYER_WORDS)).from_buffer_copy(bufs[b[1]].raw[: 8 * a[0] * LAYER_WORDS])
            for l in range(a[0]):
                for k in POINTER_WORDS:
                    w = words[l * LAYER_WORDS + k]
                    words[l * LAYER_WORDS + k] = addr[w - 1] if w else 0
            rc = lib.lp_layers(ctypes.cast(addr[b[0]], ctypes.POINTER(cpu_native.Dims)),
                               ctypes.cast(words, ctypes.POINTER(cpu_native.Layer)), a[0], addr[b[2]], a[1],
                               *(addr[i] for i in b[3:6]), a[2], *(addr[i] for i in b[6:10]), a[3])
        if rc:
            raise RuntimeError(f"host call op {op} returned {rc}")
    return [b.raw[: len(p)] for b, p in zip(bufs, prog.bufs)]


def run_exe(prog: Program, cmd: list[str], work: Path, name: str) -> tuple[list[bytes], str]:
    (work / "in.bin").write_bytes(prog.serialize())
    out = work / f"{name}.out.bin"
    proc = subprocess.run([*cmd, str(work / "in.bin"), str(out)], check=False, capture_output=True, text=True,
                          timeout=600)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return read_bufs(out.read_bytes()), proc.stdout.strip()


def f32(b: bytes, shape) -> torch.Tensor:
    return torch.frombuffer(bytearray(b), dtype=torch.float32).reshape(shape)


# ------------------------------------------------------------------------------------------------ products

INT4_SHAPES = [(30, 64), (208, 96), (16, 32), (45, 1536)]   # (N, K): K a multiple of 32 (int4's groups)
INT8_SHAPES = [(203, 70), (5, 33), (96, 64), (13, 1000)]
ROW_CALLS = [(0, 8), (0, 1), (5, 1), (7, 1), (0, 2), (3, 2), (0, 3), (5, 3)]  # (first row, rows) of x [8, K]


def random_int4(n: int, k: int, g: torch.Generator):
    q = torch.randint(0, 16, (n, k), generator=g)
    scale = (torch.rand(n, k // 32, generator=g) * 0.02 + 0.002).to(torch.bfloat16)
    zero = (torch.randn(n, k // 32, generator=g) * 0.01).to(torch.bfloat16)
    deq = (q.double() - 8).reshape(n, -1, 32) * scale.double()[..., None] + zero.double()[..., None]
    return cpu_native.pack_int4(q, scale, zero), deq.reshape(n, k)


def random_int8(n: int, k: int, g: torch.Generator):
    q = torch.randint(-127, 128, (n, k), generator=g).to(torch.int8)
    scale = torch.rand(n, generator=g) * 0.001 + 1e-4
    return cpu_native.pack_int8(q, scale), q.double() * scale.double()[:, None]


def products(prog: Program, g: torch.Generator) -> list[dict]:
    cases = []
    for fmt, shapes in (("int4", INT4_SHAPES), ("int8", INT8_SHAPES)):
        for n, k in shapes:
            (w, s), deq = (random_int4 if fmt == "int4" else random_int8)(n, k, g)
            x = torch.randn(8, k, generator=g) * torch.rand(8, 1, generator=g) * 3
            x[1, :32] = 0.0  # a block of zeros (its scale 0)
            wb, sb = prog.buf(w), prog.buf(s)
            case = {"fmt": fmt, "n": n, "k": k, "deq": deq, "x": x, "calls": []}
            for at, rows in ROW_CALLS:
                out = prog.buf(torch.zeros(rows, n))
                prog.call(1 if fmt == "int4" else 2, [rows, k, n, k, n, 1], [prog.buf(x[at: at + rows]), wb, sb, out])
                case["calls"].append((at, rows, out, None))
            # strided: 3 rows ldx = k + 5 apart, written ldo = n + 3 apart
            xs = torch.zeros(3, k + 5)
            xs[:, :k] = x[2:5]
            out = prog.buf(torch.full((3, n + 3), 7.0))
            prog.call(1 if fmt == "int4" else 2, [3, k, n, k + 5, n + 3, 1], [prog.buf(xs), wb, sb, out])
            case["calls"].append((2, 3, out, n + 3))
            cases.append(case)
    return cases


# ------------------------------------------------------------------------------------------------ layers

class LayerSet:
    """Random layers of one model shape, their buffers in `prog`."""

    def __init__(self, prog: Program, g: torch.Generator, *, hidden, heads, kv_heads, head_dim, inter, act, layers):
        self.prog, self.g = prog, g
        self.hidden, self.heads, self.kv_heads, self.head_dim, self.inter = hidden, heads, kv_heads, head_dim, inter
        self.nl = len(layers)
        self.slots = 40
        self.dims = cpu_native.Dims(hidden, heads, kv_heads, head_dim, inter, self.slots, 1e-6, head_dim ** -0.5, act)
        qkv = (heads + 2 * kv_heads) * head_dim
        arr = (cpu_native.Layer * self.nl)()
        for i, spec in enumerate(layers):
            fmts = spec["fmts"]
            mats = [self.mat(fmts[0], qkv, hidden), self.mat(fmts[1], hidden, heads * head_dim),
                    self.mat(fmts[2], 2 * inter, hidden), self.mat(fmts[3], hidden, inter)]
            bias = [self.vec(n, 0.05) if spec.get("bias") else 0 for n in (qkv, hidden, 2 * inter, hidden)]
            norms = [self.vec(hidden, 0.1, 1.0), self.vec(hidden, 0.1, 1.0)]
            qk = self.vec((heads + kv_heads) * head_dim, 0.1, 1.0) if spec.get("qk_norm") else 0
            arr[i] = cpu_native.Layer(*mats, *bias, *norms, qk, spec.get("rope", 1), spec.get("window", 0))
        self.layers = prog.buf(bytes(arr))
        self.dims_buf = prog.buf(bytes(self.dims))
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        rope = RopeTables(inv_freq, 1.0, dtype=torch.float32, device=torch.device("cpu"))
        self.table_len = 24
        self.cos, self.sin = prog.buf(rope.cos[: self.table_len]), prog.buf(rope.sin_signed[: self.table_len])

    def vec(self, n, sd, mean=0.0) -> int:  # a pointer word: buffer number + 1
        return self.prog.buf(torch.randn(n, generator=self.g) * sd + mean) + 1

    def mat(self, fmt, n, k) -> cpu_native.Mat:
        (w, s), _ = (random_int4 if fmt == 4 else random_int8)(n, k, self.g)
        return cpu_native.Mat(self.prog.buf(w) + 1, self.prog.buf(s) + 1, n, fmt)

    def pool(self) -> int:
        return self.prog.buf(torch.zeros(self.nl, 2, self.kv_heads, self.slots, self.head_dim))

    def step(self, kv: int, x: torch.Tensor, rows: list[tuple[int, int]], tables: torch.Tensor) -> int:
        """One lp_layers call: rows (sequence, position) of x [T, hidden]; tables [seqs, table_len] of slots."""
        pos = torch.tensor([p for _, p in rows])
        seq = torch.tensor([s for s, _ in rows])
        xb = self.prog.buf(x)
        b = [self.dims_buf, self.layers, xb, self.prog.buf(pos), self.prog.buf(seq), self.prog.buf(tables),
             self.prog.buf(tables[seq, pos]), kv, self.cos, self.sin]
        self.prog.call(3, [self.nl, len(rows), self.table_len, 1], b)
        return xb


def layer_schedules(ls: LayerSet, g: torch.Generator) -> dict:
    """Sequence a (11 prompt rows, 3 decode rows) in three schedules; the output buffer of each of a's
    rows (row -> (buffer, row in it)) per schedule, and the pools."""
    H, plen, dec = ls.hidden, 11, 3
    xa = torch.randn(plen + dec, H, generator=g)
    xb = torch.randn(6 + dec, H, generator=g)
    perm = torch.randperm(ls.slots, generator=g)
    ta, tb = perm[: ls.table_len], perm[ls.table_len: ls.slots].repeat(2)[: ls.table_len]  # b: the other 16 slots
    one, two = ta[None], torch.stack([ta, tb])
    out = {}
    # whole prompt, then decode rows
    kv = ls.pool()
    rows = {}
    buf = ls.step(kv, xa[:plen], [(0, p) for p in range(plen)], one)
    rows.update({p: (buf, p) for p in range(plen)})
    for p in range(plen, plen + dec):
        rows[p] = (ls.step(kv, xa[p: p + 1], [(0, p)], one), 0)
    out["whole"] = (rows, kv)
    # the prompt in chunks of 3 and 8 (other pairs of rows share the products' tiles)
    kv, rows = ls.pool(), {}
    buf = ls.step(kv, xa[:3], [(0, p) for p in range(3)], one)
    rows.update({p: (buf, p) for p in range(3)})
    buf = ls.step(kv, xa[3:plen], [(0, p) for p in range(3, plen)], one)
    rows.update({p: (buf, p - 3) for p in range(3, plen)})
    for p in range(plen, plen + dec):
        rows[p] = (ls.step(kv, xa[p: p + 1], [(0, p)], one), 0)
    out["chunked"] = (rows, kv)
    # beside sequence b: a's prompt alone, then a's decode rows beside b's prompt rows (a first, paired with
    # b's first row), then both decoding (a second)
    kv, rows = ls.pool(), {}
    buf = ls.step(kv, xa[:plen], [(0, p) for p in range(plen)], one)
    rows.update({p: (buf, p) for p in range(plen)})
    buf = ls.step(kv, torch.cat([xa[plen: plen + 1], xb[:6]]), [(0, plen)] + [(1, p) for p in range(6)], two)
    rows[plen] = (buf, 0)
    for k in range(1, dec):
        buf = ls.step(kv, torch.cat([xb[5 + k: 6 + k], xa[plen + k: plen + k + 1]]), [(1, 5 + k), (0, plen + k)], two)
        rows[plen + k] = (buf, 1)
    out["beside another"] = (rows, kv)
    return out


LAYER_SETS = [  # fmts: qkv, o, gate_up, down (4: int4, 8: int8)
    {"name": "head 16, SiLU", "hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 16, "inter": 96, "act": 0,
     "layers": [{"fmts": (4, 4, 4, 4)},
                {"fmts": (8, 8, 8, 8), "bias": True, "qk_norm": True, "window": 5},
                {"fmts": (4, 8, 4, 8), "rope": 0}]},
    {"name": "head 10, GELU", "hidden": 64, "heads": 4, "kv_heads": 1, "head_dim": 10, "inter": 64, "act": 1,
     "layers": [{"fmts": (4, 8, 4, 4)},
                {"fmts": (8, 8, 8, 8), "bias": True, "qk_norm": True, "window": 3}]},
]


# ------------------------------------------------------------------------------------------------ checks

class Report:
    def __init__(self):
        self.failed = 0

    def check(self, ok: bool, what: str) -> None:
        self.failed += not ok
        print(f"  {'ok  ' if ok else 'FAIL'} {what}")


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / max(float(b.abs().max()), 1e-30))


def check_products(rep: Report, cases, neon, host) -> None:
    print("products (lp_int4_mm, lp_int8_mm):")
    worst = {"int4": 0.0, "int8": 0.0}
    used = {"int4": 0.0, "int8": 0.0}  # NEON: the largest |error| / bound()
    for c in cases:
        n, k, deq, x = c["n"], c["k"], c["deq"], c["x"]
        within = {"neon": True, "host": True}
        invariant, full = True, None
        for at, rows, out, ldo in c["calls"]:
            shape = (rows, ldo or n)
            got = {"neon": f32(neon[out], shape)[:, :n], "host": f32(host[out], shape)[:, :n]}
            if ldo:  # the columns past n are not written
                for build, bufs in (("neon", neon), ("host", host)):
                    within[build] &= bool((f32(bufs[out], shape)[:, n:] == 7.0).all())
            xr = x[at: at + rows].double()
            ref = xr @ deq.T
            lim = bound("native", deq, xr, ref)
            for build, y in got.items():
                within[build] &= bool(((y.double() - ref).abs() <= lim).all())
            used[c["fmt"]] = max(used[c["fmt"]], float(((got["neon"].double() - ref).abs() / lim).max()))
            worst[c["fmt"]] = max(worst[c["fmt"]], rel_diff(got["neon"], got["host"]))
            if full is None:
                full = got["neon"]  # the 8-row call comes first
            invariant &= torch.equal(got["neon"], full[at: at + rows])
        what = f"{c['fmt']} {n}x{k}, 1/2/3/8 rows and strided"
        rep.check(within["neon"], f"{what}: NEON within bound()")
        rep.check(within["host"], f"{what}: host within bound()")
        rep.check(invariant, f"{what}: NEON row bits the same among 1, 2, 3, 8 rows")
    for fmt, d in worst.items():
        print(f"  ({fmt}: NEON's largest error {used[fmt]:.2f} of bound(); NEON against host: "
              f"max |diff| / max |host| = {d:.2e})")


def check_layers(rep: Report, sets, neon, host) -> None:
    print(f"layers (lp_layers; NEON against host within {LAYER_TOL:g} of max |host|):")
    for spec, ls, sched in sets:
        worst, ok = 0.0, True
        H = ls.hidden
        bufs = {buf for rows, _ in sched.values() for buf, _ in rows.values()} | {kv for _, kv in sched.values()}
        for b in sorted(bufs):
            d = rel_diff(f32(neon[b], (-1,)), f32(host[b], (-1,)))
            worst, ok = max(worst, d), ok and d <= LAYER_TOL
        finite = all(torch.isfinite(f32(neon[b], (-1,))).all() for b in bufs)
        rep.check(ok and finite, f"{spec['name']}, {ls.nl} layers: outputs and KV pools, max rel. diff {worst:.2e}")
        rows = {name: torch.stack([f32(neon[buf], (-1, H))[r] for buf, r in rs.values()])
                for name, (rs, _) in sched.items()}
        base = rows["whole"]
        for name, t in rows.items():
            if name != "whole":
                rep.check(torch.equal(t, base), f"{spec['name']}: NEON rows' bits the same, whole prompt and {name}")


# ------------------------------------------------------------------------------------------------ main

def build_neon(zig: list[str], target: str, exe: Path) -> tuple[list[str], str]:
    flags = [f for f in cpu_native.compile_flags(machine="aarch64", flags=set()) if f not in ("-shared", "-fPIC")]
    note = ""
    for attempt in (flags, [f for f in flags if f != "-fopenmp"]):
        proc = subprocess.run([*zig, "cc", "-target", target, *attempt, "-o", str(exe), str(cpu_native.SOURCE),
                               str(HARNESS), "-lm"], check=False, capture_output=True, text=True, timeout=900)
        if proc.returncode == 0:
            if "-fopenmp" not in attempt:
                note = " (no OpenMP with zig for this target: built without -fopenmp, one thread)"
            return attempt, note
        err = proc.stderr.strip()
    raise RuntimeError(f"zig cc failed: {err}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keep", type=Path, help="build and data directory to keep (default: a temporary one)")
    ap.add_argument("--target", default="aarch64-linux-musl", help="zig target (default: %(default)s, static)")
    ap.add_argument("--cpu", default="cortex-a53", help="qemu's CPU (default: %(default)s, plain ARMv8.0-A)")
    ap.add_argument("--sysroot", help="qemu-aarch64 -L: the aarch64 root a dynamic (glibc) build needs")
    args = ap.parse_args()
    zig, qemu = zig_command(), shutil.which("qemu-aarch64")
    if zig is None or qemu is None:
        print("check_neon: needs " + " and ".join(w for w, have in (("zig (ziglang or zig on PATH)", zig),
                                                                ("qemu-aarch64", qemu)) if not have))
        return 2
    host_lib = cpu_native.build()
    if host_lib is None:
        print("check_neon: the host build of cpu_quant.c failed (no C compiler?)")
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        exe = work / "neon_harness"
        flags, note = build_neon(zig, args.target, exe)
        print(f"built {exe.name}: zig cc -target {args.target} {' '.join(flags)}{note}")
        g = torch.Generator().manual_seed(0)
        prog = Program()
        cases = products(prog, g)
        sets = []
        for spec in LAYER_SETS:
            ls = LayerSet(prog, g, **{k: v for k, v in spec.items() if k != "name"})
            sets.append((spec, ls, layer_schedules(ls, g)))
        qemu_cmd = [qemu, "-cpu", args.cpu] + (["-L", args.sysroot] if args.sysroot else []) + [str(exe)]
        neon, said = run_exe(prog, qemu_cmd, work, "neon")
        print(f"ran under qemu-aarch64 -cpu {args.cpu}: {said}; host build: {cpu_native.isa(host_lib)}")
        host = run_ctypes(prog, host_lib)
        rep = Report()
        rep.check(said.startswith("isa 1,"), "the aarch64 build runs the NEON path (lp_isa() == 1)")
        cc = cpu_native.compiler()
        if cc:  # the harness itself, built for the host: the same bits as the ctypes calls
            host_exe = work / "host_harness"
            hflags = [f for f in cpu_native.compile_flags() if f not in ("-shared", "-fPIC", "-fopenmp")]
            subprocess.run([cc, *hflags, "-o", str(host_exe), str(cpu_native.SOURCE), str(HARNESS), "-lm"],
                           check=True, capture_output=True, timeout=300)
            same = run_exe(prog, [str(host_exe)], work, "host")[0] == host
            rep.check(same, "the harness built for the host: the ctypes calls' bits")
        check_products(rep, cases, neon, host)
        check_layers(rep, sets, neon, host)
    calls = len(prog.calls)
    print(f"{'PASS' if not rep.failed else 'FAIL'}: {calls} calls, {rep.failed} failed check(s)")
    return 1 if rep.failed else 0


if __name__ == "__main__":
    sys.exit(main())
