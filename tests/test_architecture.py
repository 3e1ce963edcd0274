"""The layering rules of docs/architecture.md, checked on the source tree (AST, no imports run)."""

import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parent.parent / "fastgrad"

KERNEL_ALLOWED = {
    "fastgrad.dtypes",
    "fastgrad._jit",
    "fastgrad.tiling",
    "fastgrad.vocab_parallel",
    "fastgrad.enums",
    "fastgrad._config",
    "fastgrad._outcache",
    "fastgrad._onednn",
    "fastgrad._cpu",
    "fastgrad.errors",
}
SHARED_KERNEL_HELPERS = {"_gemm", "_linear", "_vmath", "_strided", "_bf16dot", "_native"}
#: the LM-head family's package (fastgrad/lm_head/: engine, loop, passes, epilogues/): kernel-level code
#: shared by the three LM-head kernels, under the kernels' rules
LM_HEAD = "fastgrad.lm_head"


def _imports(path: pathlib.Path):
    """(module, names) of every import in ``path``, relative imports resolved."""
    tree = ast.parse(path.read_text())
    pkg = ".".join(path.relative_to(PKG.parent).with_suffix("").parts[:-1])
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, []
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            yield mod, [a.name for a in node.names]


def _files(sub):
    return sorted((PKG / sub).glob("*.py"))


@pytest.mark.parametrize(
    "path",
    _files("kernels") + _files("reference") + _files("lm_head") + _files("lm_head/epilogues"),
    ids=lambda p: f"{p.parent.name}/{p.name}",
)
def test_kernels_and_goldens_are_pure(path):
    layer = {"epilogues": "lm_head"}.get(path.parent.name, path.parent.name)
    for mod, names in _imports(path):
        if layer in ("kernels", "lm_head") and mod.startswith(LM_HEAD):
            continue  # the LM-head package: kernel-level helpers of the LM-head kernels
        assert not mod.startswith("fastgrad.backends"), f"{path.name} imports the registry ({mod})"
        assert not mod.startswith("torch"), f"{path.name} imports torch"
        helper = layer == "lm_head" and mod.startswith("fastgrad.kernels")  # the shared helpers, checked below
        if mod.startswith("fastgrad.") and not mod.startswith(f"fastgrad.{layer}") and not helper:
            assert mod in KERNEL_ALLOWED, f"{path.name} imports {mod}"
        if mod == "fastgrad.errors":  # a kernel raises only its invariants; the user's errors are the op layer's
            assert names == ["InternalError"], f"{path.name} imports {names} from fastgrad.errors"
        if mod.startswith("fastgrad.kernels.") and layer in ("kernels", "lm_head"):
            leaf = mod.rsplit(".", 1)[1]
            assert leaf in SHARED_KERNEL_HELPERS, f"{path.name} imports another kernel ({mod})"
        if mod == "fastgrad.kernels" or mod == "fastgrad.reference":
            assert all(n in SHARED_KERNEL_HELPERS for n in names), (path.name, names)
        if layer == "reference":
            assert not mod.startswith(("fastgrad.kernels", LM_HEAD)), f"golden {path.name} imports a kernel"


@pytest.mark.parametrize("sub", ["cli", "torch", "torch/nn", "benchmarks", "ascend", "torch_npu.py"])
def test_front_ends_call_only_public_ops(sub):
    paths = [PKG / sub] if sub.endswith(".py") else _files(sub)
    assert paths, sub
    for path in paths:
        for mod, names in _imports(path):
            assert not mod.startswith(("fastgrad.kernels", LM_HEAD)), f"{sub}/{path.name} imports {mod}"
            # the op layer's private modules too: plans through the public fastgrad.plan / gemm_choice
            assert not mod.startswith("fastgrad.ops._"), f"{sub}/{path.name} imports {mod}"
            assert not (mod == "fastgrad.ops" and any(n.startswith("_") for n in names)), f"{sub}/{path.name}"
            assert not mod.startswith("fastgrad.reference"), f"{sub}/{path.name} imports {mod}"
            if mod == "fastgrad":
                assert "kernels" not in names and "reference" not in names, f"{sub}/{path.name}"


def test_plans_are_made_only_in_the_op_layer():
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG).as_posix()
        if rel.startswith(("ops/", "tiling.py", "cli/", "benchmarks/")):
            continue  # the op_host layer, the plan module, and front ends that inspect plans
        src = path.read_text()
        assert "plan_linear_cross_entropy(" not in src, f"{rel} makes a tile plan"
        assert "plan_training_loss(" not in src, f"{rel} makes the training loss's plan"
        assert "workspace_budget(" not in src or not rel.startswith(("kernels/", "lm_head/")), f"{rel} reads the budget"


