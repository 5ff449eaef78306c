"""Records -> (prompt, answer) text: the field mapping, the instruction layouts users bring, the template
and the tokenizer's chat template. Train, eval, infer (and serve) all build prompts here, so a model
sees the same format in every task.

Fields. `data.fields.input` names the prompt field (dotted for nested records: `seed.instruction`), or
is a format string over fields (`"{instruction}\\n\\n{input}"`); `data.fields.output` names the answer.
`auto` recognises the common layouts and says which it chose:

    messages      {"messages": [{"role", "content"}, ...]} (OpenAI) or {"conversations": [{"from", "value"}]}
                  (ShareGPT): the conversation up to the last assistant turn is the prompt, that turn the answer
    alpaca        instruction (+ input when not empty) -> output
    dolly         instruction (+ context) -> response
    pairs         prompt/completion, prompt/response, question/answer, query/response, input/output, ...
    text          {"text": ...}, alone or beside metadata (url, meta, id, ... or values never text): plain text

Template. `data.template` is a format string over every field of the record by its own name, plus
`{prompt}` (the mapped prompt); `{input}` is the record's own `input` field, or the prompt when the record
has none. A `\\n` or `\\t` typed on a command line (where it stays a backslash and a letter) is a newline
or a tab.

Chat template. When the tokenizer has one (instruction and chat models ship one; `data.chat_template:
auto`), the templated prompt is the user's message and the chat template wraps it; with `false` the
model gets the templated prompt alone. Plain text never goes through it, nor does a prompt or a conversation for a
model that learned plain text (the checkpoint's prompt_layout `text`: BOS, then the prompt, as training began every
text; a conversation as `role: content` lines). Without a chat template, chat messages are `role: content`
lines; a model that learned them (the checkpoint's prompt_layout) gets a typed prompt as the user's line the same
way.
"""

from __future__ import annotations

import logging
import string
from dataclasses import dataclass
from typing import Any

from onn.config.data import TextData, TextFields
from onn.errors import UserError
from onn.modalities.text.formats import Records, is_missing

log = logging.getLogger("onn")

# (prompt, answer) field pairs, most specific first: the first pair a dataset has is its layout
PAIRS = (("prompt", "completion"), ("prompt", "response"), ("prompt", "answer"), ("prompt", "output"),
         ("question", "answer"), ("query", "response"), ("query", "answer"), ("instruction", "response"),
         ("instruction", "output"), ("input", "output"), ("input", "target"), ("source", "target"))  # fmt: skip
# fields that pair with a `text` (a label, a summary, a pair's prompt or answer) rather than describe it (C4's url,
# the Pile's meta, Wikipedia's title): text beside one of these asks for data.fields (Dolma's `source` describes)
PAIRED = ({name for pair in PAIRS for name in pair} - {"source"}) | {"label", "labels", "summary", "translation",
          "highlights", "class", "category", "sentiment"}  # fmt: skip
INSTRUCTION_LAYOUTS = {"alpaca": ("output", "input"), "dolly": ("response", "context")}  # (answer, its input)
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "bot": "assistant",
         "model": "assistant", "system": "system", "tool": "tool"}  # fmt: skip
EMPTY_REFUSED = 0.5  # a mapped prompt empty in more than this share of records is a wrong mapping
EMPTY_WARNED = 0.05
ANSWER_SENTINEL = "ONNANSWER7f3a"  # an assistant's content that no template trims or rewrites


@dataclass
class Layout:
    """How a dataset's records become prompt and answer: what auto chose, or what data.fields says."""

    name: str  # alpaca | dolly | messages | pairs | text | fields (the user's mapping)
    prompt: str | None  # a field name (dotted) or a format string over fields; None for messages and text
    answer: str | None  # a field name; None for messages and text
    conversation: str | None = None  # messages | conversations

    def describe(self) -> str:
        if self.name == "text":
            return "plain text (the text field): loss on every token"
        if self.name == "messages":
            return f"chat messages ({self.conversation}): the conversation up to the last assistant turn -> that turn"
        return f"{self.prompt} -> {self.answer}"


