"""LightningModules, callbacks and the safetensors checkpoint format."""
