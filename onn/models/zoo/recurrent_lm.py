"""A character- (byte-) level recurrent language model as a transformers causal LM, so that the text modality
trains, evaluates, generates and exports it as it does any other (onn/modalities/text).

    embedding -> N x RecurrentBlock (an LSTM or GRU, dropout, a residual connection) -> linear head

`RecurrentLMConfig` (model_type `onn_recurrent_lm`) and `RecurrentLMForCausalLM` are registered with
transformers' Auto classes (`register_auto`), so `model.source: random` with `model.architecture:
{model_type: onn_recurrent_lm, ...}` builds it through onn/models/load.py like a Llama, and a saved Hugging Face
folder loads again. The blocks are a ModuleList of identical layers: LayerMap discovery finds them.

The recurrent state is what a transformer's KV cache is to it: `past_key_values` in and out, a flat tuple of
tensors (each layer's h, and c for an LSTM). Generation carries it from token to token (one LSTM step per
new token, not the whole text again), and truncated backpropagation through time carries it, detached, from
one chunk of a long sequence to the next (CausalLM in onn/modalities/text/module.py, task.tbptt_steps).

Padding. A row's tokens are moved to the start of the row before the recurrence (left-padded generation
batches included) and back after it, so a recurrence reads each row's tokens before its padding, and its
outputs at a row's tokens never depend on the padding. Where rows of different lengths must each end in their
own last token's state (a batch of prompts, before generation goes on from it), the sequences are packed
(pack_padded_sequence); elsewhere (training, validation, ONNX export, which cannot trace packing) the
recurrences run over the padded batch, several times faster on a CPU.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PreTrainedConfig, PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import CausalLMOutputWithPast

from onn.errors import UserError
from onn.models.zoo.recurrent import CELLS, in_float32, recurrence, take_steps

MODEL_TYPE = "onn_recurrent_lm"


class RecurrentLMConfig(PreTrainedConfig):
    """The shapes of a RecurrentLMForCausalLM (conf/model/char_lstm.yaml gives them as model.architecture)."""

    model_type = MODEL_TYPE

    def __init__(
        self,
        vocab_size: int = 259,
        hidden_size: int = 256,
        num_hidden_layers: int = 2,
        cell: str = "lstm",
        dropout: float = 0.1,
        bos_token_id: int = 256,
        eos_token_id: int = 257,
        pad_token_id: int = 258,
        tie_word_embeddings: bool = False,
        **kwargs,
    ):
        check_shape(hidden_size, num_hidden_layers, cell, dropout)
        self.vocab_size, self.hidden_size, self.num_hidden_layers = vocab_size, hidden_size, num_hidden_layers
        self.cell, self.dropout = cell, dropout
        super().__init__(
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )


def check_shape(hidden_size: int, num_hidden_layers: int, cell: str, dropout: float) -> None:
    """The shapes conf/model/char_lstm.yaml gives as model.architecture, each refused in one sentence naming its key:
    no layers built a model with no recurrence (and no LayerMap), a zero width failed inside nn.LSTM."""
    for key, value in (("hidden_size", hidden_size), ("num_hidden_layers", num_hidden_layers)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"model.architecture.{key}={value!r}: give a whole number, 1 or more.")
    if cell not in CELLS:
        raise UserError(f"model.architecture.cell={cell!r}: use one of {', '.join(CELLS)}.")
    if isinstance(dropout, bool) or not isinstance(dropout, int | float) or not 0 <= dropout < 1:
        raise UserError(f"model.architecture.dropout={dropout!r}: give a number in [0, 1) (0: no dropout).")


def compaction(attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(index [B, T], lengths [B]): where each position of a row goes when its tokens are moved to the start in
    order and its padding after them (a permutation of each row), and how many tokens each row has."""
    mask = attention_mask.long()
    lengths = mask.sum(dim=1)
    token_slot = mask.cumsum(dim=1) - 1
    pad_slot = lengths.unsqueeze(1) + (1 - mask).cumsum(dim=1) - 1
    return torch.where(mask.bool(), token_slot, pad_slot), lengths


