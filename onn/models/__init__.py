"""Load models from any source and discover their layer structure (the LayerMap)."""
