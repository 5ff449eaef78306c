"""Layer streaming: the layer store, the engine that runs a model a chunk of blocks at a time, and its Lightning
strategy."""
