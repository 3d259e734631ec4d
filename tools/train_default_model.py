"""Train the project's default model from scratch on text that ships with Python.

Owns the whole recipe: corpus (tools/build_corpus.py), byte-level BPE tokenizer with a
chat template, a small Llama (transformers' LlamaForCausalLM) trained with a plain torch
loop, held-out perplexity, and saving in the Hugging Face layout (float16 on disk).
Seeded and step-budgeted, so a rerun with the same flags, thread count and Python
version gives the same weights.

    python tools/train_default_model.py --out models/default --steps 1600 --threads 2
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

sys.path.insert(0, str(Path(__file__).resolve().parent))
from build_corpus import Corpus, build_corpus  # noqa: E402

BOS, EOS, PAD = "<|startoftext|>", "<|endoftext|>", "<|pad|>"
ROLES = ("system", "user", "assistant")
SPECIAL_TOKENS = [BOS, EOS, PAD] + [f"<|{role}|>" for role in ROLES]
# Every turn is a role marker, a newline, the text and EOS; generation stops at the end of
# the assistant's turn because that is the model's EOS.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
HELDOUT_SAMPLE_CHARS = 8000


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("models/default"))
    p.add_argument("--steps", type=int, default=1600)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=688)
    p.add_argument("--seq-len", type=int, default=512, help="training context; also max_position_embeddings")
    p.add_argument("--batch", type=int, default=4, help="sequences per step")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--log-every", type=int, default=50)
    return p.parse_args(argv)


# ---- tokenizer ---------------------------------------------------------------------------
def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    # Like Llama: encoding a text starts it with BOS, as every training document starts.
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, bos_id)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   extra_special_tokens=SPECIAL_TOKENS[3:], chat_template=CHAT_TEMPLATE,
                                   clean_up_tokenization_spaces=False)


def chat_text(tokenizer, question: str, answer: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": question},
                                          {"role": "assistant", "content": answer}], tokenize=False)


def encode_documents(tokenizer, docs: list[str]) -> list[list[int]]:
    """Each document as BOS text EOS."""
    eos = tokenizer.eos_token_id
    return [ids + [eos] for ids in tokenizer(docs, add_special_tokens=True)["input_ids"]]


def encode_chats(tokenizer, pairs: list[tuple[str, str]]) -> list[list[int]]:
    texts = [chat_text(tokenizer, q, a) for q, a in pairs]
    return tokenizer(texts, add_special_tokens=False)["input_ids"]  # the template brings BOS and EOS


# ---- data --------------------------------------------------------------------------------
def pack(sequences: list[list[int]], seq_len: int, seed: int) -> torch.Tensor:
    """Shuffle whole documents (seeded), concatenate, cut into [N, seq_len] rows."""
    order = list(range(len(sequences)))
    random.Random(seed).shuffle(order)
    stream = [t for i in order for t in sequences[i]]
    rows = len(stream) // seq_len
    return torch.tensor(stream[:rows * seq_len], dtype=torch.long).view(rows, seq_len)


def windows(sequences: list[list[int]], seq_len: int) -> list[torch.Tensor]:
    """Held-out text in source order, as consecutive windows scored independently."""
    stream = torch.tensor([t for s in sequences for t in s], dtype=torch.long)
    return list(stream.split(seq_len))


@torch.no_grad()
def perplexity(model: LlamaForCausalLM, chunks: list[torch.Tensor]) -> tuple[float, int]:
    """exp(mean next-token NLL) over every predicted token of every window."""
    model.eval()
    total, count = 0.0, 0
    for chunk in chunks:
        if len(chunk) < 2:
            continue
        logits = model(chunk.unsqueeze(0)).logits[0, :-1].float()
        total += torch.nn.functional.cross_entropy(logits, chunk[1:], reduction="sum").item()
        count += len(chunk) - 1
    model.train()
    return math.exp(total / count), count


# ---- model and loop ----------------------------------------------------------------------
def make_model(args, tokenizer) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq_len, rms_norm_eps=1e-5, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, initializer_range=0.02)
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(config)


def lr_at(step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))  # cosine down to 10%


def train(model, data: torch.Tensor, args, log: list) -> float:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(len(data), generator=gen)
    cursor, epoch = 0, 0
    start = time.perf_counter()
    running = None
    model.train()
    for step in range(args.steps):
        if cursor + args.batch > len(order):
            order, cursor, epoch = torch.randperm(len(data), generator=gen), 0, epoch + 1
        batch = data[order[cursor:cursor + args.batch]]
        cursor += args.batch
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        running = loss.item() if running is None else 0.95 * running + 0.05 * loss.item()
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            elapsed = time.perf_counter() - start
            entry = {"step": step + 1, "epoch": epoch, "loss": round(loss.item(), 4),
                     "smoothed_loss": round(running, 4), "lr": round(lr_at(step, args), 6),
                     "elapsed_s": round(elapsed, 1)}
            log.append(entry)
            print(f"step {step + 1}/{args.steps} epoch {epoch} loss {loss.item():.4f} (smoothed {running:.4f}) "
                  f"lr {entry['lr']:.2e} {elapsed / (step + 1):.2f} s/step", flush=True)
    return running


def save(model, tokenizer, out: Path, max_length: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    # float16 on disk keeps the folder small and loses less than bfloat16 would; loaders
    # on the CPU widen it back to float32.
    model.to(torch.float16).save_pretrained(out)
    model.to(torch.float32)
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                     pad_token_id=tokenizer.pad_token_id, do_sample=False, max_new_tokens=128).save_pretrained(out)
    tokenizer.save_pretrained(out, save_jinja_files=False)  # chat template inside tokenizer_config.json
    _make_tokenizer_config_portable(out / "tokenizer_config.json", max_length)


def _make_tokenizer_config_portable(path: Path, max_length: int) -> None:
    """transformers 5 names its own backend class and a v5-only key; name the class and key
    that 4.x knows too (5 reads both), so any supported transformers loads the folder."""
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["additional_special_tokens"] = config.pop("extra_special_tokens", [])
    config["model_max_length"] = max_length
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    # x86 is slow on denormal floats (tiny Adam states); the shipped weights were trained
    # with them flushed to zero, so a rerun must flush them too to match.
    torch.set_flush_denormal(True)
    random.seed(args.seed)
    t0 = time.perf_counter()
    corpus: Corpus = build_corpus()
    train_docs = [d.text for d in corpus.split(heldout=False)]
    heldout_docs = [d.text for d in corpus.split(heldout=True)]
    train_pairs = corpus.chat_split(heldout=False)
    tokenizer = train_tokenizer(train_docs + [f"{q}\n{a}" for q, a in train_pairs], args.vocab_size)
    train_seqs = encode_documents(tokenizer, train_docs) + encode_chats(tokenizer, train_pairs)
    heldout_seqs = encode_documents(tokenizer, heldout_docs)
    data = pack(train_seqs, args.seq_len, args.seed)
    eval_chunks = windows(heldout_seqs, args.seq_len)
    stats = {
        "python": sys.version.split()[0],
        "train_documents": len(train_docs), "train_chat_pairs": len(train_pairs),
        "train_characters": sum(map(len, train_docs)) + sum(len(q) + len(a) for q, a in train_pairs),
        "train_tokens": sum(map(len, train_seqs)), "heldout_documents": len(heldout_docs),
        "heldout_characters": sum(map(len, heldout_docs)), "heldout_tokens": sum(map(len, heldout_seqs)),
    }
    print(f"corpus and tokenizer ready in {time.perf_counter() - t0:.0f} s: {json.dumps(stats)}", flush=True)

    model = make_model(args, tokenizer)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"model: {num_params / 1e6:.2f}M parameters; {len(data)} training rows of {args.seq_len} tokens; "
          f"{args.steps * args.batch * args.seq_len / stats['train_tokens']:.1f} epochs planned", flush=True)
    log: list = []
    t_train = time.perf_counter()
    final_loss = train(model, data, args, log)
    train_seconds = time.perf_counter() - t_train

    save(model, tokenizer, args.out, args.seq_len)
    # Score what was shipped: the float16 weights, widened back to float32.
    shipped = LlamaForCausalLM.from_pretrained(args.out, dtype=torch.float32)
    ppl, n_tokens = perplexity(shipped, eval_chunks)
    print(f"held-out perplexity {ppl:.2f} over {n_tokens} predicted tokens", flush=True)
    sample = "\n\n".join(heldout_docs)[:HELDOUT_SAMPLE_CHARS]
    (args.out / "heldout_sample.txt").write_text(sample)
    sample_ppl, sample_tokens = perplexity(shipped, windows([tokenizer(sample)["input_ids"]], args.seq_len))
    result = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "corpus": stats, "parameters": num_params, "train_seconds": round(train_seconds, 1),
        "total_seconds": round(time.perf_counter() - t0, 1), "final_smoothed_train_loss": round(final_loss, 4),
        "heldout_perplexity": round(ppl, 3), "heldout_predicted_tokens": n_tokens,
        "heldout_sample_perplexity": round(sample_ppl, 3), "heldout_sample_predicted_tokens": sample_tokens,
        "torch": torch.__version__, "log": log,
    }
    (args.out / "training_log.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"saved to {args.out} ({train_seconds / 60:.1f} min training)", flush=True)


if __name__ == "__main__":
    main()
