"""A checkpoint folder checked against its model before any rank starts.

`check_checkpoint(folder, config, family, model)` reads only the safetensors headers (no tensor data) and
reports, one line each and naming the file: unreadable or truncated files, a sharded index
(`model.safetensors.index.json`) that names a missing shard or a tensor its shard lacks, tensors
the model needs but the checkpoint lacks, tensors it holds that the model would never read,
shapes that disagree with the config, and dtypes no float model loads as they are.

What the model reads is found by running the family's own `load_weights` on the meta device
(an unsharded model, no memory) against the headers, so every layout a loader accepts (fused or
per-expert MoE weights, `backbone.` names, a tied head) is accepted here and nothing else. The
shapes the config implies come from the family's `random_weights` drawn on the meta device.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Iterable, Optional

import attrs
import torch

from .._families import ConfigError, TensorSource

__all__ = [
    "INDEX_FILE",
    "CheckpointError",
    "TensorEntry",
    "checkpoint_files",
    "read_header",
    "check_checkpoint",
]

INDEX_FILE = "model.safetensors.index.json"
#: safetensors dtype names of the float tensors a model can load (converted to the run dtype)
FLOAT_DTYPES = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8}
#: the other safetensors dtypes, with their sizes (quantized and integer tensors)
OTHER_DTYPES = {
    "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "F4": 1, "F6_E2M3": 1, "F6_E3M2": 1,
    "I8": 1, "U8": 1, "I16": 2, "U16": 2, "I32": 4, "U32": 4, "I64": 8, "U64": 8, "BOOL": 1,
    "C64": 8,
}
_NAMES = {"float16": "F16", "bfloat16": "BF16", "float32": "F32", "float64": "F64"}
#: tensors a checkpoint may carry that no model reads (buffers older exports saved)
IGNORED = (re.compile(r"(^|\.)rotary_emb\.inv_freq$"),)
#: how many problems are listed before the rest are counted
MAX_LINES = 12
#: a header larger than this is not a safetensors header
MAX_HEADER_BYTES = 100 << 20


class CheckpointError(ConfigError):
    """A checkpoint that cannot load into its model: one problem per line."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        shown = self.problems[:MAX_LINES]
        if len(self.problems) > MAX_LINES:
            shown.append(f"... and {len(self.problems) - MAX_LINES} more problems in the same checkpoint")
        super().__init__("\n".join(shown))


@attrs.frozen
class TensorEntry:
    file: str  # the file's name inside the folder
    dtype: str  # the safetensors dtype name (F32, BF16, ...)
    shape: tuple


def read_header(path: Path) -> dict[str, TensorEntry]:
    """The tensors a safetensors file describes, checked against the file's size.

    Raises `ConfigError` naming the file when it cannot be read, is not safetensors, or is
    shorter than its header says (a truncated copy)."""
    name = path.name
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ConfigError(f"{name}: {size} bytes, too short for a safetensors file (truncated? re-save or re-copy it)")
            (length,) = struct.unpack("<Q", head)
            if length > min(size - 8, MAX_HEADER_BYTES):
                raise ConfigError(
                    f"{name}: not a safetensors file, or truncated (its header claims {length} bytes, the file has {size}); re-save or re-copy it"
                )
            raw = f.read(length)
    except OSError as exc:
        raise ConfigError(f"{name}: cannot be read ({exc.strerror or exc})") from None
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("not an object")
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{name}: its safetensors header is not valid JSON ({exc}); the file is damaged, re-save it") from None
    data = size - 8 - length
    out: dict[str, TensorEntry] = {}
    end = 0
    for tensor, info in header.items():
        if tensor == "__metadata__":
            continue
        try:
            dtype, shape, (start, stop) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ConfigError(f"{name}: the header entry of tensor {tensor} is malformed; the file is damaged, re-save it") from None
        width = FLOAT_DTYPES.get(dtype, OTHER_DTYPES.get(dtype))
        if width is not None and stop - start != width * _numel(shape) and dtype not in ("F4", "F6_E2M3", "F6_E3M2"):
            raise ConfigError(f"{name}: tensor {tensor} spans {stop - start} bytes, but {dtype} {list(shape)} needs {width * _numel(shape)}; the file is damaged")
        end = max(end, int(stop))
        out[tensor] = TensorEntry(name, dtype, shape)
    if end > data:
        raise ConfigError(
            f"{name}: truncated: its header describes {end} bytes of tensor data, the file holds {max(data, 0)}; re-copy or re-save it"
        )
    return out


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def checkpoint_files(folder: Path) -> tuple[list[Path], Optional[dict], list[str]]:
    """(files to read, the index's tensor -> shard map or None, index problems).

    A sharded checkpoint is read through its index: only the shards it names, each checked to
    exist. Without an index every `*.safetensors` file of the folder is read."""
    index_path = folder / INDEX_FILE
    if not index_path.is_file():
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ConfigError(f"checkpoint folder {folder} has no *.safetensors files; save it with save_pretrained(safe_serialization=True)")
        return files, None, []
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError("weight_map is not a mapping of tensor names to files")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{INDEX_FILE}: cannot be used ({type(exc).__name__}: {exc}); re-save the checkpoint") from None
    problems, files = [], []
    for shard in sorted(set(weight_map.values())):
        path = folder / shard
        if path.is_file():
            files.append(path)
        else:
            count = sum(1 for v in weight_map.values() if v == shard)
            problems.append(f"{shard}: missing; {INDEX_FILE} places {count} tensors in it (copy the whole checkpoint)")
    return files, weight_map, problems