class RecurrentBlock(GradientCheckpointingLayer):
    """One layer of the stack: an LSTM or GRU over each row's tokens, dropout, and a residual connection.
    [B, T, H] (tokens first, `lengths` of them per row) and the layer's state in -> [B, T, H] and its state out.
    A GradientCheckpointingLayer: with strategy.gradient_checkpointing its forward is recomputed in the backward."""

    def __init__(self, hidden: int, cell: str, dropout: float):
        super().__init__()
        self.rnn = CELLS[cell](hidden, hidden, batch_first=True)
        self.dropout = nn.Dropout(dropout)

    def forward(
        self, x: torch.Tensor, lengths: torch.Tensor, state: tuple[torch.Tensor, ...] | None, packed: bool = False
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """`packed`: each row's final state is its own last token's (pack_padded_sequence); otherwise the
        recurrence runs over the padded batch, whose outputs at each row's tokens are the same and whose final
        state is right only for the rows that fill it."""
        hx = (
            None
            if state is None
            else (state[0].unsqueeze(0) if len(state) == 1 else tuple(s.unsqueeze(0) for s in state))
        )
        if torch.compiler.is_exporting():  # a scan: the exported graph takes any number of tokens
            out, last = recurrence(self.rnn, x, hx)
        elif not packed:
            with in_float32(self.rnn, x) as inputs:
                out, last = self.rnn(inputs, hx)
        else:
            with in_float32(self.rnn, x) as inputs:
                inputs = nn.utils.rnn.pack_padded_sequence(
                    inputs, lengths.clamp(min=1).cpu(), batch_first=True, enforce_sorted=False
                )
                out, last = self.rnn(inputs, hx)
            out = nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])[0]
        last = tuple(s.squeeze(0) for s in (last if isinstance(last, tuple) else (last,)))
        if state is not None:  # a row without tokens here (a chunk past its end) keeps the state it had
            empty = (lengths == 0).unsqueeze(1)
            last = tuple(torch.where(empty, old, new) for old, new in zip(state, last))
        return x + self.dropout(out), last


