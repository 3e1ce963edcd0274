"""Extract the CANN test cases of fastgrad's seven ops from an ops-nn checkout, as data.

Usage (from the repository root; needs a clone or bare mirror of https://github.com/hicann/ops-nn)::

    python tests/cann_cases/extract.py --git-dir /path/to/ops-nn/.git [--commit e5c3fa9]

Writes one JSON file per source file into this folder (``atk_<aclnn>.json``, ``ttk_<name>.json``):
the parameters of every case (shapes, dtypes, value ranges, attributes, SoC list, tolerances), the
source path and the commit.  No code of ops-nn is copied; the executors' and goldens' formulas are
re-written in ``tests/cann_helpers.py``.  See README.md in this folder.
"""

from __future__ import annotations

import argparse
import ast
import csv
import io
import json
import pathlib
import re
import subprocess

HERE = pathlib.Path(__file__).resolve().parent
REPO = "hicann/ops-nn"

#: (source path in ops-nn, fastgrad op) of every ATK case file of the seven ops.
ATK_FILES = [
    (
        "matmul/fused_linear_online_max_sum/tests/st/aclnnFusedLinearOnlineMaxSum/atk_aclnnFusedLinearOnlineMaxSum.json",
        "fused_linear_online_max_sum",
    ),
    (
        "loss/fused_cross_entropy_loss_with_max_sum/tests/st/aclnnFusedCrossEntropyLossWithMaxSum/"
        "atk_aclnnFusedCrossEntropyLossWithMaxSum.json",
        "fused_cross_entropy_loss_with_max_sum",
    ),
    (
        "matmul/fused_linear_cross_entropy_loss_grad/tests/st/aclnnFusedLinearCrossEntropyLossGrad/"
        "atk_aclnnFusedLinearCrossEntropyLossGrad.json",
        "fused_linear_cross_entropy_loss_grad",
    ),
    (
        "loss/cross_entropy_loss_grad/tests/st/aclnnCrossEntropyLossGrad/atk_aclnnCrossEntropyLossGrad.json",
        "cross_entropy_loss_grad",
    ),
    (
        "vfusion/scaled_masked_softmax_grad_v2/tests/st/aclnnScaledMaskedSoftmaxBackward/"
        "atk_aclnnScaledMaskedSoftmaxBackward.json",
        "scaled_masked_softmax_backward",
    ),
    (
        "loss/smooth_l1_loss_grad_v2/tests/st/aclnnSmoothL1LossBackward/atk_aclnnSmoothL1LossBackward.json",
        "smooth_l1_loss_backward",
    ),
    (
        "index/embedding_dense_grad_v2/tests/st/aclnnEmbeddingDenseBackward/atk_aclnnEmbeddingDenseBackward.json",
        "embedding_dense_backward",
    ),
]

#: (source path, fastgrad op) of every TTK case file (tests/st/arch35: the Ascend950 kernels).
TTK_FILES = [
    (
        "loss/fused_cross_entropy_loss_with_max_sum/tests/st/arch35/ttk_kernel_fused_cross_entropy_loss_with_max_sum.csv",
        "fused_cross_entropy_loss_with_max_sum",
    ),
    (
        "loss/fused_cross_entropy_loss_with_max_sum/tests/st/arch35/ttk_aclnn_fused_cross_entropy_loss_with_max_sum.csv",
        "fused_cross_entropy_loss_with_max_sum",
    ),
    (
        "loss/cross_entropy_loss_grad/tests/st/arch35/ttk_kernel_cross_entropy_loss_grad_st.csv",
        "cross_entropy_loss_grad",
    ),
    (
        "loss/smooth_l1_loss_grad_v2/tests/st/arch35/ttk_kernel_smooth_l1_loss_grad_v2_st.csv",
        "smooth_l1_loss_backward",
    ),
    (
        "index/embedding_dense_grad_v2/tests/st/arch35/ttk_kernel_embedding_dense_grad_v2_st.csv",
        "embedding_dense_backward",
    ),
    ("index/embedding_dense_grad/tests/st/arch35/ttk_kernel_embedding_dense_grad_st.csv", "embedding_dense_backward"),
]