def scan(folder: Path) -> tuple[dict[str, TensorEntry], list[str]]:
    """Every tensor of the checkpoint with its file, and the problems found reading them."""
    files, weight_map, problems = checkpoint_files(folder)
    found: dict[str, TensorEntry] = {}
    for path in files:
        try:
            tensors = read_header(path)
        except ConfigError as exc:
            problems.append(str(exc))
            continue
        for tensor, entry in tensors.items():
            if tensor in found:
                problems.append(f"{entry.file}: tensor {tensor} is also in {found[tensor].file}; keep one copy")
            found[tensor] = entry
    if weight_map is not None:
        readable = {p.name for p in files}
        for tensor, shard in weight_map.items():
            if shard in readable and tensor not in found:
                problems.append(f"{shard}: tensor {tensor} is listed in {INDEX_FILE} but missing from the shard")
            elif tensor in found and found[tensor].file != shard and shard in readable:
                problems.append(f"{found[tensor].file}: tensor {tensor} is here, but {INDEX_FILE} places it in {shard}")
    return found, problems


class _Recording(TensorSource):
    """A TensorSource over the headers: meta tensors in the config's shapes, every read recorded."""

    def __init__(self, found: dict[str, TensorEntry], expected: dict[str, tuple]):
        self.found = found
        self.expected = expected
        self.read: set[str] = set()
        self.missing: list[str] = []
        self.mismatched: list[str] = []

    def _tensor(self, name: str, shape, dtype=torch.float32) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device="meta")

    def get(self, name: str) -> Optional[torch.Tensor]:
        entry = self.found.get(name)
        if entry is None:
            return None
        self.read.add(name)
        want = _expected_shape(name, self.expected)
        if want is not None and tuple(want) != entry.shape:
            self.mismatched.append(f"{entry.file}: tensor {name} has shape {list(entry.shape)}, the config expects {list(want)}")
            return self._tensor(name, want)
        return self._tensor(name, entry.shape)

    def require(self, name: str) -> torch.Tensor:
        t = self.get(name)
        if t is not None:
            return t
        self.missing.append(name)
        want = _expected_shape(name, self.expected)
        if want is None:  # nothing to go on: the dry run stops here
            raise _Stop(name)
        return self._tensor(name, want)


class _Stop(Exception):
    pass


_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<what>\w+)\.weight$")