def choose_layout(records: Records, fields: TextFields, key: str = "data.source") -> Layout:
    """data.fields as given, or for `auto` the layout the records' fields match."""
    prompt, answer = fields.input, fields.output
    names = set().union(*(r.keys() for r in records[:200]))
    if names == {"text"}:  # plain text, whatever data.fields maps (another file's prompt and answer)
        return Layout("text", None, None)
    if prompt != "auto" and answer != "auto":
        return Layout("fields", prompt, answer)
    if prompt == "auto" and answer == "auto":
        for conversation in ("messages", "conversations"):
            if conversation in names and all(isinstance(r.get(conversation), list) for r in records[:200]):
                return Layout("messages", None, None, conversation)
    if prompt == "auto":
        if instruction := _instruction_layout(names, answer):
            return instruction
        if answer == "auto":
            found = next(((p, a) for p, a in PAIRS if {p, a} <= names), None)
        else:
            found = next(((p, answer) for p, a in PAIRS if p in names and p != answer), None)
    else:
        used = format_fields(prompt, "data.fields.input") if "{" in prompt else {prompt}
        found = next(((prompt, a) for p, a in PAIRS if a in names and a not in used), None)
    if found is None and prompt == answer == "auto" and "text" in names and describes_text(names - {"text"}):
        return Layout("text", None, None)  # a corpus's text beside its metadata (C4's url, the Pile's meta)
    if found is None:
        raise UserError(
            f"{key}: its records have the fields {sorted(names)[:12]}, which are no prompt/answer layout ONN knows; "
            "say which field is which with data.fields.input=NAME data.fields.output=NAME."
        )
    return Layout("pairs" if prompt == answer == "auto" else "fields", *found)


def describes_text(names: set[str]) -> bool:
    """Whether the fields beside a corpus's `text` describe it (C4's url and timestamp, the Pile's meta, FineWeb's
    id and dump, Wikipedia's title) rather than pair with it: a label, a summary or a pair's prompt or answer beside
    `text` is something to map with data.fields, not metadata to leave out."""
    return not names & PAIRED


def format_fields(spec: str, key: str) -> set[str]:
    """The fields a format string names; a malformed one (`{instruction: {input}`) is one sentence naming `key`."""
    try:
        return {f for _, f, _, _ in string.Formatter().parse(spec) if f}
    except ValueError as e:
        raise UserError(not_a_format(key, spec, e)) from None


def not_a_format(key: str, spec: str, error: Exception) -> str:
    return f"{key} {spec!r} is not a format string: {error} (write {{{{ and }}}} for braces)."


def _instruction_layout(names: set[str], answer: str) -> Layout | None:
    """Alpaca's or Dolly's layout where the records have its fields and data.fields.output is auto or names its
    answer: their prompt is the instruction with its input (context), which a pair of fields would drop. The input
    is in the prompt whether or not the records looked at have one (a streamed file's first 200 may all leave it
    out): where a record has none, the prompt is its instruction (Prompter._prompt)."""
    for name, (output, extra) in INSTRUCTION_LAYOUTS.items():
        if {"instruction", output} <= names and answer in ("auto", output):
            return Layout(name, f"{{instruction}}\n\n{{{extra}}}", output)
    return None


@dataclass
class Split:
    """One set of (prompt, answer) examples and where each came from, for `answered`."""

    examples: list[tuple[str, str]]
    where: list[str]
    key: str  # the setting that names the file: data.source | data.val_source
    file: str
    purpose: str  # training | validation


def has_answer(answer: str) -> bool:
    """Whether an answer holds text: an empty one (a blank CSV cell, "" in JSON) trains on the end-of-sequence token
    alone. The one test for resident splits, streamed records (ShuffledStream's keep) and bench_giant's prompts."""
    return bool(answer.strip())


def no_answer(key: str, file: str, count: int, purpose: str) -> UserError:
    """The error for a file none of whose records (of `purpose`) has an answer."""
    return UserError(
        f"{key} {file}: all {count} of its {purpose} records have an empty answer, which would train on the "
        "end-of-sequence token alone; fill the answers in, or map the answer field with data.fields.output=NAME."
    )