def test_nothing_registers_itself():
    for path in [
        *PKG.glob("kernels/*.py"),
        *PKG.glob("lm_head/**/*.py"),
        *PKG.glob("reference/*.py"),
        *PKG.glob("backends/*.py"),
    ]:
        assert "@implements" not in path.read_text(), path


def test_every_op_has_a_declaration_and_every_backend_a_table():
    import fastgrad as fg
    from fastgrad.backends import cpu, reference

    ops = [
        "fused_linear_online_max_sum",
        "fused_cross_entropy_loss_with_max_sum",
        "fused_linear_cross_entropy_loss_grad",
        "cross_entropy_loss_grad",
        "scaled_masked_softmax_backward",
        "smooth_l1_loss_backward",
        "embedding_dense_backward",
    ]
    import importlib

    for op in ops:
        mod = importlib.import_module(f"fastgrad.ops.{op}")
        assert mod.DECL.name == op and mod.DECL.aclnn.startswith("aclnn")
        assert getattr(fg, op).__doc__ and "Raises" in getattr(fg, op).__doc__
        assert op in cpu.IMPLS and op in reference.IMPLS


def test_gemm_spans_are_balanced_and_cover():
    """The fixed partitions of the pool: equal parts (±1) covering [0, M), from the shape only."""
    from fastgrad.kernels._gemm import _spans

    for M in (0, 1, 2, 7, 255, 256, 257, 440, 2048, 151936):
        for step in (1, 64, 256, 512):
            sp = _spans(M, step)
            assert len(sp) == -(-M // step)
            assert [a for a, _ in sp[1:]] == [b for _, b in sp[:-1]]
            if sp:
                assert sp[0][0] == 0 and sp[-1][1] == M
                sizes = [b - a for a, b in sp]
                assert max(sizes) <= step and max(sizes) - min(sizes) <= 1


def test_fused_loops_run_no_openmp_region():
    """The passes between the GEMMs of the fused kernels are serial nogil kernels run on the GEMM
    pool (``run_rows``), never Numba parallel kernels: OpenMP workers spinning after a parallel
    region took the cores from the next BLAS calls (docs in ``kernels/_gemm.py``)."""
    import fastgrad.kernels._linear as lin
    import fastgrad.kernels.fused_linear_cross_entropy_loss_grad as flce
    import fastgrad.kernels.fused_linear_online_max_sum as online
    import fastgrad.kernels.linear_cross_entropy as lce
    import fastgrad.lm_head.epilogues.flce_grad as flce_epilogue
    import fastgrad.lm_head.epilogues.online_stats as online_epilogue
    import fastgrad.lm_head.epilogues.recompute as recompute
    import fastgrad.lm_head.epilogues.train_rows as rows
    import fastgrad.lm_head.loop as loop
    import fastgrad.lm_head.passes as passes

    for mod in (lce, flce, online, lin, loop, passes, rows, recompute, flce_epilogue, online_epilogue):
        src = pathlib.Path(mod.__file__).read_text()
        assert "prange" not in src and "@pjit" not in src, mod.__name__


# ----------------------------------------------------------------------------------------------
# settings in one place; no import cycle (no whitelist for either)
# ----------------------------------------------------------------------------------------------

#: the layers above the ops (front ends: they may read their own environment, e.g. torchrun's)
FRONT_ENDS = ("cli/", "torch/", "benchmarks/", "ascend/", "torch_npu.py")


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _reads_settings_ambiently(path: pathlib.Path) -> list[str]:
    """What in ``path`` reads the environment or a context variable (AST): ``os.environ``,
    ``os.getenv``, ``environ`` imported from os, ``contextvars`` / ``ContextVar``."""
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os":
            if node.attr in ("environ", "getenv", "environb", "putenv"):
                found.append(f"os.{node.attr} (line {node.lineno})")
        elif isinstance(node, ast.ImportFrom) and node.module in ("os", "contextvars"):
            for a in node.names:
                if node.module == "contextvars" or a.name in ("environ", "getenv", "environb"):
                    found.append(f"from {node.module} import {a.name} (line {node.lineno})")
        elif isinstance(node, ast.Import):
            found += [f"import contextvars (line {node.lineno})" for a in node.names if a.name == "contextvars"]
        elif isinstance(node, ast.Name) and node.id == "ContextVar":
            found.append(f"ContextVar (line {node.lineno})")
    return found


def test_only_the_settings_module_reads_the_environment_or_a_context_variable():
    """docs/architecture.md: every setting is read in ``fastgrad/_config.py``; the op layer reads
    the settings once per call and passes plain values and the plan down — no module of the ops,
    backends, kernels, goldens or their helpers reads the environment or a context variable."""
    offenders = {}
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG).as_posix()
        if rel == "_config.py" or rel.startswith(FRONT_ENDS):
            continue
        found = _reads_settings_ambiently(path)
        if found:
            offenders[rel] = found
    assert not offenders, offenders


