"""Make a small "pretrained" Hugging Face model offline: a BPE tokenizer and a model, saved.

    python scripts/make_pretrained.py --family llama --out runs/pretrained/llama
        [--vocab 2048] [--hidden 64] [--layers 4] [--heads 4] [--kv-heads 2]
        [--intermediate 176] [--steps 100] [--seq-len 64] [--batch 8] [--seed 0] [--chat]

Nothing is downloaded. The text is the embedded corpus (`hybridpar.train.default_corpus`: the
standard library's sources), one document per source file:

    1. tokenizer  a byte-level BPE of `vocab` ids trained by `tokenizers` on the corpus, with
                  one special token, <|endoftext|> (id 0): the end of document (EOS), also
                  the BOS and the padding token; wrapped as transformers' fast tokenizer
    2. model      the family's causal LM (llama, gpt2, qwen2, mistral; mixtral, qwen3_moe with
                  4 experts of top-2) from a small config,
                  vocab_size = the tokenizer's, random-init from `seed`
    3. pretrain   `steps` AdamW steps of next-token loss on the corpus's tokens (documents
                  joined by the EOS, windows of seq_len + 1), so the weights are not pure
                  noise; 0 skips it (seconds on a CPU for the defaults)
       --chat     two more special tokens, <|im_start|> and <|im_end|> (ids 1, 2), and a
                  ChatML chat template: <|im_end|> ends a turn and is the tokenizer's and
                  the generation config's EOS, so generate() stops at the end of a turn
                  (a model for `hybridpar tokenize --chat`: configs/sft_llama.toml)
    4. save       model.save_pretrained + tokenizer.save_pretrained into `out`: config.json,
                  generation_config.json, model.safetensors, tokenizer.json,
                  tokenizer_config.json; `AutoModelForCausalLM.from_pretrained(out)` and
                  `AutoTokenizer.from_pretrained(out)` load them

The same arguments give the same files (tokenizer and weights: one thread, seeded). `out` must
not hold a model already unless --overwrite. Then fine-tune it: configs/finetune_llama.toml.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

EOS = "<|endoftext|>"
TURN_START, TURN_END = "<|im_start|>", "<|im_end|>"     # --chat
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
          "{{ message['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
FAMILIES = ("llama", "gpt2", "qwen2", "mistral", "mixtral", "qwen3_moe")


def documents(corpus: bytes) -> list[str]:
    """The embedded corpus cut into its source files (each begins with ``# file: PATH``)."""
    text = corpus.decode("utf-8", errors="replace")
    parts = re.split(r"(?m)^(?=# file: )", text)
    return [p for p in parts if p.strip()]


def train_tokenizer(docs: list[str], vocab: int, specials: tuple[str, ...] = (EOS,)) -> Any:
    """A byte-level BPE of `vocab` ids (the special tokens first: EOS = id 0) trained on
    `docs`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=list(specials),
                                  show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer=trainer)
    return tok


def model_config(family: str, vocab: int, eos_id: int, args: argparse.Namespace,
                 end_id: int | None = None) -> Any:
    """The family's `PretrainedConfig`: small, `vocab` ids, the EOS as bos / eos / pad (the
    end of a turn as eos with --chat)."""
    import transformers

    special = {"bos_token_id": eos_id, "eos_token_id": eos_id if end_id is None else end_id,
               "pad_token_id": eos_id}
    if family == "gpt2":
        return transformers.GPT2Config(
            vocab_size=vocab, n_embd=args.hidden, n_layer=args.layers, n_head=args.heads,
            n_inner=args.intermediate, n_positions=max(256, 4 * args.seq_len),
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **special)
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
           "mistral": transformers.MistralConfig, "mixtral": transformers.MixtralConfig,
           "qwen3_moe": transformers.Qwen3MoeConfig}[family]
    extra: dict[str, Any] = {"sliding_window": None} if family in ("mistral", "mixtral") \
        else {}
    if family in ("mixtral", "qwen3_moe"):   # 4 experts of top-2, the load-balancing loss on
        extra.update(num_local_experts=4, num_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=args.intermediate, output_router_logits=True,
                     router_aux_loss_coef=0.01)
    return cls(vocab_size=vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
               num_hidden_layers=args.layers, num_attention_heads=args.heads,
               num_key_value_heads=args.kv_heads,
               max_position_embeddings=max(256, 4 * args.seq_len),
               tie_word_embeddings=False, **extra, **special)


def pretrain(model: Any, ids: Any, *, steps: int, seq_len: int, batch: int, lr: float,
             seed: int) -> list[float]:
    """`steps` AdamW steps on random windows of `ids` (a 1-D int64 tensor); the losses."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    model.train()
    for _ in range(steps):
        start = torch.randint(0, len(ids) - seq_len - 1, (batch,), generator=gen)
        window = torch.stack([ids[s:s + seq_len + 1] for s in start.tolist()])   # (B, T + 1)
        logits = model(input_ids=window[:, :-1]).logits                          # (B, T, V)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.eval()
    return losses


def make(args: argparse.Namespace) -> Path:
    import torch
    import transformers

    from hybridpar.train.data import default_corpus

    out = Path(args.out)
    if out.exists() and not args.overwrite:
        raise SystemExit(f"{out} exists; give a new folder, or --overwrite to replace it")
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)                     # the same sums in the same order: same weights
    started = time.perf_counter()

    docs = documents(default_corpus(args.corpus_bytes))
    tok = train_tokenizer(docs, args.vocab, (EOS, TURN_START, TURN_END) if args.chat else (EOS,))
    eos_id = tok.token_to_id(EOS)
    vocab = tok.get_vocab_size()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=TURN_END if args.chat else EOS, bos_token=EOS,
        pad_token=EOS, unk_token=None)
    if args.chat:
        fast.chat_template = CHATML

    config = model_config(args.family, vocab, eos_id, args,
                          tok.token_to_id(TURN_END) if args.chat else None)
    model = transformers.AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in model.parameters())
    losses: list[float] = []
    if args.steps > 0:
        encoded = tok.encode_batch_fast(docs, add_special_tokens=False)
        flat = [i for e in encoded for i in (*e.ids, eos_id)]
        ids = torch.tensor(flat, dtype=torch.int64)
        losses = pretrain(model, ids, steps=args.steps, seq_len=args.seq_len, batch=args.batch,
                          lr=args.lr, seed=args.seed)

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    model.save_pretrained(out)
    fast.save_pretrained(out)
    trained = (f", pretrained {len(losses)} steps: loss {losses[0]:.3f} -> {losses[-1]:.3f}"
               if losses else ", random weights (--steps 0)")
    print(f"wrote {out}: {args.family}, {params:,} parameters, a BPE of {vocab} ids "
          f"(EOS {EOS!r} = {eos_id}) on {len(docs)} documents{trained} "
          f"({time.perf_counter() - started:.1f} s)")
    return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--family", choices=FAMILIES, default="llama")
    p.add_argument("--out", required=True, help="the folder to write (save_pretrained)")
    p.add_argument("--vocab", type=int, default=2048, help="BPE vocabulary size (ids)")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads (not gpt2)")
    p.add_argument("--intermediate", type=int, default=176, help="the MLP's width")
    p.add_argument("--corpus-bytes", type=int, default=1_000_000,
                   help="bytes of the embedded corpus to train the tokenizer (and model) on")
    p.add_argument("--steps", type=int, default=100, help="pretraining steps; 0: random weights")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat", action="store_true",
                   help="add <|im_start|> / <|im_end|> and a ChatML chat template")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    return p.parse_args(argv)


if __name__ == "__main__":
    make(parse(sys.argv[1:]))
