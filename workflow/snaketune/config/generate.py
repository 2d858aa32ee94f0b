"""workflow/schemas/config.schema.yaml, made from the dataclasses: `python -m snaketune.config.generate` writes it,
`--check` says whether the committed file is what they make (tests/test_config_sources.py checks the same).

The schema is for editors and readers of a config (a YAML language server completes and checks keys with it); the
workflow checks a config with snaketune.config.load, which holds every constraint the schema states (the same
declarations: snaketune.config.fields) and the rules across keys that a schema cannot state.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from snaketune.config.choices import EXPERIMENT_NAME
from snaketune.config.fields import field_schema, section_schema
from snaketune.config.load import EXPERIMENT_SECTIONS, SECTIONS, TOP_LEVEL
from snaketune.config.schema import Config

SCHEMA_PATH = Path(__file__).resolve().parents[3] / "workflow/schemas/config.schema.yaml"
HEADER = (
    "# Generated from the dataclasses of workflow/snaketune/config/ by `python -m snaketune.config.generate`: edit\n"
    "# those (a field, its setting, its docstring) and run it again; tests/test_config_sources.py checks this file.\n"
)


def json_schema() -> dict:
    """The config's JSON schema: every section and top-level key, the experiments' overrides as references to the
    sections they override. A section may be null (`train:` with nothing under it), as load_config takes it."""

    def refs() -> dict:
        return {name: {"$ref": f"#/$defs/{name}"} for name in EXPERIMENT_SECTIONS}

    properties: dict = {}
    for name in TOP_LEVEL:
        if name in EXPERIMENT_SECTIONS:
            properties[name] = refs()[name]
        elif name in SECTIONS:
            properties[name] = section_schema(SECTIONS[name], nullable=True)
        elif name == "experiments":
            properties[name] = {
                "type": ["object", "null"],
                "propertyNames": {"pattern": EXPERIMENT_NAME.pattern},
                "additionalProperties": {
                    "type": ["object", "null"],
                    "additionalProperties": False,
                    "properties": refs(),
                },
                "description": field_schema(Config, "experiments")["description"],
            }
        else:
            properties[name] = field_schema(Config, name)
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "description": "snaketune configuration (config/config.yaml and the files given after it with --configfile).",
        "type": "object",
        "additionalProperties": False,
        "properties": properties,
        "$defs": {name: section_schema(SECTIONS[name], nullable=True) for name in EXPERIMENT_SECTIONS},
    }


class _Dumper(yaml.SafeDumper):
    """Lists of plain values on one line (`enum: [auto, oasst, chat]`), everything else as blocks."""

    def ignore_aliases(self, data) -> bool:
        return True


_Dumper.add_representer(
    list,
    lambda dumper, data: dumper.represent_sequence(
        "tag:yaml.org,2002:seq", data, flow_style=not any(isinstance(x, dict | list) for x in data)
    ),
)


def render() -> str:
    return HEADER + yaml.dump(json_schema(), Dumper=_Dumper, sort_keys=False, width=118, allow_unicode=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Write workflow/schemas/config.schema.yaml from the config dataclasses (--check: compare only)."
    )
    parser.add_argument(
        "--check", action="store_true", help="exit 1 where the committed schema is not current"
    )
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if SCHEMA_PATH.read_text() != text:
            print(f"{SCHEMA_PATH} is not what the dataclasses make: python -m snaketune.config.generate")
            return 1
        return 0
    SCHEMA_PATH.write_text(text)
    print(f"wrote {SCHEMA_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
