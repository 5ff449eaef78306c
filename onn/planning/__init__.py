"""Plan a run before it starts: the model sized on the meta device, memory and time predicted, settings chosen."""