#: TTK columns kept (the rest are formats, empty bookkeeping columns, or duplicates of these).
TTK_KEEP = (
    "op_name",
    "api_name",
    "input_shapes",
    "tensor_view_shapes",
    "input_dtypes",
    "tensor_dtypes",
    "attributes",
    "input_data_ranges",
    "output_shapes",
    "output_dtypes",
    "output_tensor_indexes",
    "precision_tolerances",
    "absolute_precision",
    "soc_series",
    "is_enabled",
)

_SPECIAL = re.compile(r"(?<![\w'\"])(-?)(inf|nan)\b")


def _literal(text: str):
    """A TTK cell as a Python value (bare inf/nan become the strings 'inf', '-inf', 'nan')."""
    text = text.strip()
    if text == "":
        return None
    try:
        return ast.literal_eval(
            _SPECIAL.sub(lambda m: repr(("" if m.group(2) == "nan" else m.group(1)) + m.group(2)), text)
        )
    except (ValueError, SyntaxError):
        return text


def _show(git_dir: str, commit: str, path: str) -> str:
    return subprocess.run(
        ["git", f"--git-dir={git_dir}", "show", f"{commit}:{path}"], check=True, capture_output=True, text=True
    ).stdout


def _range(v):
    """ATK ``range_values`` as data: [lo, hi], {"name": "nd", ...}, or a special fill ("nan", "inf", "-inf")."""
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], str):
        return v[0]
    return v


def extract_atk(text: str) -> tuple[dict, list]:
    raw = json.loads(text)
    meta = {}
    for key in ("aclnn_name", "api_type", "aclnn_api_type", "standard"):
        vals = {json.dumps(c.get(key), sort_keys=True) for c in raw}
        if len(vals) == 1:
            meta[key] = raw[0].get(key)
    cases = []
    for c in raw:
        case: dict = {"id": c["id"]}
        for key in ("aclnn_name", "api_type", "aclnn_api_type", "standard"):
            if key not in meta and key in c:
                case[key] = c[key]
        if "is_boundary" in c:
            case["boundary"] = c["is_boundary"]
        tensors, attrs = {}, {}
        for i in c["inputs"]:
            if i["type"] == "tensor":
                tensors[i["name"]] = {"dtype": i["dtype"], "shape": i["shape"], "range": _range(i["range_values"])}
            else:
                attrs[i["name"]] = {"dtype": i["dtype"], "value": _range(i["range_values"])}
        case["tensors"] = tensors
        case["attrs"] = attrs
        cases.append(case)
    return meta, cases


def extract_ttk(text: str) -> list:
    cases = []
    for row in csv.DictReader(io.StringIO(text)):
        case = {"name": row["testcase_name"]}
        for key in TTK_KEEP:
            if key in row and row[key] is not None:
                case[key] = _literal(row[key])
        cases.append(case)
    return cases


def _dump(path: pathlib.Path, head: dict, cases: list) -> None:
    """One case per line (reviewable diffs), the header first."""
    lines = ["{"]
    for k, v in head.items():
        lines.append(f"  {json.dumps(k)}: {json.dumps(v)},")
    lines.append('  "cases": [')
    body = [f"    {json.dumps(c, separators=(',', ':'))}" for c in cases]
    lines.append(",\n".join(body))
    lines.append("  ]")
    lines.append("}")
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--git-dir", required=True, help="the .git directory (or bare mirror) of hicann/ops-nn")
    ap.add_argument("--commit", default="HEAD")
    args = ap.parse_args(argv)
    commit = subprocess.run(
        ["git", f"--git-dir={args.git_dir}", "rev-parse", args.commit], check=True, capture_output=True, text=True
    ).stdout.strip()
    for path, op in ATK_FILES:
        meta, cases = extract_atk(_show(args.git_dir, commit, path))
        head = {"source": {"repo": REPO, "commit": commit, "path": path}, "kind": "atk", "op": op, **meta}
        _dump(HERE / pathlib.PurePosixPath(path).with_suffix(".json").name, head, cases)
    for path, op in TTK_FILES:
        cases = extract_ttk(_show(args.git_dir, commit, path))
        head = {"source": {"repo": REPO, "commit": commit, "path": path}, "kind": "ttk", "op": op}
        _dump(HERE / pathlib.PurePosixPath(path).with_suffix(".json").name, head, cases)


if __name__ == "__main__":
    main()