def _expected_shape(name: str, expected: dict[str, tuple]) -> Optional[tuple]:
    """The shape the config implies for `name`: as drawn by the family's random weights, or
    through the layouts the loaders also accept (`backbone.` for `model.`, one tensor per expert
    for a fused `[experts, out, in]` tensor, `gate_proj`/`up_proj` for a fused `gate_up_proj`)."""
    if name in expected:
        return expected[name]
    if name.startswith("backbone."):
        return _expected_shape("model." + name[len("backbone."):], expected)
    m = _PER_EXPERT.match(name)
    if m:
        prefix, e, what = m["prefix"], int(m["e"]), m["what"]
        fused = expected.get(f"{prefix}.{what}")
        if fused is not None and e < fused[0]:
            return tuple(fused[1:])
        gate_up = expected.get(f"{prefix}.gate_up_proj")
        if gate_up is not None and what in ("gate_proj", "up_proj") and e < gate_up[0]:
            return (gate_up[1] // 2,) + tuple(gate_up[2:])
    return None


def _ignored(tensor: str) -> bool:
    return any(p.search(tensor) for p in IGNORED)


def _declared_dtype(folder: Path) -> Optional[str]:
    try:
        raw = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return _NAMES.get(str(raw.get("dtype") or raw.get("torch_dtype") or ""))


def _dtype_problems(found: dict[str, TensorEntry], declared: Optional[str]) -> list[str]:
    """Tensors no float model loads as they are (integer, FP8: a quantized checkpoint), and
    float tensors of a half type other than the checkpoint's (declared in config.json, else the
    most common); float32 is always accepted (norms and gates are often kept in it)."""
    floats = [e.dtype for e in found.values() if e.dtype in FLOAT_DTYPES]
    usual = declared or (max(set(floats), key=floats.count) if floats else None)
    out = []
    for tensor, entry in sorted(found.items()):
        if _ignored(tensor):
            continue
        if entry.dtype not in FLOAT_DTYPES:
            out.append(
                f"{entry.file}: tensor {tensor} is {entry.dtype}; the reference models load float tensors "
                "(F16, BF16, F32, F64), not quantized or integer ones"
            )
        elif usual is not None and entry.dtype not in (usual, "F32"):
            why = "config.json declares" if declared else "the other tensors are"
            out.append(f"{entry.file}: tensor {tensor} is {entry.dtype} where {why} {usual}; re-save the checkpoint in one dtype")
    return out


def check_checkpoint(folder, config, fam=None, model=None) -> None:
    """Raise `CheckpointError` (one problem a line, naming the file and the tensor) unless the
    checkpoint at `folder` loads into the model of `config` (a parsed model config) of family
    `fam` (a `ModelFamily`; default: the registered family of the config's model_type); `model`
    is that model built on the meta device for one rank (default: built here)."""
    if fam is None or model is None:
        from .._parallel import Parallel
        from .families import build, find_family

        item = next((r for r in _families() if r.record.model_type == config.model_type), None) or find_family(config.model_type)
        fam = item.record
        model = build(item, config, Parallel.single(), device="meta")
    folder = Path(folder)
    found, problems = scan(folder)
    if problems and not found:
        raise CheckpointError(problems)
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in fam.random_weights(config, torch.float32, 0).items()}
    source = _Recording(found, expected)
    try:
        fam.load_weights(model, source)
    except _Stop:
        pass
    except (RuntimeError, ValueError, IndexError) as exc:  # a shape a loader cannot take
        last = sorted(source.read)[-1] if source.read else "?"
        problems.append(f"the {fam.model} loader cannot take this checkpoint (reading near {last}): {exc}")
    problems += [f"{_where(folder, name)}: tensor {name} is missing; the config expects it" for name in source.missing]
    problems += source.mismatched
    tied_head = getattr(config, "tie_word_embeddings", False)
    for tensor in sorted(set(found) - source.read):
        if _ignored(tensor) or (tied_head and tensor == "lm_head.weight"):
            continue
        problems.append(f"{found[tensor].file}: tensor {tensor} is unexpected; the config has no place for it (a checkpoint of another model or size?)")
    problems += _dtype_problems(found, _declared_dtype(folder))
    if problems:
        raise CheckpointError(problems)


def _families():
    from .._plugins.manager import get_registry

    return get_registry().model_families


def _where(folder: Path, tensor: str) -> str:
    """The file a missing tensor was looked for in: the checkpoint's single file, or the folder."""
    if (folder / INDEX_FILE).is_file():
        return INDEX_FILE
    files = sorted(p.name for p in folder.glob("*.safetensors"))
    return files[0] if len(files) == 1 else str(folder)
