"""The command line: flags come from the config dataclasses, and configs turn into argv and back."""
from __future__ import annotations

import argparse
import dataclasses
import typing

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from common.cli_args import add_config_args, config_from_args, config_to_argv, flag_fields
from common.config import KV_CACHE_DTYPES, LORA_RANKS, ConfigError, EngineConfig, GatewayConfig, ServingConfig
from pagoda import cli, up
from tests.conftest import ROOT

CONFIGS = (EngineConfig, ServingConfig, GatewayConfig)
COMMANDS = {  # command: (its parser builder, the configs it builds)
    "generate": (cli._add_generate, (EngineConfig,)),
    "up": (cli._add_up, CONFIGS),
    "gateway": (cli._add_gateway, (GatewayConfig,)),
    "scheduler": (cli._add_scheduler, (EngineConfig, ServingConfig)),
    "worker": (cli._add_worker, (EngineConfig, ServingConfig)),
}
ENGINE_FLAGS = {"--model", "--device", "--dtype", "--block-size", "--num-gpu-blocks", "--max-num-seqs",
                "--max-num-batched-tokens", "--max-model-len", "--swap-space", "--num-cpu-blocks", "--no-prefix-caching",
                "--allocator", "--preemption-mode"}
GATEWAY_FLAGS = {"--model", "--redis-url", "--host", "--port", "--api-key", "--served-model-name", "--max-body-bytes",
                 "--max-pending-requests", "--request-timeout", "--drain-timeout"}
FLAGS_BEFORE = {  # every flag each command had before its flags came from the configs
    "generate": ENGINE_FLAGS | {"--prompt", "--prompts-file", "--chat", "--max-tokens", "--temperature", "--top-p",
                                "--top-k", "--min-p", "--seed", "--ignore-eos", "--n", "--best-of", "--beam-width",
                                "--length-penalty", "--early-stopping", "--json"},
    "up": ENGINE_FLAGS | GATEWAY_FLAGS | {"--step-timeout", "--worker-timeout"},
    "gateway": GATEWAY_FLAGS,
    "scheduler": ENGINE_FLAGS | {"--redis-url", "--zmq-address", "--step-timeout", "--drain-timeout"},
    "worker": ENGINE_FLAGS | {"--zmq-address", "--step-timeout", "--drain-timeout", "--rank",
                              "--heartbeat-file"},
}


@pytest.fixture(autouse=True)
def no_env_defaults(monkeypatch):
    monkeypatch.delenv("PAGODA_REDIS_URL", raising=False)
    monkeypatch.delenv("PAGODA_API_KEY", raising=False)


def parser_of(command: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"pagoda {command}")
    COMMANDS[command][0](parser)
    return parser


def parser_for(cls: type) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_config_args(parser, cls)
    return parser


def same(a, b) -> bool:
    """Equal configs; a gateway's id is random per process and has no flag."""
    if isinstance(a, GatewayConfig):
        b = dataclasses.replace(b, gateway_id=a.gateway_id)
    return a == b


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_every_config_field_has_a_flag_or_says_why_it_has_none(cls):
    for f in dataclasses.fields(cls):
        has_flag = f.metadata.get("flag", "").startswith("--") and f.metadata.get("help")
        assert has_flag or f.metadata.get("no_flag"), (
            f"{cls.__name__}.{f.name}: declare it with option(default, '--flag', help) or no_flag(default, why)")


def test_every_flag_field_is_a_flag_of_some_command():
    dests = {action.dest for command in COMMANDS for action in parser_of(command)._actions}
    for cls in CONFIGS:
        for f in flag_fields(cls):
            assert f.name in dests, f"{cls.__name__}.{f.name}"


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_flag_that_existed_keeps_its_spelling(command):
    flags = {s for action in parser_of(command)._actions for s in action.option_strings}
    assert FLAGS_BEFORE[command] <= flags


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_each_parser_defaults_to_the_config_defaults(command):
    parser = parser_of(command)
    for cls in COMMANDS[command][1]:
        assert same(config_from_args(cls, parser.parse_args([])), cls())
        defaults = {f.name: f.default for f in flag_fields(cls)}
        for action in parser._actions:
            if action.dest in defaults and not (command == "up" and action.dest == "redis_url"):
                assert action.default == defaults[action.dest], (command, action.dest)
    if command == "up":
        assert parser.parse_args([]).redis_url is None  # start a private Redis


