"""The host weight cache (shared/models/weight_cache.py) and the panel-only layout it maps
(shared/models/weight_layout.py): built once, mapped by every engine of the host, rebuilt
when cut short or when the checkpoint changes, shared pages, the same tokens."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from pdserve.kernels import cpu_gemv
from pdserve.shared.models import weight_cache
from pdserve.shared.models.loader import load_model

needs_panels = pytest.mark.skipif(cpu_gemv.load_kernel() is None,
                                  reason="no C compiler or no AVX-512: no panel layout to map")


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"a.wpacked": torch.randn(3, 5, 64, generator=g),
            "b.bias": torch.randn(7, generator=g),
            "c.int8": torch.randint(-127, 128, (13, 3), dtype=torch.int8, generator=g),
            "empty": torch.zeros(0, 4)}


def test_built_once_then_mapped_read_only(tmp_path):
    builds = []

    def build():
        builds.append(1)
        return _tensors()

    first, mapping = weight_cache.load_or_build("k1", build, tmp_path)
    second, mapping2 = weight_cache.load_or_build("k1", build, tmp_path)
    assert len(builds) == 1
    want = _tensors()
    for tensors in (first, second):
        assert tensors.keys() == want.keys()
        for name, t in want.items():
            assert tensors[name].dtype == t.dtype and torch.equal(tensors[name], t)
            assert mapping.holds(first[name]) or t.numel() == 0
            assert tensors[name].data_ptr() % weight_cache.ALIGN == 0 or t.numel() == 0
    perms = {line.split()[1] for line in Path("/proc/self/maps").read_text().splitlines()
             if line.endswith(str(tmp_path / "k1.bin"))}
    assert perms and all(p.startswith("r-") for p in perms)  # mapped read-only
    assert mapping2.nbytes == (tmp_path / "k1.bin").stat().st_size
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k1.bin", "k1.json", "k1.lock"]


def test_a_file_cut_short_is_rebuilt(tmp_path):
    (tmp_path / "k.bin.999.tmp").write_bytes(b"left by a builder killed mid-write")
    weight_cache.load_or_build("k", _tensors, tmp_path)
    assert not (tmp_path / "k.bin.999.tmp").exists()
    data = tmp_path / "k.bin"
    data.write_bytes(data.read_bytes()[:100])
    builds = []
    tensors, _ = weight_cache.load_or_build("k", lambda: builds.append(1) or _tensors(),
                                            tmp_path)
    assert builds == [1] and torch.equal(tensors["a.wpacked"], _tensors()["a.wpacked"])
    (tmp_path / "k.json").write_text("{not json")
    weight_cache.load_or_build("k", lambda: builds.append(1) or _tensors(), tmp_path)
    assert builds == [1, 1]


def test_engines_starting_together_build_once(tmp_path):
    """Three processes ask for the same key at once; the build takes a second; one builds,
    the others wait on the lock and map its file."""
    script = textwrap.dedent(f"""
        import sys, time, torch
        from pdserve.shared.models import weight_cache
        def build():
            with open({str(tmp_path / 'builds')!r}, 'a') as f:
                f.write('x')
            time.sleep(1.0)
            return {{"w": torch.arange(1000, dtype=torch.float32)}}
        t, _ = weight_cache.load_or_build("same", build, __import__('pathlib').Path(sys.argv[1]))
        print(float(t["w"].sum()))
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "cache")],
                              stdout=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outs == [str(float(sum(range(1000))))] * 3
    assert (tmp_path / "builds").read_text() == "x"


def test_the_key_follows_the_checkpoint_and_the_variant(tmp_path):
    (tmp_path / "config.json").write_text('{"a": 1}')
    ckpt = tmp_path / "model.safetensors"
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2, 2)}, str(ckpt))
    key = weight_cache.cache_key(tmp_path, [ckpt], dtype="float32", layout=1)
    assert key == weight_cache.cache_key(tmp_path, [ckpt], dtype="float32", layout=1)
    assert key != weight_cache.cache_key(tmp_path, [ckpt], dtype="float32", layout=2)
    os.utime(ckpt, ns=(1, 1))  # the same bytes, rewritten
    moved = weight_cache.cache_key(tmp_path, [ckpt], dtype="float32", layout=1)
    assert moved != key
    (tmp_path / "config.json").write_text('{"a": 2}')
    assert weight_cache.cache_key(tmp_path, [ckpt], dtype="float32", layout=1) != moved


