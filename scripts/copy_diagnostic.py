"""Copying in isolation: train a model on nothing but "repeat this random string" and watch whether it
learns to copy (the skill the shipped clover-tiny and its peer lack, models/README.md).

Rows pack chat examples whose prompt holds a random string over --alphabet and whose answer repeats it;
only answers are scored, as in the task mixture. Chance accuracy is 1 / len(alphabet) per character;
a model that copies goes far above it. Three architectures, all at clover-tiny's width (hidden 128):

  python scripts/copy_diagnostic.py --arch clover --steps 600        # block diffusion at B = 1
  python scripts/copy_diagnostic.py --arch qwen3.5-moe --steps 3000  # the autoregressive peer
  python scripts/copy_diagnostic.py --arch gpt2 --layers 2           # a plain dense transformer

It prints step, loss, accuracy on the scored answer tokens and seconds.
"""

import argparse
import random
import time

import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

from cloverlm.evaluation.heldout import encode_example
from cloverlm.model.config import preset_config
from cloverlm.tasks import Example
from cloverlm.tokenizer import load_tokenizer
from cloverlm.training.scratch.archs import ARCHS
from cloverlm.training.scratch.data import Batch, Mixture
from cloverlm.training.scratch.recipe import Stage, TrainConfig


def copy_example(rng: random.Random, alphabet: str, lengths: tuple[int, int]) -> Example:
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(*lengths)))
    prompt = f"Text: {text}\nCopy the text above exactly."
    return Example(task="copy", seed=0, prompt=prompt, answer=text, truth=text, value_spans=((0, len(text)),))


def copy_batch(tokenizer, step: int, rows: int, seq_len: int, alphabet: str, lengths) -> Batch:
    input_ids = torch.full((rows, seq_len), tokenizer.pad_token_id)
    is_prompt = torch.zeros(rows, seq_len, dtype=torch.bool)
    is_pad = torch.ones(rows, seq_len, dtype=torch.bool)
    for row in range(rows):
        rng, position = random.Random(f"{step}/{row}"), 0
        while True:
            encoded = encode_example(tokenizer, copy_example(rng, alphabet, lengths))
            end = position + len(encoded.ids)
            if end > seq_len:
                break
            input_ids[row, position:end] = torch.tensor(encoded.ids)
            is_prompt[row, position : position + encoded.prompt_length] = True
            is_pad[row, position:end] = False
            position = end
    return Batch(input_ids, is_prompt, is_pad)


def gpt2_loss(model, batch: Batch):
    scored = batch.eligible(chat_mode=True)[:, 1:]
    logits = model(batch.input_ids).logits[:, :-1][scored]
    targets = batch.input_ids[:, 1:][scored]
    return F.cross_entropy(logits.float(), targets), (logits.argmax(-1) == targets).float().mean()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", choices=("clover", "qwen3.5-moe", "gpt2"), default="clover")
    parser.add_argument("--layers", type=int, default=2, help="gpt2 only")
    parser.add_argument("--alphabet", default="0123456789")
    parser.add_argument("--min-len", type=int, default=24)
    parser.add_argument("--max-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokenizer", default="models/scratch-tokenizer")
    parser.add_argument("--task", help="train on this task generator instead of random strings")
    parser.add_argument("--messages", type=int, default=1, help="no_fly_zones messages per prompt (with --task)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(args.tokenizer)
    torch.manual_seed(0)
    if args.arch == "gpt2":
        config = GPT2Config(vocab_size=len(tokenizer), n_positions=args.seq_len, n_embd=128, n_layer=args.layers, n_head=4)
        model, loss_of = GPT2LMHeadModel(config), gpt2_loss
    else:
        config = preset_config(
            "clover-tiny", vocab_size=len(tokenizer), mask_token_id=tokenizer.mask_token_id,
            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        )  # fmt: skip
        arch = ARCHS[args.arch]
        model = arch.build(config)
        cfg, stage = TrainConfig(seq_len=args.seq_len, batch_size=args.rows), Stage([1], 1.0, chat_mode=True)

        def loss_of(model, batch):
            step_loss = arch.loss(model, batch, stage, cfg, 0, slice(None))
            return step_loss.total, step_loss.accuracy

    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    started = time.perf_counter()
    if args.task:
        sizes = {"no_fly_zones": {"n_messages": (args.messages, args.messages)}}
        mixture = Mixture(tokenizer, {args.task: 1.0}, args.seq_len, None, sizes)
    for step in range(args.steps):
        if args.task:
            batch = mixture.batch(0, step, args.rows)
        else:
            batch = copy_batch(tokenizer, step, args.rows, args.seq_len, args.alphabet, (args.min_len, args.max_len))
        for group in optimizer.param_groups:
            group["lr"] = args.lr * min(1.0, (step + 1) / 20)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, accuracy = loss_of(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if args.arch == "clover":
            model.update_router_bias()
        if step % 25 == 0 or step + 1 == args.steps:
            print(f"{step} loss={loss.item():.3f} acc={accuracy.item():.3f} {time.perf_counter() - started:.0f}s", flush=True)


if __name__ == "__main__":
    main()