def test_kernels_and_goldens_read_no_setting():
    """Kernels and goldens take the plan and plain parameters: they import neither the settings
    module nor the op layer."""
    for path in _files("kernels") + _files("reference") + _files("lm_head") + _files("lm_head/epilogues"):
        for mod, _names in _imports(path):
            assert mod != "fastgrad._config", f"{path.parent.name}/{path.name} imports the settings"
            assert not mod.startswith("fastgrad.ops"), f"{path.parent.name}/{path.name} imports the op layer ({mod})"


def _import_graph() -> dict[str, set[str]]:
    """fastgrad's modules and the fastgrad modules each imports (any import, at any depth of the
    file: a function-level import is an edge too)."""
    mods = {_module_name(p): p for p in PKG.rglob("*.py")}

    def resolve(name: str) -> str:
        while name and name not in mods:
            name = name.rsplit(".", 1)[0] if "." in name else ""
        return name

    graph: dict[str, set[str]] = {}
    for m, path in mods.items():
        deps = set()
        for mod, names in _imports(path):
            if not mod.startswith("fastgrad"):
                continue
            targets = [f"{mod}.{n}" for n in names if f"{mod}.{n}" in mods] or [resolve(mod)]
            deps.update(targets)
        deps.discard(m)
        deps.discard("")
        graph[m] = deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in graph:
                    continue
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on_stack.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_cycle():
    """No two modules of fastgrad import each other, directly or through others — lazy
    (function-level) imports included; no whitelist."""
    assert _cycles(_import_graph()) == []


def test_the_cycle_finder_finds_cycles():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e2"}, "e2": set()}
    assert _cycles(g) == [["a", "b", "c"]]


def test_lm_head_plans_record_the_gemm_choice():
    """The op layer chooses the GEMMs once, from the settings, and records them in the plan the
    kernel takes (``tiling.GemmChoice``): a setting changes the plan, not the kernel's reading."""
    import ml_dtypes
    import numpy as np

    import fastgrad as fg

    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 16)).astype(ml_dtypes.bfloat16)
    w = rng.standard_normal((40, 16)).astype(ml_dtypes.bfloat16)
    t = rng.integers(0, 40, 8)
    s = fg.fused_linear_online_max_sum(x, w, t, 0, 40)
    grad = np.ones(8, np.float32)
    with fg.gemm("blas"):
        *_, plan = fg.fused_linear_cross_entropy_loss_grad(
            grad, x, w, s.target_mask, s.masked_target, logits_max=s[0], sum_exp_logits=s[1], return_plan=True
        )
    assert plan.gemm.engine == "blas" and plan.gemm.exact is None
    from fastgrad.ops import _engines

    want = _engines.gemm_choice(ml_dtypes.bfloat16)
    *_, plan = fg.fused_linear_cross_entropy_loss_grad(
        grad, x, w, s.target_mask, s.masked_target, logits_max=s[0], sum_exp_logits=s[1], return_plan=True
    )
    assert plan.gemm == want and plan.gemm.exact in (None, "bf16")
    assert (plan.gemm.variant is None) == (plan.gemm.exact is None)


def _public_functions():
    """(path, qualified name, fully annotated) of every public function and method in the public
    modules of fastgrad/ (no ``_``-prefixed module or package on the path): parameters (but
    ``self``/``cls``), ``*args``/``**kwargs`` and the return annotated (``__init__``'s return aside)."""
    for path in sorted(PKG.rglob("*.py")):
        parts = path.relative_to(PKG.parent).with_suffix("").parts
        if any(p.startswith("_") and p != "__init__" for p in parts):
            continue
        tree = ast.parse(path.read_text())
        stack = [(tree, None)]
        while stack:
            node, cls = stack.pop()
            for n in ast.iter_child_nodes(node):
                if isinstance(n, ast.ClassDef) and not n.name.startswith("_"):
                    stack.append((n, n.name))
                elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    if n.name.startswith("_") and not (n.name.startswith("__") and n.name.endswith("__")):
                        continue
                    args = n.args.posonlyargs + n.args.args + n.args.kwonlyargs
                    if cls is not None and args and args[0].arg in ("self", "cls"):
                        args = args[1:]
                    extra = [a for a in (n.args.vararg, n.args.kwarg) if a]
                    typed = all(a.annotation is not None for a in args + extra) and (
                        n.returns is not None or n.name == "__init__"
                    )
                    yield path.relative_to(PKG.parent), f"{cls + '.' if cls else ''}{n.name}", typed


def test_public_functions_are_typed():
    """Issue 47: at least 95 % of the public functions of the public modules carry full type hints
    (every one did when this test was written)."""
    found = list(_public_functions())
    untyped = [f"{p}:{name}" for p, name, typed in found if not typed]
    assert len(found) > 300
    assert len(untyped) <= 0.05 * len(found), untyped
