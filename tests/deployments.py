"""Checks shared by the deployment tests (tests/test_compose.py, tests/test_kubernetes.py): every
`pagoda` command a deployment file runs parses with pagoda's own parser into valid configs, every
health check parses with common.health's, and the ranks of each engine group make one whole
tensor-parallel group behind its scheduler."""
from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from unittest import mock

import pytest

from common.cli_args import config_from_args
from common.config import EngineConfig, GatewayConfig, ServingConfig
from common.health import build_parser as health_parser
from pagoda import cli

COMMANDS: dict[str, tuple[Callable[[argparse.ArgumentParser], None], tuple[type, ...]]] = {
    "scheduler": (cli._add_scheduler, (EngineConfig, ServingConfig)),
    "worker": (cli._add_worker, (EngineConfig, ServingConfig)),
    "gateway": (cli._add_gateway, (GatewayConfig,)),
}
ENV_DEFAULTS = ("PAGODA_REDIS_URL", "PAGODA_API_KEY")  # the flags that read the environment


@dataclass(slots=True)
class Command:
    """One `pagoda SUBCOMMAND ...` of a deployment file, parsed as pagoda parses it."""

    name: str
    args: argparse.Namespace
    configs: dict[type, object]

    @property
    def engine(self) -> EngineConfig:
        return self.configs[EngineConfig]

    @property
    def serving(self) -> ServingConfig:
        return self.configs[ServingConfig]


@dataclass(slots=True)
class EngineGroup:
    name: str
    scheduler: Command
    ranks: list[Command]


def _parse(parser: argparse.ArgumentParser, argv: list[str], env: Mapping[str, str]) -> argparse.Namespace:
    try:
        return parser.parse_args(argv)
    except SystemExit:  # argparse has printed why
        pytest.fail(f"{parser.prog} does not accept {argv} (environment {dict(env)})")


def parse_pagoda(argv: list[str], env: Mapping[str, str] | None = None) -> Command:
    """`argv` (["pagoda", "worker", ...]) parsed in a container whose environment is `env` only, and
    its configs built (which validates them: a ConfigError fails the test)."""
    assert argv[0] == "pagoda" and argv[1] in COMMANDS, f"not a pagoda serving command: {argv}"
    env = env or {}
    add_flags, classes = COMMANDS[argv[1]]
    with mock.patch.dict(os.environ):
        for name in ENV_DEFAULTS:
            os.environ.pop(name, None)
        os.environ.update(env)
        parser = argparse.ArgumentParser(prog=f"pagoda {argv[1]}")
        add_flags(parser)
        args = _parse(parser, argv[2:], env)
    return Command(argv[1], args, {cls: config_from_args(cls, args) for cls in classes})


def parse_health(argv: list[str], env: Mapping[str, str] | None = None) -> argparse.Namespace:
    """A `python -m common.health ...` check, parsed by common.health's own parser."""
    assert argv[:3] == ["python", "-m", "common.health"], f"not a common.health check: {argv}"
    env = env or {}
    with mock.patch.dict(os.environ):
        os.environ.pop("PAGODA_REDIS_URL", None)
        os.environ.update(env)
        args = _parse(health_parser(), argv[3:], env)
    assert args.heartbeat_file or args.redis_url, f"{argv} names neither a heartbeat file nor a Redis"
    return args


def port_of(address: str) -> int:
    return int(address.rpartition(":")[2])


def host_of(address: str) -> str:
    return address.removeprefix("tcp://").rpartition(":")[0]


def check_engine_group(group: EngineGroup) -> None:
    """Ranks 0..N-1 once each, all of --tensor-parallel-size N as the scheduler, one rendezvous for
    the group, every rank connecting to the port its scheduler binds."""
    size = group.scheduler.engine.tensor_parallel_size
    assert sorted(rank.args.rank for rank in group.ranks) == list(range(size)), \
        f"{group.name}: ranks {[r.args.rank for r in group.ranks]} for a scheduler of --tensor-parallel-size {size}"
    assert [rank.engine.tensor_parallel_size for rank in group.ranks] == [size] * size, group.name
    assert len({rank.serving.dist_init_address for rank in group.ranks}) == 1, group.name
    assert {port_of(rank.serving.zmq_address) for rank in group.ranks} == {port_of(group.scheduler.serving.zmq_address)}
    # everything else a rank computes with is its scheduler's: the same model and KV layout
    assert all(rank.engine == group.scheduler.engine for rank in group.ranks), group.name


def check_engine_groups(groups: list[EngineGroup]) -> None:
    for group in groups:
        check_engine_group(group)
    engine_ids = [group.scheduler.serving.engine_id for group in groups]
    assert len(set(engine_ids)) == len(engine_ids), f"engine ids must differ: {engine_ids}"