def test_the_environment_gives_the_redis_url_and_api_key_when_no_flag_does(monkeypatch):
    monkeypatch.setenv("PAGODA_REDIS_URL", "redis://10.0.0.1:6380/2")
    monkeypatch.setenv("PAGODA_API_KEY", "sk-env")
    gateway = config_from_args(GatewayConfig, parser_of("gateway").parse_args([]))
    assert (gateway.redis_url, gateway.api_key) == ("redis://10.0.0.1:6380/2", "sk-env")
    serving = config_from_args(ServingConfig, parser_of("scheduler").parse_args(["--redis-url", "redis://h:1/0"]))
    assert serving.redis_url == "redis://h:1/0"
    assert parser_of("up").parse_args([]).redis_url == "redis://10.0.0.1:6380/2"


def test_the_flags_people_type_build_the_configs():
    args = parser_of("scheduler").parse_args(
        ["--swap-space", "2", "--no-prefix-caching", "--max-num-seqs", "8", "--allocator", "orca-pow2",
         "--preemption-mode", "swap", "--redis-url", "redis://h:1/0", "--step-timeout", "5", "--drain-timeout", "3"])
    assert config_from_args(EngineConfig, args) == EngineConfig(
        swap_space_gb=2.0, enable_prefix_caching=False, max_num_seqs=8, allocator="orca-pow2", preemption_mode="swap")
    assert config_from_args(ServingConfig, args) == ServingConfig(
        redis_url="redis://h:1/0", step_timeout_s=5.0, drain_timeout_s=3.0)


def test_config_to_argv_writes_every_value_and_a_switch_only_off_its_default():
    assert config_to_argv(EngineConfig(swap_space_gb=2.5, enable_prefix_caching=False, num_gpu_blocks=64)) == [
        "--model=default", "--generation-config=auto", "--block-size=16", "--num-gpu-blocks=64", "--max-num-seqs=128",
        "--max-num-batched-tokens=2048", "--device=auto", "--dtype=auto", "--quantization=none", "--kv-cache-dtype=auto",
        "--runner=auto", "--convert=auto", "--gpu-memory-utilization=0.9",
        "--cpu-kv-cache-space=1.0", "--swap-space=2.5", "--no-prefix-caching", "--preemption-mode=auto",
        "--tensor-parallel-size=1",
        "--allocator=paged", "--max-loras=1", "--max-lora-rank=16", "--mm-encoder-cache-bytes=268435456"]
    argv = config_to_argv(ServingConfig(heartbeat_file="/run/alive"), exclude={"redis_url", "zmq_address"})
    assert {"--engine-id=0", "--step-timeout=60.0", "--drain-timeout=30.0", "--heartbeat-file=/run/alive"} <= set(argv)
    assert not [arg for arg in argv if arg.startswith(("--redis-url", "--zmq-address"))]


def test_a_value_that_starts_with_a_dash_survives_the_round_trip():
    config = EngineConfig(model="-odd name")
    assert config_from_args(EngineConfig, parser_for(EngineConfig).parse_args(config_to_argv(config))) == config


