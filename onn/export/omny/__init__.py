""".omny files (format.py: write, read, inspect, validate, enrich; FORMAT_SPEC.md) and their command line
(cli.py, `python -m onn.export.omny`)."""

from onn.export.omny.format import (
    DEFAULTS,
    FORMAT_VERSION,
    METADATA_KEY,
    OmnyInfo,
    Validation,
    check_document,
    declared_sample,
    describe,
    enrich_onnx,
    inspect_omny,
    read_document,
    sample_feeds,
    schema,
    unknown_tensors,
    validate,
    write,
)

__all__ = [
    "DEFAULTS",
    "FORMAT_VERSION",
    "METADATA_KEY",
    "OmnyInfo",
    "Validation",
    "check_document",
    "declared_sample",
    "describe",
    "enrich_onnx",
    "inspect_omny",
    "read_document",
    "sample_feeds",
    "schema",
    "unknown_tensors",
    "validate",
    "write",
]
