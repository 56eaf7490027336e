"""A draft model for the speculative-decoding tests: the default model cut to its first
few decoder layers (same tokenizer and vocabulary), written as an HF directory."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path


def write_truncated_model(model_path: str | Path, out_dir: str | Path, num_layers: int) -> str:
    """Copy `model_path` (config.json + safetensors + tokenizer files) to `out_dir` with only
    decoder layers [0, num_layers); returns `out_dir` as a string."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    src, dst = Path(model_path), Path(out_dir)
    dst.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for path in sorted(src.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                m = re.match(r"model\.layers\.(\d+)\.", name)
                if m is None or int(m.group(1)) < num_layers:
                    tensors[name] = f.get_tensor(name)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    (dst / "config.json").write_text(json.dumps(config))
    for path in src.iterdir():
        if path.suffix != ".safetensors" and path.name != "config.json" and path.is_file():
            shutil.copy(path, dst / path.name)
    return str(dst)
