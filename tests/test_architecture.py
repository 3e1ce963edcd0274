"""The layering rules of docs/architecture.md, checked on the source tree (AST, no imports run)."""

import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parent.parent / "fastgrad"

KERNEL_ALLOWED = {"fastgrad.dtypes", "fastgrad._jit", "fastgrad.tiling", "fastgrad.vocab_parallel",
                  "fastgrad.enums", "fastgrad._config", "fastgrad._outcache", "fastgrad._onednn",
                  "fastgrad._cpu"}
SHARED_KERNEL_HELPERS = {"_gemm", "_linear", "_vmath", "_strided", "_bf16dot", "_native", "_engine"}


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


@pytest.mark.parametrize("path", _files("kernels") + _files("reference"), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_kernels_and_goldens_are_pure(path):
    layer = path.parent.name
    for mod, names in _imports(path):
        assert not mod.startswith("fastgrad.backends"), f"{path.name} imports the registry ({mod})"
        assert not mod.startswith("torch"), f"{path.name} imports torch"
        if mod.startswith("fastgrad.") and not mod.startswith(f"fastgrad.{layer}"):
            assert mod in KERNEL_ALLOWED, f"{path.name} imports {mod}"
        if mod.startswith("fastgrad.kernels.") and layer == "kernels":
            leaf = mod.rsplit(".", 1)[1]
            assert leaf in SHARED_KERNEL_HELPERS, f"{path.name} imports another kernel ({mod})"
        if mod == "fastgrad.kernels" or mod == "fastgrad.reference":
            assert all(n in SHARED_KERNEL_HELPERS for n in names), (path.name, names)
        if layer == "reference":
            assert not mod.startswith("fastgrad.kernels"), f"golden {path.name} imports a kernel"


@pytest.mark.parametrize("sub", ["cli", "torch", "torch/nn", "benchmarks", "ascend", "torch_npu.py"])
def test_front_ends_call_only_public_ops(sub):
    paths = [PKG / sub] if sub.endswith(".py") else _files(sub)
    assert paths, sub
    for path in paths:
        for mod, names in _imports(path):
            assert not mod.startswith("fastgrad.kernels"), f"{sub}/{path.name} imports {mod}"
            assert not mod.startswith("fastgrad.reference"), f"{sub}/{path.name} imports {mod}"
            if mod == "fastgrad":
                assert "kernels" not in names and "reference" not in names, f"{sub}/{path.name}"


def test_plans_are_made_only_in_the_op_layer():
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG).as_posix()
        if rel.startswith(("ops/", "tiling.py", "cli/", "benchmarks/")):
            continue            # the op_host layer, the plan module, and front ends that inspect plans
        src = path.read_text()
        assert "plan_linear_cross_entropy(" not in src, f"{rel} makes a tile plan"


def test_nothing_registers_itself():
    for path in list(PKG.glob("kernels/*.py")) + list(PKG.glob("reference/*.py")) + list(PKG.glob("backends/*.py")):
        assert "@implements" not in path.read_text(), path


def test_every_op_has_a_declaration_and_every_backend_a_table():
    import fastgrad as fg
    from fastgrad.backends import cpu, reference

    ops = ["fused_linear_online_max_sum", "fused_cross_entropy_loss_with_max_sum",
           "fused_linear_cross_entropy_loss_grad", "cross_entropy_loss_grad",
           "scaled_masked_softmax_backward", "smooth_l1_loss_backward", "embedding_dense_backward"]
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

    for mod in (lce, flce, online, lin):
        src = pathlib.Path(mod.__file__).read_text()
        assert "prange" not in src and "@pjit" not in src, mod.__name__
