"""LoRA serving's plain parts (issue 31), without engines: --lora-modules, the cluster-wide
adapter ids, an instance's adapter table and KV check, the flags of `serve` and `up`,
placement's hashes and preference, and the gateway's all-or-nothing load fan-out."""

from __future__ import annotations

import json
import types

import grpc
import pytest

from pdserve.services.cli import build_parser, main
from pdserve.services.common.errors import ServiceError
from pdserve.services.common.lora import LoRATable, check_kv_adapter
from pdserve.services.common.lora_modules import (
    adapter_from_proto,
    adapter_to_proto,
    lora_int_id_of,
    make_lora_request,
    parse_lora_modules,
)
from pdserve.services.gateway.errors import GatewayError
from pdserve.services.gateway.lora import LoRAView
from pdserve.services.gateway.placement import Placement, Placer, request_extra_keys
from pdserve.services.launcher.config import config_from_args
from pdserve.services.launcher.plan import build_plan
from pdserve.services.proto import engine_pb2 as pb
from pdserve.shared.kv_cache.kv_cache_manager import KVCacheManager
from pdserve.shared.kv_cache.prefix_hash import hash_request_tokens
from pdserve.shared.request import Request
from pdserve.shared.sampling_params import SamplingParams


def test_lora_modules_both_spellings_and_stable_ids():
    a, b = parse_lora_modules(["a=/x", json.dumps({"name": "b", "path": "/y",
                                                   "base_model_name": "m"})])
    assert (a.lora_name, a.lora_path, a.base_model_name) == ("a", "/x", None)
    assert (b.lora_name, b.lora_path, b.base_model_name) == ("b", "/y", "m")
    # Golden: every process and machine gives a name the same id (never Python's hash()).
    assert lora_int_id_of("a") == a.lora_int_id == 1814213519
    assert 1 <= lora_int_id_of("") and lora_int_id_of("b") != lora_int_id_of("a")
    assert adapter_from_proto(adapter_to_proto(b)) == b
    for bad, why in (("a", "name=path"), ("=/x", "must not be empty"), ("{", "invalid JSON"),
                     ('{"name": "a"}', "expected"), ("a=/x a=/y", None)):
        with pytest.raises(ValueError, match=why or "given twice"):
            parse_lora_modules(bad.split(" ") if why is None else [bad])
    with pytest.raises(ValueError, match="not the name's"):
        adapter_from_proto(pb.LoRAAdapter(lora_name="a", lora_int_id=7, lora_path="/x"))


def test_the_adapter_table_resolves_requests_and_refuses_others():
    table = LoRATable("m")
    a = make_lora_request("a", "/x")
    assert table.check_new(a)
    table.adapters["a"] = a
    assert not table.check_new(a)  # the same adapter again: nothing to do
    with pytest.raises(ServiceError, match="already been loaded") as e:
        table.check_new(make_lora_request("a", "/other"))
    assert e.value.code == grpc.StatusCode.ALREADY_EXISTS
    with pytest.raises(ServiceError, match="base model 'other'"):
        table.check_new(make_lora_request("c", "/z", "other"))
    assert table.resolve(None) is None and table.resolve(pb.LoRAAdapter()) is None
    assert table.resolve(pb.LoRAAdapter(lora_name="a", lora_int_id=a.lora_int_id)) == a
    with pytest.raises(ServiceError, match="not loaded") as e:
        table.resolve(pb.LoRAAdapter(lora_name="b"))
    assert e.value.code == grpc.StatusCode.NOT_FOUND
    with pytest.raises(ServiceError) as e:
        table.resolve(pb.LoRAAdapter(lora_name="a", lora_int_id=3))
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION


def test_a_decode_refuses_kv_of_another_adapter_naming_both():
    a, b = make_lora_request("a", "/x"), make_lora_request("b", "/y")
    check_kv_adapter("a", a.lora_int_id, a)
    check_kv_adapter("", 0, None)
    for handle, lora, names in ((("a", a.lora_int_id), b, ("'a'", "'b'")),
                                (("a", a.lora_int_id), None, ("'a'", "base model")),
                                (("", 0), a, ("base model", "'a'"))):
        with pytest.raises(ServiceError) as e:
            check_kv_adapter(*handle, lora)
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert all(n in str(e.value) for n in names), str(e.value)


def test_serve_flags_refuse_bad_lora_modules_in_one_line(tmp_path, capsys):
    base = ["serve", "prefill", "--model", "/nonexistent"]
    assert main([*base, "--lora-modules", f"a={tmp_path}", "--enable-lora"]) == 2
    assert "no adapter_config.json" in capsys.readouterr().out
    (tmp_path / "adapter_config.json").write_text("{}")
    assert main([*base, "--lora-modules", f"a={tmp_path}"]) == 2
    assert "needs --enable-lora" in capsys.readouterr().out
    assert main([*base, "--enable-lora", "--max-loras", "0"]) == 2
    assert "max_loras" in capsys.readouterr().out


def test_up_passes_the_lora_flags_to_every_replica(tmp_path):
    (tmp_path / "adapter_config.json").write_text("{}")
    module = json.dumps({"name": "b", "path": str(tmp_path)})
    parser = build_parser()
    config = config_from_args(parser.parse_args(
        ["up", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "32",
         "--lora-modules", f"a={tmp_path}", module]))
    plan = build_plan(config, "/m", "m", python="python")
    for spec in plan.children[1:3]:
        ns = parser.parse_args(list(spec.argv[3:]))
        assert ns.enable_lora and ns.max_loras == 2 and ns.max_lora_rank == 32
        assert [m.lora_name for m in parse_lora_modules(ns.lora_modules)] == ["a", "b"]
    with pytest.raises(ValueError, match="needs --enable-lora"):
        config_from_args(parser.parse_args(["up", "--lora-modules", f"a={tmp_path}"]))