def _value_strategy(cls: type, f: dataclasses.Field) -> st.SearchStrategy:
    """Any value of the field's type; the config's own checks drop the invalid ones."""
    hint = typing.get_type_hints(cls)[f.name]
    value_type = next(t for t in (typing.get_args(hint) or (hint,)) if t is not type(None))
    special = {
        "block_size": st.sampled_from((8, 16, 32, 64, 128)),
        "redis_url": st.sampled_from(("redis://", "rediss://", "unix://")).flatmap(
            lambda scheme: st.text().map(lambda rest: scheme + rest)),
        "zmq_address": st.sampled_from(("tcp://", "ipc://")).flatmap(lambda scheme: st.text().map(scheme.__add__)),
        "gpu_memory_utilization": st.floats(0.01, 1.0),
        "port": st.integers(0, 65535),
        "kv_cache_dtype": st.sampled_from(KV_CACHE_DTYPES),  # checked by the config, not by argparse choices
        "max_lora_rank": st.sampled_from(LORA_RANKS),
        # a repeatable flag: each value written as its own `--lora-modules=VALUE`
        "lora_modules": st.lists(st.text(min_size=1).filter(lambda v: v != "--"), max_size=3).map(tuple),
    }
    if f.name in special:
        values = special[f.name]
    elif f.metadata["choices"]:
        values = st.sampled_from(f.metadata["choices"])
    else:
        values = {bool: st.booleans(), int: st.integers(0, 1 << 40), float: st.floats(0.0, 1e9),
                  # argparse (3.11) reads the value of `--host=--` as [], so "--" itself cannot round-trip
                  str: st.text(min_size=1).filter(lambda v: v != "--")}[value_type]
    if value_type is not hint:  # X | None
        values = values | st.none()
    return st.just(f.default) | values


def _configs(cls: type) -> st.SearchStrategy:
    def build(values: dict):
        try:
            return cls(**values)
        except ConfigError:
            return None

    fields = st.fixed_dictionaries({f.name: _value_strategy(cls, f) for f in flag_fields(cls)})
    return fields.map(build).filter(lambda config: config is not None)


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_a_config_turned_into_argv_parses_back_to_itself(cls, data):
    config = data.draw(_configs(cls))
    assert same(config_from_args(cls, parser_for(cls).parse_args(config_to_argv(config))), config)


def parsed_child(child: up.Child) -> argparse.Namespace:
    """A child's command parsed by its command's parser (the command is its role)."""
    assert child.command[1:4] == ["-m", "pagoda.cli", child.role]
    return parser_of(child.role).parse_args(child.command[4:])


def test_up_gives_each_child_its_config_as_flags(tmp_path):
    args = parser_of("up").parse_args(
        ["--model", "dummy:tiny.json", "--device", "cpu", "--swap-space", "0.5", "--no-prefix-caching",
         "--max-model-len", "256", "--allocator", "orca-max", "--port", "8123", "--api-key", "sk-1",
         "--served-model-name", "tiny", "--step-timeout", "7", "--drain-timeout", "4", "--request-timeout", "9"])
    engine, serving, gateway = (config_from_args(cls, args) for cls in (EngineConfig, ServingConfig, GatewayConfig))
    children = {child.name: child for child in up._children(engine, serving, gateway, "redis://127.0.0.1:7000/0",
                                                               tmp_path)}
    assert list(children) == ["scheduler-0", "worker-0.0", "gateway"]
    scheduler, worker, gate = (parsed_child(children[name]) for name in children)
    assert config_from_args(EngineConfig, scheduler) == config_from_args(EngineConfig, worker) == EngineConfig(
        model="dummy:tiny.json", device="cpu", swap_space_gb=0.5, enable_prefix_caching=False, max_model_len=256,
        allocator="orca-max")
    zmq_address = config_from_args(ServingConfig, scheduler).zmq_address
    assert zmq_address.startswith("tcp://127.0.0.1:") and zmq_address != ServingConfig().zmq_address
    assert config_from_args(ServingConfig, scheduler) == ServingConfig(
        redis_url="redis://127.0.0.1:7000/0", zmq_address=zmq_address, step_timeout_s=7.0, drain_timeout_s=4.0)
    dist_init_address = config_from_args(ServingConfig, worker).dist_init_address
    assert dist_init_address.startswith("tcp://127.0.0.1:") and dist_init_address != ServingConfig().dist_init_address
    assert worker.rank == 0
    assert config_from_args(ServingConfig, worker) == ServingConfig(
        zmq_address=zmq_address, dist_init_address=dist_init_address, step_timeout_s=7.0, drain_timeout_s=4.0,
        heartbeat_file=str(tmp_path / "worker-0.0.alive"))
    assert children["worker-0.0"].heartbeat == tmp_path / "worker-0.0.alive"
    assert children["worker-0.0"].env == {}  # on CPU no device is assigned
    assert same(config_from_args(GatewayConfig, gate), GatewayConfig(
        redis_url="redis://127.0.0.1:7000/0", model="dummy:tiny.json", served_model_name="tiny", port=8123,
        api_key="sk-1", request_timeout_s=9.0, drain_timeout_s=4.0))


