"""The layout holds: one import namespace, imports only in the allowed directions, no import cycle,
no function-local import but the listed optional ones, and a wheel that installs `logicpipe` only."""
from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {  # folder -> the package it installs as
    ROOT / "protos" / "logicpipe": "logicpipe",
    ROOT / "common": "logicpipe.common",
    ROOT / "planner": "logicpipe.planner",
    ROOT / "stage_node": "logicpipe.stage_node",
    ROOT / "controller": "logicpipe.controller",
}
# what each part may import of ours (the contract is the root package's own modules and v1)
ALLOWED = {
    "contract": {"contract"},
    "logicpipe.common": {"contract", "logicpipe.common"},
    "logicpipe.planner": {"logicpipe.planner"},
    "logicpipe.stage_node": {"contract", "logicpipe.common", "logicpipe.stage_node"},
    "logicpipe.controller": {"contract", "logicpipe.common", "logicpipe.planner", "logicpipe.controller"},
}
# function-local imports that stay, and why: optional or heavy dependencies off the common path
LOCAL_IMPORTS = {
    "controller/cli/gguf_convert.py": {"gguf", "numpy", "torch", "transformers"},  # converting a GGUF once (the
    # `convert` extra); lpctl reaches this module and must not load torch to print a status
    "controller/cli/gguf_rope.py": {"numpy"},  # the same conversion: a llama3 table from a GGUF
    "controller/cli/gguf_hybrid.py": {"numpy"},  # the same conversion: Qwen3-Next's / Qwen3.5's linear layers
    "controller/cli/gguf_tokenizer.py": {"gguf", "transformers"},  # the same conversion: the GGUF's tokenizer
    "stage_node/engine/draft_model.py": {"torch", "transformers"},  # --draft-model only: transformers costs seconds to load
    "stage_node/model/rope.py": {"transformers"},  # RoPE scaling variants only (the default RoPE needs none)
    "stage_node/kernels/quant.py": {"bitsandbytes"},  # the `quant` extra: --quantize nf4|fp4
    "stage_node/kernels/invariant.py": {"triton"},  # CUDA stages only (--batch-invariant; ships with torch's CUDA wheels)
    "stage_node/kernels/fused.py": {"triton"},  # the same: CUDA stages' fused layer kernels
    "stage_node/kernels/tp_reduce.py": {"triton"},  # the same: CUDA tensor-parallel ranks' fused all-reduce
    "stage_node/kernels/grouped.py": {"triton"},  # the same: CUDA stages' grouped-expert kernels
    "stage_node/kernels/gpu_quant_kernels.py": {"triton"},  # the same: CUDA stages' int4 / int8 kernels
    # structured output only: xgrammar's import takes a second, transformers' more (the tokenizer)
    "protos/logicpipe/sampling.py": {"xgrammar"},
    "controller/jobs/grammar_check.py": {"xgrammar"},  # the door's check that a schema admits some value
    "stage_node/model/grammar.py": {"xgrammar", "transformers"},
}


def modules() -> dict[str, Path]:
    """Every module of ours by its import name (the generated stubs excepted)."""
    out = {}
    for folder, package in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("")
            if rel.parts[0] == "v1":
                continue
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([package, *parts])] = path
    return out


def part_of(module: str) -> str:
    for package in ("logicpipe.common", "logicpipe.planner", "logicpipe.stage_node", "logicpipe.controller"):
        if module == package or module.startswith(package + "."):
            return package
    return "contract"


def module_imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of ours that `path` imports at module level."""
    out = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("logicpipe")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("logicpipe") and not node.level:
            for a in node.names:  # `from logicpipe.x import y`: y may be a module
                sub = f"{node.module}.{a.name}"
                out.add(sub if sub in known else node.module)
    return {m for m in out if not m.startswith("logicpipe.v1")}


def test_imports_go_the_allowed_way_and_form_no_cycle():
    known = modules()
    assert len(known) > 60
    graph = {m: module_imports(p, known) for m, p in known.items()}
    for m, deps in graph.items():
        for d in deps:
            assert d in known, f"{m} imports {d}, which is not a module of ours"
            assert part_of(d) in ALLOWED[part_of(m)], f"{m} may not import {d}"
    # no cycle: a depth-first search that never meets a module on its own path
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            assert state.get(d) != 1, "import cycle: " + " -> ".join([*path, m, d])
            if d not in state:
                visit(d, [*path, m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])


def test_no_function_local_imports_but_the_listed_ones():
    for module, path in modules().items():
        rel = str(path.relative_to(ROOT))
        allowed = LOCAL_IMPORTS.get(rel, set())
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    names = [node.module or "."]
                else:
                    continue
                for name in names:
                    assert name.split(".")[0] in allowed, f"{rel}:{node.lineno} imports {name} inside {fn.name}"


def test_the_wheel_installs_logicpipe_only(tmp_path):
    """`pip install .` puts one package in site-packages, and every console script resolves in it."""
    src = tmp_path / "src"  # a copy: a build writes build/ and *.egg-info beside its sources
    for folder in PACKAGES:
        shutil.copytree(folder, src / folder.relative_to(ROOT), ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path), str(src)], check=True, capture_output=True, cwd=tmp_path)
    wheel = next(tmp_path.glob("logicpipe-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        tops = {n.split("/")[0] for n in names}
        entry_points = z.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert {t for t in tops if not t.endswith(".dist-info")} == {"logicpipe"}, tops
    for sub in ("common", "common/security", "planner", "stage_node", "controller", "v1"):
        assert f"logicpipe/{sub}/__init__.py" in names
    assert "logicpipe/stage_node/kernels/cpu_quant.c" in names  # the native CPU kernels' source, built at first use
    for page in ("index.html", "dashboard.js", "dashboard.css"):  # the dashboard's files (controller.api.dashboard)
        assert f"logicpipe/controller/api/static/{page}" in names, page
    scripts = dict(line.split(" = ") for line in entry_points.splitlines() if " = " in line)
    assert set(scripts) == {"logicpipe-controller", "logicpipe-stage", "lpctl"}
    for target in scripts.values():
        module = target.split(":")[0]
        assert f"{module.replace('.', '/')}.py" in names, target
