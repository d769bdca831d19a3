"""TiCDC's Debezium protocol (`protocol=debezium`, docs/protocols/debezium.md): JSON change events shaped
like the Debezium MySQL connector's, plus TiCDC's DDL and WATERMARK events.

- `decoder`: record (key, value) -> message (`DebeziumDecoder`) and the `DebeziumProtocol`
- `rows`: a table version's row payloads -> typed Arrow images (`DebeziumRows`)
- `encoder`: message -> record (`DebeziumEncoder`)
"""