def test_placement_hashes_a_prompt_as_the_engine_caches_it():
    """The gateway's hashes of an adapter's prompt are the KV cache manager's (and differ
    from the base model's and another adapter's)."""
    a, b = make_lora_request("a", "/x"), make_lora_request("b", "/y")
    prompt = list(range(100, 164))
    kv = KVCacheManager(16, 16, model_name="m")
    hashes = {}
    for i, lora in enumerate((None, a, b)):
        request = Request(f"r{i}", prompt, SamplingParams(), lora_request=lora,
                          block_hasher=kv.block_hasher)
        engine = request.block_hashes
        assert engine == hash_request_tokens(prompt, 16, request_extra_keys("m", None, "none",
                                                                           lora))
        hashes[lora] = engine
    assert len({h[0] for h in hashes.values()}) == 3


class _Registry:
    def __init__(self, instances):
        self.instances = instances

    async def live_instances(self, role=None):
        return [i for i in self.instances if role in (None, i.role)]

    async def longest_prefix(self, block_hashes):
        return {}


def _instance(address, role, load=0):
    return types.SimpleNamespace(instance_id=address, role=role, address=address,
                                 num_running=load, num_waiting=0)


async def test_placement_prefers_instances_with_the_adapter():
    placer = Placer(registry=_Registry([_instance("p1", "prefill"), _instance("p2", "prefill", 5),
                                        _instance("d1", "decode"), _instance("d2", "decode", 5)]))
    base = await placer.place([1] * 40, model_name="m", block_size=16)
    assert base == Placement("p1", "d1")  # least loaded
    with_adapter = await placer.place([1] * 40, model_name="m", block_size=16,
                                      prefer={"p2", "d2"})
    assert with_adapter == Placement("p2", "d2")
    # No prefill instance has it: the decode prefills the prompt itself.
    assert await placer.place([1] * 40, model_name="m", block_size=16,
                              prefer={"d2"}) == Placement(None, "d2")


class _Channels:
    """Load / Unload / ListLoRAAdapters of fake instances (`refuse`: address -> code)."""

    def __init__(self, refuse: dict[str, grpc.StatusCode]):
        self.refuse = refuse
        self.loaded: dict[str, dict[str, pb.LoRAAdapter]] = {}

    def _check(self, address):
        if address in self.refuse:
            raise grpc.aio.AioRpcError(self.refuse[address], None, None, f"no: {address}")

    async def load_lora_adapter(self, address, role, adapter):
        self._check(address)
        self.loaded.setdefault(address, {})[adapter.lora_name] = adapter
        return await self.list_lora_adapters(address, role)

    async def unload_lora_adapter(self, address, role, name):
        return self.loaded.get(address, {}).pop(name, None) is not None

    async def list_lora_adapters(self, address, role):
        return pb.LoRAAdapterList(adapters=list(self.loaded.get(address, {}).values()))


def _view(channels) -> LoRAView:
    placer = Placer(prefill_urls=["p1", "p2"], decode_urls=["d1"])
    return LoRAView(channels, placer, "m")


async def test_a_load_is_all_or_nothing():
    channels = _Channels({"p2": grpc.StatusCode.INVALID_ARGUMENT})
    view = _view(channels)
    with pytest.raises(GatewayError) as e:
        await view.load(make_lora_request("a", "/x"))
    assert e.value.status_code == 400
    assert "failed on 1 of 3 instance(s): p2: no: p2" in e.value.message
    assert "unloaded again from 2 instance(s)" in e.value.message
    assert all(not adapters for adapters in channels.loaded.values())
    with pytest.raises(GatewayError, match="does not exist"):
        await view.resolve("a")

    channels.refuse.clear()
    await view.load(make_lora_request("a", "/x"))
    assert (await view.resolve("a")).lora_path == "/x" and await view.resolve("m") is None
    assert [a.lora_name for a in await view.adapters()] == ["a"]
    assert await view.addresses_with(make_lora_request("a", "/x")) == {"p1", "p2", "d1"}
    with pytest.raises(GatewayError, match="already been loaded"):
        await view.load(make_lora_request("a", "/x"))
    await view.unload("a")
    with pytest.raises(GatewayError, match="cannot be found") as e:
        await view.unload("a")
    assert e.value.status_code == 404


async def test_an_unload_names_the_instances_that_may_still_serve_it():
    channels = _Channels({})
    view = _view(channels)
    await view.load(make_lora_request("a", "/x"))
    channels.refuse["d1"] = grpc.StatusCode.UNAVAILABLE

    async def unavailable(address, role, name):
        channels._check(address)
        return channels.loaded.get(address, {}).pop(name, None) is not None
    channels.unload_lora_adapter = unavailable
    with pytest.raises(GatewayError, match="failed on 1 of 3 instance.*d1") as e:
        await view.unload("a")
    assert e.value.status_code == 503


def test_one_adapter_in_slot_1_alone_maps_its_tokens():
    """The storm test's crash: a step whose only adapter sits in slot 1, in three runs."""
    import numpy as np
    import torch

    from pdserve.shared.lora.mapping import build_lora_mapping

    mapping = build_lora_mapping([1, -1, 1, -1, 1], np.ones(5, np.int64), torch.device("cpu"),
                                 num_slots=2)
    assert mapping.segments == [(1, 0, 3)]
    assert mapping.token_indices.tolist() == [0, 2, 4]
