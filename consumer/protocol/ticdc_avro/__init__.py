"""TiCDC's Avro protocol (`protocol=avro`, docs/protocols/ticdc-avro.md): Confluent-framed Avro datums whose
writer schemas live in a schema registry.

- `schemas`: topic, subject and Avro schema layout of a table version (shared by both directions)
- `decoder`: record (key, value) -> message (`ConfluentAvroDecoder`) and the `TicdcAvroProtocol`
- `rows`: a table version's datums -> typed Arrow images (`AvroRows`)
- `encoder`: message -> record (`ConfluentAvroEncoder`)
- `registry`: the schema registry client
"""
