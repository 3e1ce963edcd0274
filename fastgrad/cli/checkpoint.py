"""Files the ``fastgrad`` command reads and writes: safetensors (read through ``mmap``, no copy,
no dependency), ``.npy``, and Hugging Face model directories.

Every failure is a :class:`fastgrad.cli.CliError` naming the flag, what was expected and what
was given.

Safetensors layout (https://github.com/huggingface/safetensors, "Format"): an 8-byte
little-endian header length ``N``, ``N`` bytes of JSON ``{name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {...}}``, then the data; offsets are relative to
the end of the header.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

from ._common import CliError

ST_DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64),
    "U32": np.dtype(np.uint32),
    "U16": np.dtype(np.uint16),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_ST_NAME = {v: k for k, v in ST_DTYPES.items()}
_MAX_HEADER = 100 * 2**20


# ----------------------------------------------------------------------------- safetensors ----


@dataclass
class TensorInfo:
    name: str
    dtype: str  # safetensors name (BF16, F32, ...)
    shape: tuple
    file: str
    offset: int  # absolute byte offset in ``file``
    nbytes: int


class SafetensorsFile:
    """The tensors of one ``.safetensors`` file, read lazily through ``np.memmap``."""

    def __init__(self, path: str, flag: str = "--safetensors"):
        self.path, self.flag = path, flag
        if not os.path.exists(path):
            raise CliError(flag, "an existing .safetensors file", repr(path), hint="no such file")
        if os.path.isdir(path):
            raise CliError(
                flag,
                "a .safetensors file",
                repr(path),
                hint="a directory: use --model DIR for a Hugging Face model directory",
            )
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CliError(flag, "a safetensors file", f"{path!r} ({size} bytes, too short for a header)")
            (n,) = struct.unpack("<Q", head)
            if n > min(_MAX_HEADER, size - 8) or n < 2:
                raise CliError(
                    flag,
                    "a safetensors file",
                    f"{path!r} (header length {n} does not fit its {size} bytes: not a safetensors file)",
                )
            raw = f.read(n)
        try:
            header = json.loads(raw.decode("utf-8"))
            if not isinstance(header, dict):
                raise ValueError("not an object")
        except (UnicodeDecodeError, ValueError) as e:
            raise CliError(flag, "a safetensors file", f"{path!r} (its header is not JSON: {e})") from None
        self.metadata = header.pop("__metadata__", None) or {}
        data0 = 8 + n
        self.tensors: dict[str, TensorInfo] = {}
        for name, ent in header.items():
            try:
                dt = str(ent["dtype"])
                shape = tuple(int(s) for s in ent["shape"])
                b, end = (int(v) for v in ent["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise CliError(flag, "a safetensors file", f"{path!r} (bad header entry for {name!r})") from None
            if not (0 <= b <= end and data0 + end <= size) or any(s < 0 for s in shape):
                raise CliError(
                    flag,
                    "a safetensors file",
                    f"{path!r} (tensor {name!r} lies outside the file: offsets {b}..{end}, data size {size - data0})",
                )
            self.tensors[name] = TensorInfo(name, dt, shape, path, data0 + b, end - b)

    def names(self) -> list[str]:
        return list(self.tensors)

    def load(self, name: str, flag: str | None = None) -> np.ndarray:
        """The tensor as a read-only array mapped from the file (no copy)."""
        return load_tensor(self.tensors[name], flag or self.flag)


def load_tensor(info: TensorInfo, flag: str) -> np.ndarray:
    dt = ST_DTYPES.get(info.dtype)
    if dt is None:
        raise CliError(
            flag,
            "a tensor of a dtype fastgrad reads (" + ", ".join(ST_DTYPES) + ")",
            f"{info.name!r} of dtype {info.dtype}",
        )
    count = int(np.prod(info.shape, dtype=np.int64))
    if count * dt.itemsize != info.nbytes:
        raise CliError(
            flag,
            f"{count * dt.itemsize} bytes for {info.name!r} ({info.dtype} {list(info.shape)})",
            f"{info.nbytes} bytes in {info.file!r}",
        )
    if count == 0:
        return np.empty(info.shape, dt)
    return np.memmap(info.file, dtype=dt, mode="r", offset=info.offset, shape=info.shape)


def save_safetensors(path: str, tensors: dict, metadata: dict | None = None) -> str:
    """Write ``tensors`` (name -> NumPy array) as one safetensors file, streaming (no copy)."""
    entries, arrays, off = {}, [], 0
    for name, a in tensors.items():
        a = np.ascontiguousarray(a)
        st = _ST_NAME.get(a.dtype)
        if st is None:
            raise TypeError(f"safetensors cannot hold {name!r} of dtype {a.dtype}")
        entries[name] = {"dtype": st, "shape": list(a.shape), "data_offsets": [off, off + a.nbytes]}
        arrays.append(a)
        off += a.nbytes
    if metadata:
        entries["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    head = json.dumps(entries, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    tmp = path + ".part"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for a in arrays:
            if a.nbytes:
                f.write(a.reshape(-1).view(np.uint8).data)
    os.replace(tmp, path)
    return path


# ----------------------------------------------------------------------------- .npy / FILE[:NAME] ----


def _check_npy_header(path: str, flag: str) -> None:
    """A readable .npy header of numbers, or one line saying what the file is instead (never the
    advice to unpickle it: fastgrad reads no pickles)."""
    fmt = np.lib.format
    try:
        with open(path, "rb") as f:
            start = f.read(6)
            if start != fmt.MAGIC_PREFIX:
                if start[:2] == b"PK":
                    raise CliError(flag, "a .npy file", f"{path!r} (a zip archive: .npz? save one array with np.save)")
                raise CliError(flag, "a .npy file", f"{path!r} (no .npy header: it starts with {start!r})")
            f.seek(0)
            version = fmt.read_magic(f)
            if version == (1, 0):
                _, _, dtype = fmt.read_array_header_1_0(f)
            else:
                _, _, dtype = fmt.read_array_header_2_0(f)
    except CliError:
        raise
    except (ValueError, OSError, EOFError) as e:
        raise CliError(flag, "a .npy file", f"{path!r} (unreadable header: {_short(e)})") from None
    if dtype.hasobject:
        raise CliError(
            flag,
            "a .npy array of numbers",
            f"{path!r} (an array of Python objects, dtype {dtype}; fastgrad does not unpickle files)",
        )


def load_npy(path: str, flag: str) -> np.ndarray:
    """``np.load`` memory-mapped, bfloat16 (saved by NumPy as ``|V2``) read back as bfloat16."""
    if not os.path.exists(path):
        raise CliError(flag, "an existing .npy or .safetensors file", repr(path), hint="no such file")
    if os.path.isdir(path):
        raise CliError(flag, "a .npy or .safetensors file", repr(path), hint="a directory")
    _check_npy_header(path, flag)
    try:
        a = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise CliError(flag, "a .npy file", f"{path!r} ({_short(e)})") from None
    if not isinstance(a, np.ndarray):
        raise CliError(flag, "a .npy file holding one array", f"{path!r} (an .npz archive)")
    if a.dtype.kind == "V" and a.dtype.itemsize == 2:
        a = a.view(ml_dtypes.bfloat16)
    return a


#: Tensor names looked for in a safetensors file given to --input / --target without ``:NAME``.
INPUT_NAMES = ("hidden_states", "last_hidden_state", "input", "x")
TARGET_NAMES = ("target", "targets", "labels", "input_ids", "target_ids", "ids")


def load_array_arg(spec: str, flag: str, conventional: tuple = ()) -> tuple[np.ndarray, str]:
    """``FILE.npy``, ``FILE.safetensors`` or ``FILE.safetensors:NAME`` -> (array, description)."""
    path, name = spec, None
    if ":" in spec and not os.path.exists(spec):
        path, name = spec.rsplit(":", 1)
    if path.lower().endswith(".safetensors"):
        st = SafetensorsFile(path, flag)
        names = st.names()
        if name is None:
            found = [n for n in conventional if n in st.tensors]
            if len(names) == 1:
                name = names[0]
            elif found:
                name = found[0]
            else:
                raise CliError(
                    flag, f"FILE:NAME naming one of the {len(names)} tensors of {path!r} ({_list(names)})", repr(spec)
                )
        if name not in st.tensors:
            raise CliError(flag, f"a tensor of {path!r} ({_list(names)})", repr(name))
        return st.load(name, flag), f"{path}:{name}"
    return load_npy(path, flag), path


# ----------------------------------------------------------------------------- HF model directories ----

#: The LM head's tensor name, by architecture convention: an untied head first, then the input
#: embedding a tied head shares (Llama/Qwen/Mistral, BERT with or without its ``bert.`` prefix,
#: GPT-2, BLOOM, OPT, T5, GPT-NeoX's untied ``embed_out``).
HEAD_NAMES = ("lm_head.weight", "embed_out.weight", "cls.predictions.decoder.weight", "output.weight")
TIED_NAMES = (
    "model.embed_tokens.weight",
    "embed_tokens.weight",
    "model.language_model.embed_tokens.weight",
    "embeddings.word_embeddings.weight",
    "bert.embeddings.word_embeddings.weight",
    "transformer.wte.weight",
    "wte.weight",
    "transformer.word_embeddings.weight",
    "word_embeddings.weight",
    "model.decoder.embed_tokens.weight",
    "shared.weight",
    "transformer.embedding.word_embeddings.weight",
)
TIED_SUFFIXES = ("embed_tokens.weight", "word_embeddings.weight", "wte.weight")


@dataclass
class ModelDir:
    path: str
    config: dict
    tensors: dict = field(default_factory=dict)  # name -> TensorInfo
    files: list = field(default_factory=list)
    head: str | None = None
    tied: bool = False
    notes: list = field(default_factory=list)


def _text_config(cfg: dict) -> dict:
    tc = cfg.get("text_config")
    return {**cfg, **tc} if isinstance(tc, dict) else cfg


def open_model_dir(path: str, flag: str = "--model") -> ModelDir:
    """Read ``config.json`` and the safetensors checkpoint (single file, or sharded with
    ``model.safetensors.index.json``) of a Hugging Face model directory."""
    if not os.path.isdir(path):
        raise CliError(
            flag,
            "a Hugging Face model directory (config.json + *.safetensors)",
            repr(path),
            hint="no such directory" if not os.path.exists(path) else "not a directory",
        )
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise CliError(flag, "a Hugging Face model directory with a config.json", repr(path), hint="no config.json")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
        if not isinstance(cfg, dict):
            raise ValueError("not a JSON object")
    except (ValueError, UnicodeDecodeError) as e:
        raise CliError(flag, "a config.json holding a JSON object", f"{cfg_path!r} ({_short(e)})") from None
    md = ModelDir(path, cfg)
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index) as f:
                wmap = json.load(f)["weight_map"]
            files = sorted(set(wmap.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CliError(
                flag, "a model.safetensors.index.json with a weight_map", f"{index!r} ({_short(e)})"
            ) from None
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            other = [f for f in os.listdir(path) if f.endswith((".bin", ".pt", ".pth", ".h5", ".msgpack"))]
            raise CliError(
                flag,
                "safetensors weights (model.safetensors or a sharded checkpoint with its index)",
                f"{path!r} with " + (f"only {_list(other)}" if other else "no weight file"),
                hint="convert the checkpoint to safetensors" if other else "",
            )
        if "model.safetensors" in files:
            files = ["model.safetensors"]
    for fn in files:
        st = SafetensorsFile(os.path.join(path, fn), flag)
        md.tensors.update(st.tensors)
        md.files.append(fn)
    tc = _text_config(cfg)
    tie_cfg = tc.get("tie_word_embeddings", cfg.get("tie_word_embeddings"))
    names = md.tensors
    head = next((n for n in HEAD_NAMES if n in names), None)
    if head is None and tie_cfg is not False:  # transformers' default is tied
        head = next((n for n in TIED_NAMES if n in names), None) or next(
            (n for n in names if n.endswith(TIED_SUFFIXES)), None
        )
        md.tied = head is not None
    md.head = head
    return md


def model_dims(md: ModelDir) -> tuple[int | None, int | None]:
    """(vocab_size, hidden_size) declared by config.json, when it declares them."""
    tc = _text_config(md.config)
    h = next((tc[k] for k in ("hidden_size", "n_embd", "d_model", "dim") if isinstance(tc.get(k), int)), None)
    v = tc.get("vocab_size") if isinstance(tc.get("vocab_size"), int) else None
    return v, h


# ----------------------------------------------------------------------------- helpers ----


def _short(e: BaseException) -> str:
    return " ".join(str(e).split())[:160]


def _list(names, n: int = 8) -> str:
    names = list(names)
    return ", ".join(names[:n]) + (f", ... ({len(names)} in all)" if len(names) > n else "")