def say_left_out(key: str, file: str, places: list[str], count: int, total: int) -> None:
    """The one warning per file for its `count` records of `total` left out for an empty answer, naming the first
    `places` (at most three shown)."""
    if not count:
        return
    shown = "; ".join(places[:3]) + (f"; and {count - 3} more" if count > 3 else "")
    log.warning(
        "data: %s %s: left out %d of %d records whose answer is empty (each would train on the end-of-sequence "
        "token alone): %s",
        key,
        file,
        count,
        total,
        shown,
    )


def answered(splits: list[Split]) -> list[tuple[list[tuple[str, str]], list[str]]]:
    """Each split's examples whose answer holds text (`has_answer`), and their places; the rest are said in one
    warning per file, as unreadable files are (data/labelled.check_bad). A split left with none is a UserError. A
    null answer is refused record by record (Prompter._text): null says the field is missing, "" is data a dump
    holds."""
    kept, skipped, totals = [], {}, {}
    for split in splits:
        keep = [has_answer(answer) for _, answer in split.examples]
        if split.examples and not any(keep):
            raise no_answer(split.key, split.file, len(keep), split.purpose)
        kept.append(([e for e, k in zip(split.examples, keep) if k], [w for w, k in zip(split.where, keep) if k]))
        file = (split.key, split.file)
        skipped.setdefault(file, []).extend(w for w, k in zip(split.where, keep) if not k)
        totals[file] = totals.get(file, 0) + len(keep)
    for (key, file), places in skipped.items():
        say_left_out(key, file, places, len(places), totals[key, file])
    return kept


class _Fields(string.Formatter):
    """str.format over a record whose dotted names reach into nested records (`{seed.instruction}`)."""

    def get_field(self, field_name: str, args, kwargs):
        return resolve(kwargs, field_name), field_name


FORMATTER = _Fields()


def resolve(record: dict[str, Any], name: str) -> Any:
    """record[name], where `a.b` is record["a"]["b"] (and `a.0` an item of a list); KeyError when absent."""
    if name in record:
        return record[name]
    value: Any = record
    for part in name.split("."):
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            raise KeyError(name)
    return value


def unescape(template: str) -> str:
    """`\\n` and `\\t` as typed on a command line (Hydra keeps them as two characters) -> newline, tab."""
    return template.replace("\\n", "\n").replace("\\t", "\t")


def chat_in_use(data_cfg: TextData, tokenizer) -> bool:
    """Whether prompts go through the tokenizer's chat template (data.chat_template: auto | true | false)."""
    setting = data_cfg.chat_template
    has = bool(getattr(tokenizer, "chat_template", None))
    if setting is True and not has:
        raise UserError(
            "data.chat_template=true, but the model's tokenizer has no chat template; "
            "use data.chat_template=auto (or false) or a tokenizer that has one."
        )
    if setting not in ("auto", True, False):
        raise UserError(f"data.chat_template={setting!r} is not one of auto, true, false.")
    return has and setting in ("auto", True)


def turn_end(tokenizer) -> str:
    """What the tokenizer's chat template writes after an assistant's message (Gemma's "<end_of_turn>\\n", Llama 3's
    "<|eot_id|>", ChatML's "<|im_end|>\\n"), found by rendering a conversation whose answer is a sentinel: "" without a
    chat template, or where it writes nothing there."""
    if not getattr(tokenizer, "chat_template", None):
        return ""
    from jinja2 import TemplateError  # what apply_chat_template needs anyway; ONN runs without it otherwise

    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ANSWER_SENTINEL}]
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False)
    except TemplateError:  # a template that refuses a plain user/assistant pair: nothing to learn from it
        return ""
    at = text.rfind(ANSWER_SENTINEL)
    return text[at + len(ANSWER_SENTINEL) :] if at >= 0 else ""


def turn_end_ids(tokenizer) -> list[int]:
    """The tokens of `turn_end` where its first is a special token (the one generation stops at); [] where the
    template ends a turn in plain text (ChatML on a byte tokenizer spells "<|im_end|>" in bytes) or not at all."""
    end = turn_end(tokenizer)
    ids = tokenizer(end, add_special_tokens=False)["input_ids"] if end else []
    return ids if ids and ids[0] in special_ids(tokenizer) else []