def test_up_shares_the_cores_among_cpu_workers_unless_omp_num_threads_is_set(tmp_path, monkeypatch):
    args = parser_of("up").parse_args(["--device", "cpu", "--data-parallel-size", "2", "--tensor-parallel-size", "2"])
    configs = [config_from_args(cls, args) for cls in (EngineConfig, ServingConfig, GatewayConfig)]
    monkeypatch.setattr(up.os, "cpu_count", lambda: 8)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    children = up._children(*configs, "redis://127.0.0.1:7000/0", tmp_path, 2, [])
    assert {c.name: c.env for c in children if c.role == "worker"} == {
        f"worker-{g}.{r}": {"OMP_NUM_THREADS": "2"} for g in (0, 1) for r in (0, 1)}
    assert all(c.env == {} for c in children if c.role != "worker")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert all(c.env == {} for c in up._children(*configs, "redis://127.0.0.1:7000/0", tmp_path, 2, []))


def test_up_starts_each_engine_group_with_its_own_addresses_ranks_and_gpus(tmp_path):
    """--data-parallel-size 2 --tensor-parallel-size 2: per group a scheduler (its engine id) and two
    ranks on the group's ZeroMQ and torch.distributed addresses; worker (g, r) gets GPU g*2 + r."""
    args = parser_of("up").parse_args(["--device", "cuda", "--tensor-parallel-size", "2", "--data-parallel-size", "2"])
    engine, serving, gateway = (config_from_args(cls, args) for cls in (EngineConfig, ServingConfig, GatewayConfig))
    gpus = up.assign_gpus(engine.device, args.data_parallel_size, engine.tensor_parallel_size, ["4", "5", "6", "7"])
    children = up._children(engine, serving, gateway, "redis://127.0.0.1:7000/0", tmp_path, args.data_parallel_size,
                            gpus)
    assert [c.name for c in children] == ["scheduler-0", "worker-0.0", "worker-0.1", "scheduler-1", "worker-1.0",
                                          "worker-1.1", "gateway"]
    by_name = {c.name: c for c in children}
    addresses = set()
    for g in (0, 1):
        scheduler = parsed_child(by_name[f"scheduler-{g}"])
        group = config_from_args(ServingConfig, scheduler)
        assert (group.engine_id, config_from_args(EngineConfig, scheduler).tensor_parallel_size) == (str(g), 2)
        assert by_name[f"scheduler-{g}"].env == {}
        ranks = []
        for r in (0, 1):
            child = by_name[f"worker-{g}.{r}"]
            worker = parsed_child(child)
            rank = config_from_args(ServingConfig, worker)
            assert (worker.rank, config_from_args(EngineConfig, worker).tensor_parallel_size) == (r, 2)
            assert rank.zmq_address == group.zmq_address and rank.heartbeat_file == str(child.heartbeat)
            assert child.heartbeat == tmp_path / f"worker-{g}.{r}.alive"
            assert child.env == {"CUDA_VISIBLE_DEVICES": str(4 + 2 * g + r)}
            ranks.append(rank.dist_init_address)
        assert ranks[0] == ranks[1]
        addresses |= {group.zmq_address, ranks[0]}
    assert len(addresses) == 4  # no two groups share an address
    assert parsed_child(by_name["gateway"]).redis_url == "redis://127.0.0.1:7000/0"