class RecurrentLMForCausalLM(PreTrainedModel, GenerationMixin):
    """Bytes -> embedding -> a stack of RecurrentBlocks -> next-byte logits; loss, outputs and generation as a
    transformers causal LM's (model(**batch).loss, model.generate), the state in `past_key_values`."""

    config_class = RecurrentLMConfig
    base_model_prefix = "recurrent_lm"
    main_input_name = "input_ids"
    _no_split_modules = ["RecurrentBlock"]
    supports_gradient_checkpointing = True  # each RecurrentBlock recomputed in the backward (strategy key)
    _tied_weights_keys = {"head.weight": "embed.weight"}  # one matrix for both with tie_word_embeddings: true
    carries_state = True  # past_key_values is a recurrent state: CausalLM may truncate backpropagation through it

    def __init__(self, config: RecurrentLMConfig):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.dropout = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(
            RecurrentBlock(config.hidden_size, config.cell, config.dropout) for _ in range(config.num_hidden_layers)
        )
        self.head = nn.Linear(config.hidden_size, config.vocab_size)
        self.post_init()

    @property
    def state_size(self) -> int:
        """Tensors of state per layer: h and c for an LSTM, h for a GRU."""
        return 2 if self.config.cell == "lstm" else 1

    def _init_weights(self, module: nn.Module) -> None:
        """PyTorch's own initialisation of each layer (an LSTM's uniform weights, not transformers' normal ones). An
        embedding the head shares (tie_word_embeddings) is drawn at 1/sqrt(width), not nn.Embedding's 1: as the head's
        matrix that gave logits of ~sqrt(width) and a first loss of 30 where 5.6 is chance; the head keeps it."""
        tied = self.config.tie_word_embeddings
        if tied and module is self.embed:
            nn.init.normal_(module.weight, std=self.config.hidden_size**-0.5)
        elif tied and module is self.head:
            nn.init.zeros_(module.bias)
        elif module is not self and hasattr(module, "reset_parameters"):
            module.reset_parameters()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.head

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        past_key_values: tuple[torch.Tensor, ...] | None = None,
        use_cache: bool | None = None,
        shift_labels: torch.Tensor | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        **kwargs,  # what generate passes that a recurrence has no use for (return_dict, position_ids, ...)
    ) -> CausalLMOutputWithPast:
        """`past_key_values`: the state the previous tokens left (None: zeros); returned when use_cache. Loss
        arguments (labels, or shift_labels: each position's next token, already shifted) go to transformers'
        causal-LM loss, with num_items_in_batch when the caller sums chunks' losses."""
        padded = attention_mask is not None and input_ids.shape[1] > 1  # known on the host (see _packs)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        index, lengths = compaction(attention_mask)
        moved = torch.zeros_like(input_ids).scatter(1, index, input_ids)  # each row's tokens first
        x = self.dropout(self.embed(moved))
        per_layer, packed = self.state_size, self._packs(use_cache, padded, lengths, input_ids.shape[1])
        states = []
        for i, layer in enumerate(self.layers):
            state = None if past_key_values is None else past_key_values[i * per_layer : (i + 1) * per_layer]
            x, state = layer(x, lengths, state, packed)
            states.extend(state)
        logits = self.head(take_steps(x, index))  # back to each token's own position
        loss = None
        if labels is not None or shift_labels is not None:
            loss = self.loss_function(
                logits,
                labels,
                vocab_size=self.config.vocab_size,
                shift_labels=shift_labels,
                num_items_in_batch=num_items_in_batch,
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=tuple(states) if use_cache else None)

    def _packs(self, use_cache: bool | None, padded: bool, lengths: torch.Tensor, width: int) -> bool:
        """Whether the recurrences run over packed sequences: only where rows shorter than the batch must each end in
        their own last token's state, to go on from it (generation's prompts). Training does not need that: a row
        that ends inside a chunk of truncated backpropagation has no tokens after it. On a CPU a packed LSTM's
        step takes 4-6x as long as the padded batch's (docs/recurrent.md), for the same outputs at the tokens.
        `padded`: a mask was given over more than one column. Without one no row is short; over one column (each
        generated token) a row without its token keeps its state (RecurrentBlock), so neither needs packing, and
        deciding so on the host spares generation a read of the device (a wait for its kernels) per new token."""
        if not use_cache or not padded or self.training or torch.compiler.is_exporting() or lengths.is_meta:
            return False
        return bool((lengths < width).any())

    def prepare_inputs_for_generation(
        self,
        input_ids: torch.Tensor,
        past_key_values: tuple[torch.Tensor, ...] | None = None,
        attention_mask: torch.Tensor | None = None,
        **kwargs,
    ) -> dict:
        """The whole prompt first; then, with the state carried, only the newest token."""
        if past_key_values is not None:
            input_ids = input_ids[:, -1:]
            attention_mask = torch.ones_like(input_ids)
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "past_key_values": past_key_values,
            "use_cache": True,
        }

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # its state is its own (past_key_values above), not a KV cache

    def _reorder_cache(self, past_key_values: tuple[torch.Tensor, ...], beam_idx: torch.Tensor) -> tuple:
        """Each row's state taken from the beam it now continues: beam search (num_beams > 1) calls this after
        every step, and without it transformers refused to reorder the state after the first token."""
        return tuple(s.index_select(0, beam_idx.to(s.device)) for s in past_key_values)


def register_auto() -> None:
    """Make transformers' Auto classes know the model (once; AutoConfig.register refuses a second time)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if MODEL_TYPE not in CONFIG_MAPPING:
        AutoConfig.register(MODEL_TYPE, RecurrentLMConfig)
        AutoModelForCausalLM.register(RecurrentLMConfig, RecurrentLMForCausalLM)