def special_ids(tokenizer) -> set[int]:
    """The named special tokens (bos, eos, pad, ...) and every added token marked special (<end_of_turn>, <|eot_id|>:
    Llama 3 names neither among its special tokens)."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return set(tokenizer.all_special_ids) | {i for i, t in added.items() if t.special}


class Prompter:
    """Turns records (or a typed prompt) into the text the model sees, the same way in every task."""

    def __init__(self, data_cfg: TextData, tokenizer, trained_layout: str | None = None):
        """`trained_layout`: the layout the model was trained on (a checkpoint's prompt_layout), for prompts typed
        at infer and serve, which come without records to choose one from."""
        self.cfg, self.tokenizer = data_cfg, tokenizer
        self.template = unescape(data_cfg.template or "{prompt}")  # an empty template: the prompt alone
        self.chat = chat_in_use(data_cfg, tokenizer)
        self.layouts: dict[str, Layout] = {}  # each file's own (data.source, data.val_source): they may differ
        self.layout: Layout | None = None  # the first chosen: the training data's
        self.trained_layout = trained_layout
        self._turn_end: list[int] | None = None  # answer_end's tokens, found once

    @property
    def layout_name(self) -> str | None:
        """The layout the model learns or learned its prompts in: the checkpoint's, else the training data's."""
        return self.trained_layout or (self.layout.name if self.layout else None)

    @property
    def plain(self) -> bool:
        """Whether the model learned plain text (BOS, then the text: datamodule.encode): a typed prompt is the start
        of a text to continue, never a chat template's user turn."""
        return self.layout_name == "text"

    @property
    def chat_templated(self) -> bool:
        """Whether conversations go through the tokenizer's chat template: a model that learned plain text gets
        `role: content` lines instead, as its prompts never went through it (and its BOS is added once, by us)."""
        return self.chat and not self.plain

    @property
    def conversational(self) -> bool:
        """Whether a prompt is a user's turn of a conversation: by the chat template, or as `role: content` lines
        where the model learned chat messages without one."""
        return not self.plain and (self.chat or self.layout_name == "messages")

    @property
    def prompt_format(self) -> str:
        """What wraps prompts, for metrics.json and the log."""
        if self.plain:
            return "data.template (plain text: no chat template)"
        if self.chat:
            return "chat template"
        return "role lines (chat messages without a chat template)" if self.conversational else "data.template"

    @property
    def add_special_tokens(self) -> bool:
        """A chat template writes the special tokens the model needs itself (BOS included, where it has one)."""
        return self.plain or not self.chat

    @property
    def answer_end(self) -> list[int]:
        """The tokens that end every training answer where prompts go through the chat template: what it writes
        after an assistant's turn (Gemma's <end_of_turn> and newline, not <eos>), as TRL's SFT trains a chat model
        and as generation stops (generate.end_ids); [] elsewhere, and where the template writes no special token
        there: the tokenizer's EOS (datamodule.encode)."""
        if not self.chat or self.plain:
            return []
        if self._turn_end is None:
            self._turn_end = turn_end_ids(self.tokenizer)
        return self._turn_end

    @property
    def starts_with_bos(self) -> bool:
        """A typed prompt for a model that learned plain text starts with BOS, as training started every text
        (datamodule.encode): the tokenizer's own special tokens may hold none (GPT-2's and SmolLM2's do not)."""
        return self.plain

    def examples(self, records: Records, key: str = "data.source", check: bool = True) -> list[tuple[str, str]]:
        """(prompt, answer) per record, by the layout of the file `key` names (a plain-text training file may
        come with question/answer validation records); plain text records give ("", text): loss on every token.
        `check`: refuse mostly empty prompts; off for a slice of a file already checked (a few held-out records
        of a file with 10% empty prompts read as 100% under one seed)."""
        layout = self.layouts.get(key)
        if layout is None:
            layout = self.layouts[key] = choose_layout(records, self.cfg.fields, key)
            self.layout = self.layout or layout
            how = "chosen by data.fields" if layout.name == "fields" else f"the {layout.name} layout, recognised"
            log.info(
                "data: %s: prompt and answer are %s (%s); prompts go through the %s",
                key,
                layout.describe(),
                how,
                self.prompt_format,
            )
        out, empty = [], 0
        for record, where in zip(records, records.where):
            pair, blank = self._example(record, where, layout)
            out.append(pair)
            empty += blank
        if check:
            self._check_empty(records, empty, key, layout)
        return out

    def example(self, record: dict[str, Any], where: str) -> tuple[str, str]:
        """One training record's (prompt, answer), once `examples` has chosen the layout (streamed data: record
        by record)."""
        return self._example(record, where, self.layout)[0]

    def answer(self, record: dict[str, Any], where: str) -> str:
        """One training record's answer alone, its prompt not rendered (a chat template per record): what deciding
        whether a streamed record is trained on needs, which every loader worker asks of every record."""
        layout = self.layout
        if layout.name == "text" or (layout.name != "messages" and set(record) == {"text"}):
            return self._text(record, "text", where, "data.fields.input")
        if layout.name == "messages":
            return self._messages(record, where, layout.conversation)[-1]["content"]
        return self._text(record, layout.answer, where, "data.fields.output")

    def _example(self, record: dict[str, Any], where: str, layout: Layout) -> tuple[tuple[str, str], bool]:
        """((prompt, answer), whether the mapped prompt is empty)."""
        if layout.name == "text" or (layout.name != "messages" and set(record) == {"text"}):
            return ("", self._text(record, "text", where, "data.fields.input")), False
        if layout.name == "messages":
            messages = self._messages(record, where, layout.conversation)
            return (self._conversation_prompt(messages[:-1], where), messages[-1]["content"]), False
        prompt = self._prompt(record, where, layout)
        answer = self._text(record, layout.answer, where, "data.fields.output")
        return (self.render(prompt, record, where), answer), not prompt.strip()

    def render(self, prompt: str, record: dict[str, Any] | None = None, where: str = "the prompt") -> str:
        """The text the model sees for a prompt: data.template around it, then the user's turn of a conversation
        (the chat template, or role lines for a model trained on chat messages without one)."""
        fields = {k: ("" if is_missing(v) else v) for k, v in (record or {}).items()}
        fields["prompt"] = prompt
        fields.setdefault("input", prompt)
        try:
            text = FORMATTER.vformat(self.template, (), fields)
        except KeyError as e:
            raise UserError(
                f"data.template names the field {{{e.args[0]}}}, which {where} does not have; "
                f"its fields are {sorted(fields)[:12]} ({{prompt}} is the mapped prompt)."
            ) from None
        except (ValueError, IndexError) as e:
            raise UserError(not_a_format("data.template", self.template, e)) from None
        if self.conversational:
            return self.render_messages([{"role": "user", "content": text}])
        return text

    def row_prompt(self, row: dict[str, Any], where: str) -> str | None:
        """An infer prompts file row's prompt as training built a record's of the model's layout: Alpaca's instruction
        with its input (Dolly's context), which the row's first prompt field alone drops; None for other layouts (the
        row's prompt field is its prompt)."""
        name = self.layout_name
        if name not in INSTRUCTION_LAYOUTS or "instruction" not in row:
            return None
        answer, extra = INSTRUCTION_LAYOUTS[name]
        return self._prompt(row, where, Layout(name, f"{{instruction}}\n\n{{{extra}}}", answer))

    def render_messages(self, messages: list[dict[str, str]]) -> str:
        """A conversation, ready for the assistant's turn: by the chat template (chat_templated), or one
        `role: content` line each."""
        if self.chat_templated:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "

    def _conversation_prompt(self, messages: list[dict[str, str]], where: str) -> str:
        """A record's conversation rendered for its answer; a chat template's own refusal (Gemma's takes no system
        message, and its roles must alternate) is one sentence naming the record, not a Jinja traceback."""
        if not self.chat_templated:
            return self.render_messages(messages)
        from jinja2 import TemplateError  # what apply_chat_template needs anyway; ONN runs without it otherwise

        try:
            return self.render_messages(messages)
        except TemplateError as e:
            raise UserError(
                f"{where}: the tokenizer's chat template refuses its conversation ({e}); rewrite the record as the "
                "template needs (a system message merged into the first user message, roles that alternate), "
                "or set data.chat_template=false."
            ) from None

    def _prompt(self, record: dict[str, Any], where: str, layout: Layout) -> str:
        spec = layout.prompt
        if "{" not in spec:
            return self._text(record, spec, where, "data.fields.input")
        values = {k: ("" if is_missing(v) else v) for k, v in record.items()}  # a null optional part (Alpaca's input)
        if layout.name in INSTRUCTION_LAYOUTS:  # Alpaca's input (Dolly's context) left out of a record: empty too
            values.setdefault(INSTRUCTION_LAYOUTS[layout.name][1], "")
        try:
            return FORMATTER.vformat(unescape(spec), (), values).strip()
        except KeyError as e:
            raise UserError(
                f"{where} has no field '{e.args[0]}' (named in the prompt {spec!r}); "
                f"its fields are {sorted(record)[:12]}."
            ) from None
        except (ValueError, IndexError) as e:  # `{instruction: {input}`, or a positional `{0}`
            raise UserError(not_a_format("data.fields.input", spec, e)) from None

    def _text(self, record: dict[str, Any], name: str, where: str, key: str) -> str:
        try:
            value = resolve(record, name)
        except KeyError:
            raise UserError(
                f"{where} has no field '{name}' ({key}); its fields are {sorted(record)[:12]}. "
                f"Map yours with {key}=NAME (nested: {key}=outer.inner)."
            ) from None
        if is_missing(value):
            raise UserError(f"{where}: '{name}' ({key}) is null; fill it in or remove the record.")
        if isinstance(value, dict | list):
            raise UserError(
                f"{where}: '{name}' ({key}) is a JSON {'object' if isinstance(value, dict) else 'list'}, not text; "
                f"map a text field (nested: {key}={name}.FIELD)."
            )
        return str(value)

    def _messages(self, record: dict[str, Any], where: str, conversation: str) -> list[dict[str, str]]:
        raw = record.get(conversation)
        if not isinstance(raw, list) or not raw:
            raise UserError(f"{where}: '{conversation}' is not a list of messages.")
        messages = []
        for i, m in enumerate(raw):
            role = m.get("role", m.get("from")) if isinstance(m, dict) else None
            content = m.get("content", m.get("value")) if isinstance(m, dict) else None
            if role not in ROLES or not isinstance(content, str):
                raise UserError(
                    f"{where}: message {i} of '{conversation}' needs a role (user, assistant, system) "
                    "and text content (OpenAI's role/content or ShareGPT's from/value)."
                )
            messages.append({"role": ROLES[role], "content": content})
        if messages[-1]["role"] != "assistant" or len(messages) < 2:
            raise UserError(f"{where}: the conversation must end with an assistant message (the answer to learn).")
        return messages

    def _check_empty(self, records: Records, empty: int, key: str, layout: Layout) -> None:
        """A mapping whose prompts are mostly empty maps the wrong field (Alpaca's `input` is empty in 61% of rows)."""
        share = empty / max(1, len(records))
        if share <= EMPTY_WARNED:
            return
        field = layout.prompt
        names = set().union(*(r.keys() for r in records[:200]))
        others = sorted(
            n
            for n in names
            if n not in (field, layout.answer)
            and any(isinstance(r.get(n), str) and r.get(n).strip() for r in records[:200])
        )
        said = (
            f"the prompt ({field}) is empty in {share:.0%} of {key}'s records ({empty} of {len(records)}); "
            f"its other text fields are {others or 'none'}"
        )
        if share > EMPTY_REFUSED:
            raise UserError(
                f"{said}: map the prompt with data.fields.input=NAME (or a template such as "
                f"data.fields.input='{{{others[0] if others else 'instruction'}}}\\n\\n{{{field}}}')."
            )
        log.warning("data: %s.", said)
