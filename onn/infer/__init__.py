"""Text generation: streamed tokens for a prompt, JSONL for many."""
