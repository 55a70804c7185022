"""Conversations to token ids and a loss mask, rendered with the model's own chat template.

The template is the model folder's (`tokenizer_config.json`'s `chat_template`, or its
`chat_template.jinja`), or a file (`--chat-template`); transformers renders it as
`apply_chat_template` does. The mask says which tokens the loss counts (`MASKS`):

    rule        counted
    assistant   every assistant turn: what it adds to the conversation, end of turn included
    last        the last assistant turn only
    all         every token

Most templates on the Hub carry no ``{% generation %}`` markers, so an assistant turn's
text is found by rendering prefixes of the conversation (turn i an assistant's):

    before_i = render(messages[:i], add_generation_prompt=True)   # ... <|im_start|>assistant\\n
    upto_i   = render(messages[:i + 1])                           # ... Hello!<|im_end|>\\n
    turn i   = the characters [len(before_i), len(upto_i)) of render(messages)

which needs each render to be a prefix of the next (a template that rewrites earlier turns
once later ones follow, e.g. dropping their reasoning, is refused with the reason). The
rendered text is encoded as `apply_chat_template(tokenize=True)` encodes it (no special
tokens added), and a token counts when its characters overlap a counted turn: the tokens
`return_assistant_tokens_mask` marks for a template whose markers enclose exactly that text.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hybridpar.data.conversations import Conversation
from hybridpar.data.sources import CorpusError
from hybridpar.data.tokenizer import TokenizerSpec

__all__ = ["MASKS", "NO_ASSISTANT", "ChatEncoder", "ChatSpec", "assistant_spans", "load_chat"]

MASKS = ("assistant", "last", "all")
NO_ASSISTANT = ("skip", "error")        # a conversation with no counted token


@dataclass(frozen=True)
class ChatSpec:
    """A chat template and the mask rule, as plain data (a worker process rebuilds from it)."""

    template: str
    source: str                 # where the template came from, for the log and meta.json
    mask: str = "assistant"
    no_assistant: str = "skip"
    special: dict[str, Any] = field(default_factory=dict)   # bos_token, eos_token, ...

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.template.encode("utf-8")).hexdigest()

    def record(self) -> dict[str, Any]:
        """meta.json's `chat` entry and the request's: everything that changes the tokens."""
        return {"template_sha256": self.sha256, "mask": self.mask,
                "no_assistant": self.no_assistant,
                "special": dict(sorted(self.special.items()))}


def _hf_tokenizer(name: str) -> Any:
    """transformers' tokenizer of a model folder, or a bare one around a tokenizer.json."""
    try:
        from transformers import AutoTokenizer, PreTrainedTokenizerFast
    except ImportError:
        raise CorpusError("rendering conversations needs transformers' chat templates; pip "
                          "install 'hybridpar[hf]'") from None
    if Path(name).is_dir():
        try:
            return AutoTokenizer.from_pretrained(name, local_files_only=True)
        except Exception as e:   # transformers raises many kinds for a bad folder
            raise CorpusError(f"tokenizer {name!r}: transformers cannot load the folder "
                              f"({type(e).__name__}: {e})") from None
    return PreTrainedTokenizerFast(tokenizer_file=name)


def load_chat(tokenizer: str | os.PathLike[str], *, template: str | os.PathLike[str] | None
              = None, mask: str = "assistant", no_assistant: str = "skip") -> ChatSpec:
    """The chat template of `tokenizer` (a model folder or a tokenizer.json), or the file
    `template`, with its special tokens; an error naming the fix when there is none."""
    name = os.fspath(tokenizer)
    if mask not in MASKS:
        raise CorpusError(f"--loss-mask {mask!r}: choose one of {', '.join(MASKS)}")
    if no_assistant not in NO_ASSISTANT:
        raise CorpusError(f"--no-assistant {no_assistant!r}: choose one of "
                          f"{', '.join(NO_ASSISTANT)}")
    if name == "bytes":
        raise CorpusError("conversations need a model's tokenizer and chat template; give "
                          "--tokenizer MODEL_FOLDER (or a tokenizer.json and --chat-template "
                          "FILE)")
    hf = _hf_tokenizer(name)
    special = {k: str(v) for k, v in hf.special_tokens_map.items() if isinstance(v, str)}
    if template is not None:
        path = Path(template)
        if not path.is_file():
            raise CorpusError(f"--chat-template {path}: no such file")
        return ChatSpec(path.read_text(encoding="utf-8"), str(path), mask, no_assistant,
                        special)
    found = hf.chat_template
    if isinstance(found, dict):          # named templates: the default one
        found = found.get("default")
    if not isinstance(found, str) or not found:
        raise CorpusError(f"tokenizer {name!r} has no chat template (tokenizer_config.json's "
                          "chat_template, or chat_template.jinja); give one with "
                          "--chat-template FILE")
    return ChatSpec(found, f"{name} (its chat template)", mask, no_assistant, special)


