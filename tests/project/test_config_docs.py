"""The configuration's fields, their flags and the README's table agree: all three come from the structs."""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any, get_type_hints

import click
import msgspec
import pytest
from click.testing import CliRunner

from consumer import app, cli, progress
from consumer.config import RunConfig
from consumer.config_fields import FIELDS, FLAGS, ConfigField, table_cells
from consumer.pipeline import PipelineStats

README = Path(__file__).resolve().parents[2] / "README.md"
TABLE_HEADER = "| key | default | flag | meaning |"
# Values a flag under test may take that load_config accepts (other text fields take any text)
TEXT_SAMPLES = {
    "source.url": "kafka://127.0.0.1:9/other",
    "sink.url": "jsonl:elsewhere",
    "large_messages.claim_check_root_override": "file:///claims",
    "sink.mode": "changelog,history",
}
# Flags each command had before they were made from the structs: scripts use them
FORMER_FLAGS = {
    "run": {
        *("--source", "--group", "--sink", "--mode", "--encoding", "--compression", "--protocol"),
        *("--schema-registry", "--schema-registry-auth", "--timestamp-zone", "--ordering", "--until-idle"),
        *("--metrics-port", "--processes", "--engine", "--master", "--checkpoint", "--config"),
    },
    "decode": {"--encoding", "--compression", "--protocol", "--schema-registry"}
    | {"--schema-registry-auth", "--timestamp-zone"},
    "dead-letters replay": {"--sink", "--config", "--group", "--dead-letter", "--reason", "--json", "--mode"}
    | {"--encoding", "--protocol", "--schema-registry", "--schema-registry-auth", "--timestamp-zone"},
}


def _readme_rows() -> dict[str, list[str]]:
    lines = README.read_text().splitlines()
    start = lines.index(TABLE_HEADER) + 2  # past the header and its --- row
    rows = itertools.takewhile(lambda line: line.startswith("|"), lines[start:])
    cells = [[cell.strip() for cell in row.strip().strip("|").split("|")] for row in rows]
    return {row[0]: row for row in cells}


def test_the_readme_table_lists_every_field_with_its_default_flag_and_help() -> None:
    documented = _readme_rows()
    expected = {cells[0]: cells for cells in map(table_cells, FIELDS)}
    assert sorted(expected.keys() - documented.keys()) == [], "missing: run python -m consumer.config_fields"
    assert sorted(documented.keys() - expected.keys()) == [], "not a configuration field"
    for key, cells in expected.items():
        assert documented[key] == cells, f"{key}: regenerate the table (python -m consumer.config_fields)"


def test_flags_are_unique_and_every_field_but_tables_lists_and_secrets_has_one() -> None:
    flags = [field.flag for field in FIELDS if field.flag]
    assert len(flags) == len(set(flags))
    unflagged = {field.key for field in FIELDS if not field.flag}
    assert unflagged == {
        "source.kafka",
        "decode.schema_registry_config",
        "sink.storage_options",
        "errors.kafka",
        "large_messages.claim_check_roots",
        "large_messages.upstream_dsn",
    }


@pytest.mark.parametrize("command", sorted(FORMER_FLAGS))
def test_commands_keep_their_former_flags(command: str) -> None:
    found = _command(command)
    names = {name for param in found.params for name in (*param.opts, *param.secondary_opts)}
    assert FORMER_FLAGS[command] <= names


def test_run_help_lists_every_flag_with_its_help() -> None:
    options = [p for p in _command("run").params if isinstance(p, click.Option)]
    assert all(option.help for option in options)
    shown = CliRunner().invoke(cli.main, ["run", "--help"], terminal_width=200).output
    for option in options:
        assert f"{option.opts[0]} " in shown or f"{option.opts[0]}/" in shown
        assert option.help is not None and option.help.split()[0] in shown


def _command(path: str) -> click.Command:
    found: click.Command = cli.main
    for name in path.split():
        assert isinstance(found, click.Group)
        found = found.commands[name]
    return found


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> list[RunConfig]:
    """`run`'s configuration, caught where it would start consuming (nothing is served either)."""
    seen: list[RunConfig] = []

    def run(config: RunConfig, **_: Any) -> PipelineStats:
        seen.append(config)
        return PipelineStats()

    class Reporter:
        def __init__(self, **_: Any) -> None:
            pass

        def close(self) -> None:
            pass

    monkeypatch.setattr(app, "run", run)
    monkeypatch.setattr(progress, "ProgressReporter", Reporter)  # `run` imports it when it runs
    for name in [name for name in os.environ if name.startswith("TICDC_CONSUMER_")]:
        monkeypatch.delenv(name)
    return seen


def _sample(field: ConfigField) -> list[str]:
    """Flag and text setting `field` to something other than its default."""
    option = next(p for p in _command("run").params if p.name == field.param)
    assert isinstance(option, click.Option)
    if option.is_bool_flag:
        return [option.secondary_opts[0] if field.default else option.opts[0]]
    if isinstance(option.type, click.Choice):
        text = [str(c) for c in option.type.choices if str(c) != str(field.default).lower()][-1]
    elif option.type in (click.INT, click.FLOAT):
        text = str((field.default or 0) + (1 if option.type == click.INT else 1.5))
    else:
        text = TEXT_SAMPLES.get(field.key, f"x-{field.name}")
    return [option.opts[0], text]


def _expected(field: ConfigField, text: str) -> Any:
    section = type(getattr(RunConfig(), field.section))
    return msgspec.convert(text, get_type_hints(section)[field.name], strict=False)


@pytest.mark.parametrize("field", FLAGS.values(), ids=lambda field: field.key)
def test_each_flag_sets_its_field(field: ConfigField, captured: list[RunConfig], tmp_path: Path) -> None:
    flag = _sample(field)
    spark = ["--engine", "spark"] if field.section == "engine" and field.name != "kind" else []
    args = ["run", "--source", "kafka://127.0.0.1:9/t", "--sink", f"delta:{tmp_path}", *spark, *flag]
    result = CliRunner().invoke(cli.main, args)
    assert result.exit_code == 0, result.output
    value = getattr(getattr(captured[0], field.section), field.name)
    expected = (not field.default) if field.is_switch else _expected(field, flag[1])
    assert value == expected != field.default
