"""Kafka record bytes -> typed messages and rows, and back, for the protocols TiCDC writes.

- shared: `base` (the `Protocol` interface, `RecordDecoder`, row image types), `table` (`TableCodec`),
  `protocols` (the configured protocol, chosen once), `model`, `types`, `limits`, `checks`, `validation`,
  `containment`, `compression`, `self_described`, `avro_container`, `avro_varints`, `plain`
- `simple`: TiCDC's Simple protocol (docs/protocols/simple.md §1-§5)
- `ticdc_avro`: TiCDC's Avro protocol with a Confluent schema registry (docs/protocols/ticdc-avro.md)
- `debezium`: TiCDC's Debezium protocol (docs/protocols/debezium.md)

The three protocol subpackages import only the shared modules, never each other (an import-linter
contract in pyproject.toml).
"""