def assistant_spans(render: Any, messages: Sequence[dict[str, Any]], where: str
                    ) -> tuple[str, list[tuple[int, int]]]:
    """(the conversation's text, the character span of each assistant turn): the module's
    prefix rule. `render(messages, add_generation_prompt)` renders the template."""
    text = render(messages, False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, upto = render(messages[:i], True), render(messages[:i + 1], False)
        if not (upto.startswith(before) and text.startswith(upto)):
            raise CorpusError(f"{where}: the chat template renders the conversation up to "
                              f"message {i} differently once more messages follow (it rewrites "
                              "earlier turns), so assistant turn "
                              f"{i} cannot be found in the text; use --loss-mask all, or a "
                              "template that renders each turn the same (--chat-template)")
        spans.append((len(before), len(upto)))
    return text, spans


class ChatEncoder:
    """Conversations to (ids, lengths, mask, dropped): `Encoder.encode` plus the loss mask."""

    def __init__(self, spec: TokenizerSpec, chat: ChatSpec) -> None:
        from tokenizers import Tokenizer
        from transformers import PreTrainedTokenizerFast

        self.spec, self.chat, self.dtype = spec, chat, np.dtype(spec.dtype)
        self._tok = Tokenizer.from_str(spec.json)
        self._hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(spec.json),
                                           **chat.special)

    def _render(self, messages: Sequence[dict[str, Any]], prompt: bool) -> str:
        return str(self._hf.apply_chat_template(list(messages), chat_template=self.chat.template,
                                                tokenize=False, add_generation_prompt=prompt))

    def encode_one(self, item: Conversation) -> tuple[list[int], list[int]]:
        """(ids, mask) of one conversation, an EOS after it unless it ends with one."""
        spans: list[tuple[int, int]]
        try:
            if self.chat.mask == "all":         # no turn to find: the text as it renders
                text, spans = self._render(item.messages, False), []
            else:
                text, spans = assistant_spans(self._render, item.messages, item.where)
        except CorpusError:
            raise
        except Exception as e:   # jinja's TemplateError, the template's raise_exception
            raise CorpusError(f"{item.where}: the chat template fails to render this "
                              f"conversation ({type(e).__name__}: {e})") from None
        if self.chat.mask == "last":
            spans = spans[-1:]
        encoding = self._tok.encode(text, add_special_tokens=False)
        ids = list(encoding.ids)
        if self.chat.mask == "all":
            mask = [1] * len(ids)
        else:
            mask = [int(any(s < b and max(e, s + 1) > a for a, b in spans))
                    for s, e in encoding.offsets]
        if not ids or ids[-1] != self.spec.eos_id:
            ids.append(self.spec.eos_id)
            mask.append(int(self.chat.mask == "all"))
        return ids, mask

    def encode(self, batch: Sequence[Conversation]
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """(ids, lengths, mask, dropped): the kept conversations' ids and uint8 mask, each
        ``(sum(lengths),)``, and how many had no counted token (skipped, or an error)."""
        ids: list[int] = []
        mask: list[int] = []
        lengths: list[int] = []
        dropped = 0
        for item in batch:
            one, counted = self.encode_one(item)
            if not any(counted):
                if self.chat.no_assistant == "error":
                    raise CorpusError(f"{item.where}: the conversation has no assistant token "
                                      f"to learn from (--loss-mask {self.chat.mask}); drop it, "
                                      "or --no-assistant skip to skip such conversations")
                dropped += 1
                continue
            ids += one
            mask += counted
            lengths.append(len(one))
        return (np.asarray(ids, dtype=self.dtype), np.asarray(lengths, dtype=np.int64),
                np.asarray(mask, dtype=np.uint8), dropped)
