"""What every layer shares: the wire format (codec, ragged batches, generated stubs), result and
error types, the config schema, metrics and model-loading helpers. Imports no other layer."""
