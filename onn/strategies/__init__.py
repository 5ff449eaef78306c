"""How weights are trained and placed: full, LoRA, QLoRA, sparse LoRA."""