def test_off_switch_and_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("PDSERVE_WEIGHT_CACHE", "0")
    assert weight_cache.cache_dir() is None
    with pytest.raises(OSError, match="off"):
        weight_cache.load_or_build("k", _tensors)
    monkeypatch.setenv("PDSERVE_WEIGHT_CACHE", "1")
    monkeypatch.setenv("PDSERVE_WEIGHT_CACHE_DIR", str(tmp_path / "w"))
    assert weight_cache.cache_dir() == tmp_path / "w"
    monkeypatch.delenv("PDSERVE_WEIGHT_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert weight_cache.cache_dir() == tmp_path / "xdg" / "pdserve" / "weights"


@needs_panels
def test_mapped_model_gives_the_private_models_logits(model_path, monkeypatch, tmp_path):
    """SmolLM2 from the cache (twice: built, then mapped) and packed privately: the same
    logits bit for bit, the weights held once (panels mapped, no plain linear weight)."""
    monkeypatch.setenv("PDSERVE_WEIGHT_CACHE_DIR", str(tmp_path))
    built = load_model(model_path)
    mapped = load_model(model_path)
    monkeypatch.setenv("PDSERVE_WEIGHT_CACHE", "0")
    private = load_model(model_path)
    assert built.weight_mapping is not None and private.weight_mapping is None
    assert built.weight_mapping.path == mapped.weight_mapping.path
    kinds = mapped.weight_bytes_by_kind()
    params = private.parameter_bytes()
    assert kinds["packed_weights"] == 0 and kinds["mapped_weights"] > 0.99 * params
    assert kinds["mapped_weights"] < 1.01 * params  # once: no second copy, no plain one
    assert private.weight_bytes_by_kind()["packed_weights"] < 1.01 * params
    assert mapped.parameter_bytes() == params
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(11, mapped.args.hidden_size, generator=g)
    ids = torch.tensor([0, 1, 2, 49151, 12345])
    with torch.inference_mode():
        for model in (built, mapped):
            assert torch.equal(model.compute_logits(hidden), private.compute_logits(hidden))
            assert torch.equal(model.embed_tokens(ids), private.embed_tokens(ids))


@needs_panels
def test_two_engines_share_the_pages(model_path, tmp_path):
    """Two processes map SmolLM2's file and read every page: each one's proportional share
    of the mapping (smaps' Pss) is about half its resident size (Rss)."""
    script = textwrap.dedent("""
        import sys, torch
        from pdserve.shared.models.loader import load_model
        m = load_model(sys.argv[1])
        total = sum(float(t.float().sum()) for t in [
            *(l.gemv.wpacked for l in m.modules() if getattr(l, "gemv", None) is not None),
            m.lm_head_gemv.wpacked])
        print(m.weight_mapping.path, flush=True)
        sys.stdin.read()
    """)
    env = {**os.environ, "PDSERVE_WEIGHT_CACHE_DIR": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", script, model_path], env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    try:
        paths = {p.stdout.readline().strip() for p in procs}
        assert len(paths) == 1 and Path(paths.pop()).parent == tmp_path
        for p in procs:
            rss, pss = _mapping_rss_pss(p.pid, str(tmp_path))
            assert rss > 400 * 2**20, rss  # SmolLM2's 538 MB, read through
            assert pss < 0.6 * rss, (rss, pss)
    finally:
        for p in procs:
            p.stdin.close()
            p.wait(timeout=60)


def _mapping_rss_pss(pid: int, directory: str) -> tuple[int, int]:
    rss = pss = 0
    inside = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
            inside = len(fields) >= 6 and fields[5].startswith(directory)
        elif inside and fields[0] in ("Rss:", "Pss:"):
            value = int(fields[1]) * 1024
            rss, pss = (rss + value, pss) if fields[0] == "Rss:" else (rss, pss + value)
    return rss, pss


def test_int8_weights_are_mapped_too(model_path, monkeypatch, tmp_path):
    """--quantization int8 from the cache (built, then mapped) against a private quantize:
    the same logits bit for bit, the int8 tensors in the mapping, the same bytes saved."""
    monkeypatch.setenv("PDSERVE_WEIGHT_CACHE_DIR", str(tmp_path))
    built = load_model(model_path, quantization="int8")
    mapped = load_model(model_path, quantization="int8")
    monkeypatch.setenv("PDSERVE_WEIGHT_CACHE", "0")
    private = load_model(model_path, quantization="int8")
    assert private.weight_mapping is None and mapped.weight_mapping is not None
    assert mapped.quantization == "int8"
    assert mapped.weight_bytes_saved == private.weight_bytes_saved > 0
    kinds = mapped.weight_bytes_by_kind()
    assert kinds["int8_weights"] == 0
    assert kinds["mapped_weights"] >= private.weight_bytes_by_kind()["int8_weights"]
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(5, mapped.args.hidden_size, generator=g)
    ids = torch.tensor([3, 49000, 7])
    with torch.inference_mode():
        for model in (built, mapped):
            assert torch.equal(model.compute_logits(hidden), private.compute_logits(hidden))
            assert torch.equal(model.embed_tokens(ids), private.embed_tokens(ids))