@pytest.mark.parametrize("device, visible, expected", [
    ("auto", ["0", "1", "2"], ["0", "1"]), ("cuda", ["GPU-ab", "GPU-cd"], ["GPU-ab", "GPU-cd"]),
    ("cpu", ["0", "1"], []), ("auto", [], []),
])
def test_up_gives_each_worker_its_own_gpu_where_there_are_gpus(device, visible, expected):
    assert up.assign_gpus(device, 2, 1, visible) == expected


@pytest.mark.parametrize("device, message", [
    ("auto", "--data-parallel-size 2 x --tensor-parallel-size 2 is 4 workers, one GPU each, but 3 GPU(s) are "
             "visible (0,1,2); lower either size or make more GPUs visible (CUDA_VISIBLE_DEVICES)"),
    ("cuda:1", "--device cuda:1 names one GPU, but 4 workers need one each (--data-parallel-size x "
               "--tensor-parallel-size); use --device cuda or auto"),
])
def test_up_refuses_more_workers_than_gpus(device, message):
    with pytest.raises(ConfigError) as error:
        up.assign_gpus(device, 2, 2, ["0", "1", "2"])
    assert str(error.value) == message


@pytest.mark.parametrize("visible, expected", [("2,3", ["2", "3"]), ("", []), ("1,-1,2", ["1"]), (" 0 , 1", ["0", "1"])])
def test_visible_gpus_reads_cuda_visible_devices_as_cuda_does(monkeypatch, visible, expected):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert up.visible_gpus() == expected


def test_up_refuses_too_many_workers_for_the_gpus_before_it_starts_anything(monkeypatch, capsys):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert cli.main(["up", "--data-parallel-size", "2"]) == 2
    err = capsys.readouterr().err
    assert "pagoda: error: --data-parallel-size 2 x --tensor-parallel-size 1 is 2 workers, one GPU each, but 1 " in err
    assert "private Redis" not in err
    assert cli.main(["up", "--data-parallel-size", "0"]) == 2
    assert "pagoda: error: data_parallel_size must be >= 1" in capsys.readouterr().err


def test_up_refuses_a_bad_config_before_it_starts_anything(capsys):
    assert cli.main(["up", "--block-size", "7"]) == 2
    err = capsys.readouterr().err
    assert "pagoda: error: block_size must be one of 8, 16, 32, 64, 128" in err
    assert "private Redis" not in err


@pytest.mark.parametrize("command", [*sorted(COMMANDS), "bench", "bench kernels", "bench memory", "bench throughput",
                                     "bench serve", "bench quality"])
def test_help_works_for_every_subcommand(command, capsys):
    with pytest.raises(SystemExit) as exit:
        cli.main([*command.split(), "--help"])
    assert exit.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: pagoda {command}")
    for flag in FLAGS_BEFORE.get(command, ()):
        assert flag in out


def test_the_commands_in_compose_yaml_parse_into_valid_configs():
    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    commands = [s["command"] for s in services.values() if s["command"][0] == "pagoda"]
    assert sorted(c[1] for c in commands) == ["gateway", "scheduler", "worker"]
    for command in commands:
        args = parser_of(command[1]).parse_args(command[2:])
        for cls in COMMANDS[command[1]][1]:
            config_from_args(cls, args)


def test_an_empty_redis_url_variable_is_unset_and_an_empty_api_key_is_refused(monkeypatch):
    monkeypatch.setenv("PAGODA_REDIS_URL", "")
    monkeypatch.setenv("PAGODA_API_KEY", "")
    args = parser_of("gateway").parse_args([])
    assert config_from_args(ServingConfig, parser_of("scheduler").parse_args([])).redis_url == ServingConfig().redis_url
    with pytest.raises(ConfigError, match="api_key must not be empty"):
        config_from_args(GatewayConfig, args)
