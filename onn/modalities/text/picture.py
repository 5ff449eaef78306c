"""task=infer's picture for a language model: the prompt and its completion, token by token, each coloured by the
probability the model gave it where it stood (one forward pass over the whole text, teacher-forced). Where the
prompt is read, low probabilities show what the model did not expect; in the completion, how sure it was."""

from __future__ import annotations

from pathlib import Path

import torch

from onn.modalities.text.generate import prompt_ids as encoded_prompt
from onn.models.load import context_length

COLUMNS = 48  # tokens per row of the picture
MAX_TOKENS = 960  # the picture shows at most this many (20 rows)
SHOWN = {"\n": "↵", "\t": "→", " ": "·"}


@torch.no_grad()
def token_probabilities(
    model, tokenizer, prompt: str, completion: str, add_special_tokens: bool = True, bos: bool = False
) -> tuple[list[str], list[float], int]:
    """(each token's text, the probability the model gave it after the tokens before it, how many are the
    prompt's). The first token has no context: its probability is NaN. `add_special_tokens`, `bos`: the prompt's
    tokens as generation read them (no second BOS after a chat template's; BOS first after plain text). At most the
    model's context: the completion's text tokenized again can be longer than what was generated (a byte that is no
    UTF-8 decodes to U+FFFD, three bytes), which learned positions (GPT-2's) met with an IndexError."""
    prompt_ids = encoded_prompt(tokenizer, prompt, add_special_tokens, bos)
    completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
    shown = min(MAX_TOKENS, context_length(model) or MAX_TOKENS)
    ids = torch.tensor([(prompt_ids + completion_ids)[:shown]], device=next(model.parameters()).device)
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0].float()
    chosen = logits[:-1].softmax(-1).gather(1, ids[0, 1:].unsqueeze(1)).squeeze(1)
    probabilities = [float("nan")] + chosen.tolist()
    texts = [tokenizer.decode([i]) for i in ids[0].tolist()]
    return texts, probabilities, min(len(prompt_ids), len(texts))


def write_picture(texts: list[str], probabilities: list[float], prompt_tokens: int, path: Path) -> None:
    """A grid of the tokens, COLUMNS a row, each cell coloured by its probability; the prompt's tokens in grey
    type, the completion's in black."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows = -(-len(texts) // COLUMNS)
    grid = np.full((rows, COLUMNS), np.nan)
    grid.flat[: len(probabilities)] = probabilities
    figure, axes = plt.subplots(figsize=(COLUMNS * 0.22 + 1.5, rows * 0.3 + 1.0))
    image = axes.imshow(grid, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
    for i, text in enumerate(texts):
        shown = "".join(SHOWN.get(c, c if c.isprintable() else "?") for c in text)[:3]  # control bytes: "?"
        colour = "dimgray" if i < prompt_tokens else "black"
        axes.text(i % COLUMNS, i // COLUMNS, shown, ha="center", va="center", fontsize=7, color=colour)
    axes.set_xticks([])
    axes.set_yticks([])
    axes.set_title(
        f"P(token | the text before it): {prompt_tokens} prompt tokens (grey), "
        f"{len(texts) - prompt_tokens} generated (black)",
        fontsize=9,
    )
    figure.colorbar(image, ax=axes, fraction=0.02, pad=0.01)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
