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


def _split_spec(spec: str) -> tuple[str, str | None]:
    if ":" in spec and not os.path.exists(spec):
        path, name = spec.rsplit(":", 1)
        return path, name
    return spec, None


def spec_path(spec: str) -> str:
    """The file of ``FILE``, ``FILE.safetensors`` or ``FILE.safetensors:NAME``."""
    return _split_spec(spec)[0]


def load_array_arg(spec: str, flag: str, conventional: tuple = ()) -> tuple[np.ndarray, str]:
    """``FILE.npy``, ``FILE.safetensors`` or ``FILE.safetensors:NAME`` -> (array, description)."""
    path, name = _split_spec(spec)
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
#: model_type values whose transformers config defaults to ``tie_word_embeddings=False``: when
#: config.json leaves it out, the model does not tie its head to the input embedding (a checkpoint
#: without an untied head then has no head; transformers initializes one at random).
UNTIED_BY_DEFAULT = frozenset(
    "llama mistral mixtral qwen2 qwen2_moe qwen3 qwen3_moe phi phi3 gpt_neox granite granitemoe olmo2 "
    "glm4 stablelm deepseek_v3 gpt_oss exaone4".split()
)
#: An untied head under a wrapper's prefix (``language_model.lm_head.weight``: LLaVA-style
#: checkpoints), looked for before any tied embedding: the model uses it, not the embedding.
HEAD_SUFFIXES = (".lm_head.weight", ".embed_out.weight")


@dataclass
class ModelDir:
    path: str
    config: dict
    tensors: dict = field(default_factory=dict)  # name -> TensorInfo
    files: list = field(default_factory=list)
    head: str | None = None
    tied: bool = False
    notes: list = field(default_factory=list)
    candidates: list = field(default_factory=list)  # untied heads found under a prefix


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
        raise CliError(
            flag, "a Hugging Face model directory with a config.json", repr(path), hint=_no_config_hint(path)
        )
    cfg = _read_json(cfg_path, flag, "a config.json holding a JSON object")
    md = ModelDir(path, cfg)
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        what = "a model.safetensors.index.json with a weight_map of tensor name -> file name"
        wmap = _read_json(index, flag, what).get("weight_map")
        if not isinstance(wmap, dict) or not all(isinstance(v, str) and v for v in wmap.values()):
            raise CliError(flag, what, f"{index!r} (weight_map: {_short(repr(wmap))})")
        files = sorted(set(wmap.values()))
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
    if head is None:  # an untied head under a wrapper's prefix (language_model.lm_head.weight)
        md.candidates = [n for n in names if n.endswith(HEAD_SUFFIXES)]
        if len(md.candidates) == 1:
            head = md.candidates[0]
        elif md.candidates:  # several: the user names one (--tensor), never a guess
            md.head = None
            return md
    untied_family = tie_cfg is None and tc.get("model_type") in UNTIED_BY_DEFAULT
    if head is None and untied_family:
        md.notes.append(
            f"config.json has no tie_word_embeddings and model_type {tc.get('model_type')!r} is untied by "
            "default: transformers would not use the input embedding as the head"
        )
    if head is None and tie_cfg is not False and not untied_family:  # transformers' default is tied
        head = next((n for n in TIED_NAMES if n in names), None) or next(
            (n for n in names if n.endswith(TIED_SUFFIXES)), None
        )
        md.tied = head is not None
    md.head = head
    return md


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def model_dims(md: ModelDir) -> tuple[int | None, int | None]:
    """(vocab_size, hidden_size) declared by config.json, when it declares them."""
    tc = _text_config(md.config)
    h = next((tc[k] for k in ("hidden_size", "n_embd", "d_model", "dim") if _is_int(tc.get(k))), None)
    v = tc.get("vocab_size") if _is_int(tc.get("vocab_size")) else None
    return v, h


def model_arch(md: ModelDir) -> str:
    """config.json's ``architectures`` (else ``model_type``), as text whatever their JSON type."""
    arch = md.config.get("architectures")
    if isinstance(arch, list):
        arch = ",".join(str(a) for a in arch)
    return str(arch or md.config.get("model_type") or "?")


#: config.json keys by which a model transforms its logits after ``x·Wᵀ`` (the families of
#: docs/torch.md's table and Falcon-H1), with the value that leaves them unchanged.
HEAD_TRANSFORMS = {
    "final_logit_softcapping": None,  # Gemma-2/3: c·tanh(z/c)
    "logit_scale": 1,  # Cohere: z·s
    "logits_scaling": 1,  # Granite: z/s
    "lm_head_multiplier": 1,  # Falcon-H1: z·m
}


def head_transforms(md: ModelDir, head: str) -> list[str]:
    """What the model adds to the plain logits ``x·Wᵀ`` of ``head`` that the op does not compute:
    a head bias in the checkpoint, a softcap or scale in config.json (one phrase each)."""
    tc = _text_config(md.config)
    found = []
    for key, identity in HEAD_TRANSFORMS.items():
        v = tc.get(key)
        if v is not None and v != identity and not (identity is None and v == 0):
            found.append(f"config.json's {key}={v}")
    base = head[: -len("weight")] if head.endswith("weight") else None
    for bias in ([base + "bias"] if base else []) + ["final_logits_bias"]:
        if bias in md.tensors:
            found.append(f"the head bias {bias}")
    return found


# ----------------------------------------------------------------------------- helpers ----


def _read_json(path: str, flag: str, what: str) -> dict:
    """A JSON object from ``path``, decoded as UTF-8 whatever the locale (JSON's encoding, and
    transformers'); anything else is one line naming ``flag`` and the file."""
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
        if not isinstance(obj, dict):
            raise ValueError("not a JSON object")
    except (ValueError, UnicodeDecodeError) as e:
        raise CliError(flag, what, f"{path!r} ({_short(e)})") from None
    except OSError as e:
        raise CliError(flag, what, repr(path), hint=e.strerror or _short(e)) from None
    return obj


def _no_config_hint(path: str) -> str:
    """Why a directory without config.json is not a model: a PEFT adapter says so."""
    adapter = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(adapter):
        return "no config.json"
    base = ""
    try:
        with open(adapter, encoding="utf-8") as f:
            name = json.load(f).get("base_model_name_or_path")
        base = f" ({name})" if isinstance(name, str) and name else ""
    except (OSError, ValueError, AttributeError):
        pass
    return (
        "no config.json: a PEFT adapter (adapter_config.json); give its base model's directory"
        f"{base}, or merge the adapter into it first (merge_and_unload, save_pretrained)"
    )


def _short(e: object) -> str:
    return " ".join(str(e).split())[:160]


def _list(names, n: int = 8) -> str:
    names = list(names)
    return ", ".join(names[:n]) + (f", ... ({len(names)} in all)" if len(names) > n else "")
