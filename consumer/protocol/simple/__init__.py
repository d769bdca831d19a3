"""TiCDC's Simple protocol (`protocol=simple`, docs/protocols/simple.md): JSON or Avro messages, announced
table versions, row checksums.

- `decoder`: record value -> message (`MessageDecoder`) and the `SimpleProtocol`
- `json_messages`, `avro_messages`: the two encodings of a message, both directions
- `rows`, `avro_rows`: a table version's DML rows -> typed Arrow images (`SimpleRows`)
- `encoder`: message -> record value (`MessageEncoder`)
- `checksum`: TiDB's row checksums
"""
