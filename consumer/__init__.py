"""Consumer SDK for TiCDC's Simple protocol."""
